"""The deadlines' stall check over one engine's in-flight exchanges (a unit, on a real loop with
explicit times): no answer byte and no progress counter moving for the window -> reported once
per window; counters that move (a long non-streamed answer), or exchanges all writing to their
clients, are progress or owe the engine nothing."""

from __future__ import annotations

import asyncio

from gateway.http.forward_deadlines import Deadlines


def test_stall_is_reported_per_window_and_counters_count_as_progress():
    async def main():
        loop = asyncio.get_running_loop()
        stalls: list[tuple[int, str]] = []
        counters: list[float | None] = [None, None]
        d = Deadlines(loop, 2, ttfb=100.0, idle=100.0, stall=5.0, on_stall=lambda i, why: stalls.append((i, why)),
                      counters_at=lambda i: counters[i])
        wd = d.enter(0, 100.0, 100.0)
        t0 = d.progress_at[0]
        assert t0 == wd.last and d.progress_at[1] == float("-inf")
        d._check_stalls(t0 + 4.9)
        assert stalls == []
        counters[0] = t0 + 4.0  # the engine's counters moved: progress, though no byte came
        d._check_stalls(t0 + 8.9)
        assert stalls == []
        d._check_stalls(t0 + 9.0)
        assert [i for i, _ in stalls] == [0] and "no progress for 5 s with 1 request(s)" in stalls[0][1]
        d._check_stalls(t0 + 10.0)  # re-armed: not again within the next window
        assert len(stalls) == 1
        wd.last = None  # writing to its client: nothing owed by the engine
        d._check_stalls(t0 + 100.0)
        assert len(stalls) == 1
        wd.leave(cancelled=False)
        d.close()

    asyncio.run(main())


def test_an_engine_idle_before_its_first_request_starts_its_window_then():
    async def main():
        loop = asyncio.get_running_loop()
        stalls: list[int] = []
        d = Deadlines(loop, 1, ttfb=0.0, idle=0.0, stall=5.0, on_stall=lambda i, why: stalls.append(i))
        d.progress_at[0] = loop.time() - 1000.0  # its last byte long ago, then idle
        wd = d.enter(0, 0.0, 0.0)
        d._check_stalls(wd.last + 1.0)
        assert stalls == []
        wd.leave(cancelled=False)
        d.close()

    asyncio.run(main())


def test_suspected_after_a_fifth_of_the_window_and_cleared_when_it_moves():
    async def main():
        loop = asyncio.get_running_loop()
        seen: list[tuple[int, bool]] = []
        d = Deadlines(loop, 2, ttfb=100.0, idle=100.0, stall=5.0, on_stall=lambda i, why: None,
                      on_suspect=lambda i, on: seen.append((i, on)))
        wd = d.enter(1, 100.0, 100.0)
        t0 = d.progress_at[1]
        d._check_stalls(t0 + 0.9)
        assert seen == []
        d._check_stalls(t0 + 1.0)
        assert seen == [(1, True)] and d.suspected == [False, True]
        d._check_stalls(t0 + 1.5)
        assert seen == [(1, True)]  # once
        d.progress_at[1] = t0 + 1.6  # a byte came
        d._check_stalls(t0 + 1.7)
        assert seen == [(1, True), (1, False)]
        d._check_stalls(t0 + 2.7)
        assert seen[-1] == (1, True)
        wd.leave(cancelled=False)  # nothing in flight any more: nothing owed
        d._check_stalls(t0 + 50.0)
        assert seen[-1] == (1, False) and d.suspected == [False, False]
        d.close()

    asyncio.run(main())


def test_non_streamed_exchanges_owe_no_byte_before_their_end():
    async def main():
        loop = asyncio.get_running_loop()
        stalls: list[int] = []
        d = Deadlines(loop, 1, ttfb=100.0, idle=100.0, stall=5.0, on_stall=lambda i, why: stalls.append(i))
        unary = d.enter(0, 100.0, 100.0, streamed=False)
        t0 = unary.last
        d._check_stalls(t0 + 50.0)
        assert stalls == []
        stream = d.enter(0, 100.0, 100.0)  # the window starts with the first stream
        d._check_stalls(stream.last + 4.0)
        assert stalls == []
        d._check_stalls(stream.last + 5.0)
        assert stalls == [0]
        stream.leave(cancelled=False)
        unary.leave(cancelled=False)
        assert d.streams == [0]
        d.close()

    asyncio.run(main())


def test_an_exchange_leaves_its_engine_once_however_it_ends():
    """done() then leave(), or a fired deadline then leave(): the engine's set, its active count and
    its streams count each drop once (a second discard would drive them below zero)."""

    async def main():
        loop = asyncio.get_running_loop()
        d = Deadlines(loop, 1, ttfb=0.05, idle=0.05)
        wd = d.enter(0, 100.0, 100.0)
        assert d.in_flight[0] == {wd} and d._active == 1 and d.streams[0] == 1
        wd.done()
        assert d.in_flight[0] == set() and d._active == 0 and d.streams[0] == 0
        assert wd.leave(cancelled=False) is False
        assert d._active == 0 and d.streams[0] == 0

        async def exchange():
            w = d.enter(0, 0.01, 0.0, streamed=False)
            try:
                await asyncio.Event().wait()  # an engine that never answers
            except asyncio.CancelledError:
                return w, w.leave(cancelled=True)

        w, own = await exchange()  # the deadline cancels it: the sweep took it out first
        assert own is True and w.fired == "ttfb"
        assert d.in_flight[0] == set() and d._active == 0 and d.streams[0] == 0
        d.close()

    asyncio.run(main())
