"""`gpuhit replay --api chat|messages|responses`: the live replayer drives a trace through each text
dialect against an emulated vLLM server over real HTTP; each turn's conversation keeps the trace's
prefix structure, so later turns of a session hit the prefix cache (read from each dialect's field)."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import pytest

from engines.emulated.engine import EmulatedEngine
from replayer.arrivals import ArrivalConfig
from replayer.dialects import Conversations
from replayer.driver import DriverConfig, replay
from replayer.live import HttpTarget
from replayer.synth import TokenSynthesizer
from tests.e2e.helpers import servers
from tests.e2e.test_live_replay import fast_profile, small_trace


def test_conversation_pieces_follow_the_prefix_structure():
    trace = small_trace()
    synth = TokenSynthesizer(seed=1)
    conv = Conversations(synth)
    s = trace.sessions[0]
    turns = [conv.messages(s, k, synth.prompt_tokens(s, k)) for k in range(3)]
    assert all(t[-1][0] == "user" for t in turns)
    # each turn resends the previous one's messages but its last (the partial tail), then goes on
    for a, b in itertools.pairwise(turns):
        assert b[: len(a) - 1] == a[:-1] and len(b) > len(a)
    assert [r for r, _ in turns[2]] == ["user", "assistant", "user", "assistant", "user"]


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_replay_through_each_dialect(api):
    async def main():
        engines = [EmulatedEngine("emu0", fast_profile(), num_gpu_blocks=256, model_name="m")]
        async with servers(engines, model="m") as srvs, aiohttp.ClientSession() as http:
            target = HttpTarget(f"http://127.0.0.1:{srvs[0].port}", TokenSynthesizer(seed=1), http, api=api)
            out = await replay(small_trace(), target, DriverConfig(arrival=ArrivalConfig(time_scale=0.0)))
        recs = out.records
        assert len(recs) == 12 and all(r.ok for r in recs), [r.error for r in recs if r.error]
        assert all(r.output_tokens == 4 and r.first_token <= r.finish for r in recs)
        assert all(r.realized_hit_tokens > 0 for r in recs if r.turn > 0)
        for e in engines:
            await e.close()

    asyncio.run(main())
