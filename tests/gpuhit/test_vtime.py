import asyncio
import threading

import pytest

from gpuhit import vtime
from gpuhit.errors import DeadlockError


def test_sleep_advances_virtual_clock_exactly():
    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def wake(d):
            await asyncio.sleep(d)
            return loop.time() - t0

        return await asyncio.gather(*(wake(d) for d in (5.0, 0.25, 3600.0)))

    assert vtime.run(main()) == [5.0, 0.25, 3600.0]


def test_order_of_timers_is_by_deadline():
    order = []

    async def main():
        async def wake(tag, d):
            await asyncio.sleep(d)
            order.append(tag)

        await asyncio.gather(wake("c", 3), wake("a", 1), wake("b", 2))

    vtime.run(main())
    assert order == ["a", "b", "c"]


def test_deadlock_is_reported_not_hung():
    async def main():
        await asyncio.get_running_loop().create_future()

    with pytest.raises(DeadlockError):
        vtime.run(main())


def test_thread_can_wake_the_loop():
    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        threading.Thread(target=lambda: loop.call_soon_threadsafe(fut.set_result, 42)).start()
        return await fut

    assert vtime.run(main()) == 42


def test_timers_due_at_the_same_instant_run_in_the_order_they_were_set():
    """asyncio's heap alone orders equal deadlines by heap shape; the virtual loop breaks ties FIFO,
    whatever other timers are pending (many unrelated ones here, set before and in between)."""
    order: list[int] = []

    async def main():
        loop = asyncio.get_running_loop()
        for i in range(200):
            loop.call_at(5.0 + (i % 7) * 0.25, lambda: None)  # unrelated timers shaping the heap
            loop.call_at(3.0, order.append, i)
            if i % 3 == 0:
                loop.call_at(1.0 + i * 0.01, lambda: None)
        await asyncio.sleep(10)

    vtime.run(main())
    assert order == list(range(200))
