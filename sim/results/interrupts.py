"""Ctrl-C where a job must not be cut mid-step: inside the block, SIGINT calls a handler (which
records it, or asks a loop to stop at a safe point) instead of raising KeyboardInterrupt."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def on_sigint(handler: Callable[[], None]) -> Iterator[None]:
    """Call `handler()` on Ctrl-C inside the block; the previous behaviour comes back after.
    Outside the main thread (a Ray worker, say) signals cannot be caught: nothing changes."""
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: handler())
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
