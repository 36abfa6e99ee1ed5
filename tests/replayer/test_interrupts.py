"""Ctrl-C during an in-process replay is never lost: a KeyboardInterrupt that the interpreter
swallows (raised inside a weakref callback, as asyncio's WeakSet of tasks runs them) is raised again
between runs (:class:`replayer.executors.InterruptLatch`), so ``gpuhit replay`` stops with 130."""

from __future__ import annotations

import gc
import signal
import weakref

import pytest

from replayer import executors
from replayer.executors import InterruptLatch

# The swallowed KeyboardInterrupt is reported as unraisable: that report is the premise here.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class _Obj:
    pass


def _swallowed_ctrl_c() -> None:
    """SIGINT handled while a weakref callback runs: Python prints "Exception ignored" and goes on."""
    o = _Obj()
    ref = weakref.ref(o, lambda _: signal.raise_signal(signal.SIGINT))
    del o
    gc.collect()
    assert ref() is None


@pytest.fixture
def default_sigint():
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prev)


def test_the_latch_raises_a_swallowed_ctrl_c_at_its_next_check(default_sigint):
    with InterruptLatch() as latch:
        latch.check()  # nothing yet
        _swallowed_ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            latch.check()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored on exit


def test_a_plain_ctrl_c_still_raises_at_once(default_sigint):
    with InterruptLatch(), pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


def test_an_inline_replay_stops_before_its_next_run(default_sigint, monkeypatch):
    ran = []

    def task(job):
        ran.append(job["index"])
        if job["index"] == 0:
            _swallowed_ctrl_c()  # swallowed during the first run, which still finishes
        return job["index"], {"index": job["index"]}

    monkeypatch.setattr(executors, "_local_task", task)
    runs = executors.run_local([{"index": i} for i in range(3)], {}, n_jobs=1)
    got = []
    with pytest.raises(KeyboardInterrupt):
        for idx, _ in runs:
            got.append(idx)
    assert got == [0] and ran == [0]  # the first run was delivered (and saved); the next never started
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
