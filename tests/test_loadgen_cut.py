"""validate.loadgen.cut_at: an attempt is cut at its deadline whatever its
task does with the cancellation (an HTTP library that loses it, as seen under
a retry storm, must not hold a client's call past its deadline)."""
from __future__ import annotations

import asyncio

import pytest

from validate.loadgen import LINGERING, cut_at


async def swallows_cancel(hold: asyncio.Event) -> str:
    """A task that loses its first cancellation, as the storm's attempts did."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass
    await hold.wait()
    return "late"


def test_a_task_that_loses_its_cancellation_is_cut_at_the_deadline_and_kept_lingering():
    async def main():
        hold = asyncio.Event()
        with pytest.raises(TimeoutError):       # the task runs until `hold` is set: not awaited
            await cut_at(swallows_cancel(hold), 0.05)
        lingering = len(LINGERING)
        hold.set()
        for _ in range(5):
            await asyncio.sleep(0)
        return lingering, len(LINGERING)

    lingering, after = asyncio.run(main())
    assert lingering == 1 and after == 0


def test_an_answer_within_the_deadline_is_returned_and_its_error_raised():
    async def ok():
        await asyncio.sleep(0)
        return 7

    async def broken():
        raise ValueError("bad stream")

    async def main():
        assert await cut_at(ok(), 5.0) == 7
        with pytest.raises(ValueError, match="bad stream"):
            await cut_at(broken(), 5.0)
        assert not LINGERING

    asyncio.run(main())


def test_cancelling_the_caller_cancels_the_attempt():
    async def main():
        started = asyncio.Event()

        async def slow():
            started.set()
            await asyncio.sleep(3600)

        task = asyncio.ensure_future(slow())
        caller = asyncio.ensure_future(cut_at(task, 3600))
        await started.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0)
        return task.cancelled()

    assert asyncio.run(main())
