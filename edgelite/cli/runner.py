"""Running a command's coroutine: uvloop where it is installed, plain asyncio otherwise."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def install_uvloop() -> bool:
    """Use uvloop when installed (it does not build on Android: plain asyncio is fine there)."""
    try:
        import uvloop
    except ImportError:
        log.debug("uvloop is not installed; using asyncio's own event loop")
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def run(coro: Coroutine[Any, Any, T]) -> T:
    install_uvloop()
    return asyncio.run(coro)
