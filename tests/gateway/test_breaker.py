"""The circuit breaker's state machine (gateway/breaker.py) on a fake clock."""

from __future__ import annotations

import pytest

from gateway.breaker import CLOSED, CONNECT, HALF_OPEN, OPEN, TIMEOUT, BreakerPolicy, CircuitBreaker
from gpuhit.errors import ConfigError


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(**kw) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(BreakerPolicy(**kw).validate(), clock), clock


def test_consecutive_timeouts_open_it_a_success_in_between_resets_the_count():
    b, _ = make(failure_threshold=3)
    assert not b.failure(TIMEOUT, "t1")
    assert not b.failure(TIMEOUT, "t2")
    b.success()
    assert not b.failure(TIMEOUT, "t3")
    assert not b.failure(TIMEOUT, "t4")
    assert b.state == CLOSED and b.consecutive == 2
    assert b.failure(TIMEOUT, "t5")
    assert b.state == OPEN and b.reason == "3 consecutive failures, last: t5"
    assert not b.failure(TIMEOUT, "t6")  # already open: not opened again
    assert b.opens == 1


def test_one_refused_connect_opens_it():
    b, clock = make(failure_threshold=3, connect_threshold=1, cooldown=2.0)
    assert b.failure(CONNECT, "refused")
    assert b.state == OPEN and b.probe_at == clock.t + 2.0


def test_probe_after_cooldown_closes_it():
    b, clock = make(cooldown=2.0)
    b.failure(CONNECT, "refused")
    assert not b.probe_due()
    clock.t += 1.999
    assert not b.probe_due()
    clock.t += 0.001
    assert b.probe_due()
    b.begin_probe()
    assert b.state == HALF_OPEN and not b.probe_due()
    b.probe_done(True)
    assert b.state == CLOSED and b.closed and b.reason is None and b.probe_at is None
    assert dict(b.transitions) == {(CLOSED, OPEN): 1, (OPEN, HALF_OPEN): 1, (HALF_OPEN, CLOSED): 1}


def test_failed_probes_back_off_exponentially_up_to_the_cap_then_reset_on_success():
    b, clock = make(cooldown=1.0, max_cooldown=5.0, backoff=2.0)
    b.failure(CONNECT, "refused")
    waits = []
    for _ in range(5):
        waits.append(b.probe_at - clock.t)
        clock.t = b.probe_at
        b.begin_probe()
        b.probe_done(False, "still wedged")
        assert b.state == OPEN and b.reason.endswith("failed: still wedged")
    waits.append(b.probe_at - clock.t)
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    clock.t = b.probe_at
    b.begin_probe()
    b.probe_done(True)
    assert b.cooldown == 1.0 and b.probes == 6
    b.failure(CONNECT, "refused again")
    assert b.probe_at - clock.t == 1.0


def test_successes_of_requests_in_flight_never_close_an_open_breaker():
    """Only the probe re-admits: a request that was answered before the ejection does not."""
    b, clock = make(failure_threshold=1)
    b.failure(TIMEOUT, "wedged")
    b.success()
    assert b.state == OPEN
    clock.t = b.probe_at
    b.begin_probe()
    b.success()
    assert b.state == HALF_OPEN
    assert not b.failure(TIMEOUT, "late")  # nor does a late failure re-open a half-open one
    assert b.state == HALF_OPEN


def test_misuse_and_bad_settings_are_refused():
    b, _ = make()
    with pytest.raises(ValueError, match="unknown failure kind"):
        b.failure("boom", "x")
    with pytest.raises(ValueError, match="begin_probe on a closed"):
        b.begin_probe()
    with pytest.raises(ValueError, match="probe_done on a closed"):
        b.probe_done(True)
    for kw in ({"failure_threshold": 0}, {"cooldown": 0.0}, {"cooldown": 10.0, "max_cooldown": 5.0},
               {"backoff": 0.5}):
        with pytest.raises(ConfigError):
            BreakerPolicy(**kw).validate()


def test_gateway_config_validates_the_new_settings_and_the_cli_sets_them():
    from gateway import config as gcfg
    from replayer.cli import build_parser

    base = gcfg.GatewayConfig(engines=(gcfg.EngineEntry("http://a:1", "e0"),))
    for kw in ({"breaker_threshold": 0}, {"ttfb_timeout": -1.0}, {"idle_timeout": -1.0},
               {"breaker_cooldown": 5.0, "breaker_max_cooldown": 1.0}):
        with pytest.raises(ConfigError):
            gcfg.with_overrides(base, **kw).validate()
    args = build_parser().parse_args(["serve", "--engine", "http://a:1", "--ttfb-timeout", "2.5", "--idle-timeout",
                                      "7", "--breaker-threshold", "4", "--breaker-cooldown", "0.5"])
    assert (args.ttfb_timeout, args.idle_timeout, args.breaker_threshold, args.breaker_cooldown) == (2.5, 7.0, 4, 0.5)
