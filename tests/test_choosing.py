"""Constrained token choices off the scheduling loop's path (serve/choosing.py): a request
whose token is being chosen is busy until its choice ends, the loop is woken then, a failure
that is not the request's own reaches the loop once, and none is left running at close."""

from __future__ import annotations

import asyncio

import pytest

from edgelite.serve.choosing import Choosing

pytestmark = pytest.mark.unit


def test_a_choice_is_busy_until_it_ends_and_wakes_the_loop() -> None:
    async def main() -> None:
        wake = asyncio.Event()
        choosing = Choosing(wake)
        gate = asyncio.Event()
        done: list[str] = []

        async def choice(name: str) -> None:
            await gate.wait()
            done.append(name)

        choosing.start("a", choice("a"))
        choosing.start("b", choice("b"))
        assert choosing.busy("a") and choosing.busy("b") and not choosing.busy("c")
        waited = asyncio.get_running_loop().create_task(choosing.wait_any(5.0))
        await asyncio.sleep(0.01)
        assert not waited.done()  # (nothing ended yet)
        gate.set()
        await waited
        await choosing.settle(["a"])
        assert not choosing.busy("a") and wake.is_set() and "a" in done
        await choosing.settle()
        assert done == ["a", "b"] and not choosing.tasks
        choosing.check()  # (no failure)

    asyncio.run(main())


def test_a_failure_reaches_the_loop_once_and_close_leaves_none_running() -> None:
    async def main() -> None:
        choosing = Choosing(asyncio.Event())

        async def broken() -> None:
            raise KeyError("a bug")

        choosing.start("x", broken())
        await choosing.settle()
        with pytest.raises(KeyError, match="a bug"):
            choosing.check()
        choosing.check()  # (raised once)
        forever = asyncio.Event()
        choosing.start("y", forever.wait())
        await choosing.close()
        assert not choosing.tasks

    asyncio.run(main())
