"""Engines sharing a host (``Profile.host_contention``): a step's time scales by the measured factor for
the number of the host's engines with work when it starts; alone, an engine times its steps exactly as
one without a host. Virtual time, round-number profile: times are asserted exactly."""

import asyncio
import json

import pytest

from engines.base import GenerateRequest
from engines.emulated.engine import EmulatedEngine
from engines.emulated.profile import load_profile
from engines.emulated.shared_host import SharedHost
from gpuhit import vtime
from gpuhit.errors import ConfigError
from replayer.sim_engines import emulated_factory

from .conftest import tiny_profile


def _pair(factors=(1.0, 2.0)):
    host = SharedHost(factors)
    prof = tiny_profile(host_contention=tuple(factors))
    return EmulatedEngine("a", prof, host=host), EmulatedEngine("b", prof, host=host)


def test_alone_on_a_shared_host_an_engine_steps_as_without_one():
    async def main():
        a, b = _pair()
        res = await a.generate(GenerateRequest("r", 20, 3))
        await a.close()
        await b.close()
        return res

    res = vtime.run(main())
    # chunks 8, 8, 4 (1 s + 10 ms/token each), then 2 decode steps of 1 s: as in test_engine.py
    assert (res.first_token_time, res.finish_time) == pytest.approx((3.2, 5.2))


def test_both_busy_every_step_takes_the_two_engine_factor():
    async def main():
        a, b = _pair()
        got = await asyncio.gather(a.generate(GenerateRequest("r", 20, 3)), b.generate(GenerateRequest("s", 20, 3)))
        await a.close()
        await b.close()
        return got

    for res in vtime.run(main()):
        assert (res.first_token_time, res.finish_time) == pytest.approx((6.4, 10.4))


def test_the_factor_follows_the_other_engine_step_by_step():
    async def main():
        a, b = _pair()

        async def later():
            await asyncio.sleep(2.0)
            return await b.generate(GenerateRequest("s", 4, 1))

        got = await asyncio.gather(a.generate(GenerateRequest("r", 20, 3)), later())
        await a.close()
        await b.close()
        return got

    ra, rb = vtime.run(main())
    # a: 0-1.08, 1.08-2.16 alone; b arrives at 2.0 while a works: b's one step (1.04 s) doubled, 2.0-4.08;
    # a's third chunk starts at 2.16 with b busy (2 x 1.04 -> 4.24), its decode steps after 4.08 alone again
    assert rb.finish_time == pytest.approx(4.08)
    assert (ra.first_token_time, ra.finish_time) == pytest.approx((4.24, 6.24))


def test_the_factory_puts_consecutive_engines_on_hosts_of_the_tables_length():
    prof = tiny_profile(host_contention=(1.0, 1.5))
    make = emulated_factory(prof)
    engines = [make(f"gpu{i}", i, None) for i in range(4)]
    assert engines[0].host is engines[1].host is not engines[2].host is engines[3].host
    assert not any(e.jump_decode for e in engines)  # each step reads the host: no jumps computed up front
    for plain in (tiny_profile(), tiny_profile(host_contention=(1.0, 1.0))):
        e = emulated_factory(plain)("gpu0", 0, None)
        assert e.host is None and e.jump_decode


def test_a_profile_file_holds_the_table_as_busy_engines_to_factor(tmp_path):
    entry = {"model": "m", "gpu": "cpu", "kv_bytes_per_token": 1, "gpu_kv_capacity_bytes": 4096, "max_model_len": 64,
             "block_size": 16}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"profiles": {"x": {**entry, "host_contention": {"2": 1.7, "1": 1.0}}}}))
    assert load_profile(f"{path}#x").host_contention == (1.0, 1.7)
    path.write_text(json.dumps({"profiles": {"x": entry}}))
    assert load_profile(f"{path}#x").host_contention == ()
    for bad in ({"1": 1.0, "3": 2.0}, {"1": 1.2, "2": 2.0}, {"1": 1.0, "2": -1.0}, {"one": 1.0}, "fast"):
        path.write_text(json.dumps({"profiles": {"x": {**entry, "host_contention": bad}}}))
        with pytest.raises(ConfigError, match="host_contention"):
            load_profile(f"{path}#x")


def test_a_host_takes_no_more_engines_than_its_table_covers():
    host = SharedHost((1.0, 1.3))
    host.join(object())
    host.join(object())
    with pytest.raises(ConfigError, match="covers 2 engines"):
        host.join(object())
    with pytest.raises(ConfigError):
        SharedHost((2.0,))
