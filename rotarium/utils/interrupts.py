"""Ctrl-C that cannot be lost.

Python turns SIGINT into a ``KeyboardInterrupt`` wherever the main thread happens to be; raised inside a finalizer
(``__del__``, a weakref callback, which garbage collection may run at any moment) it is printed as ignored and the
program goes on. The commands run within :func:`interrupts_recorded`, whose handler also records the signal, and
long loops call :func:`raise_if_interrupted` at safe points, so a Ctrl-C swallowed that way still stops the command
there.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_interrupted = threading.Event()


def on_interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGINT's handler: records the interrupt, then raises ``KeyboardInterrupt`` as Python's own handler does."""
    _interrupted.set()
    raise KeyboardInterrupt


@contextmanager
def interrupts_recorded() -> Iterator[None]:
    """Within it, :func:`on_interrupt` is SIGINT's handler (from the main thread, where Python allows one, unless
    SIGINT is ignored: a process a shell started in the background); the previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        yield
        return
    _interrupted.clear()
    signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _interrupted.clear()


def raise_if_interrupted() -> None:
    """Raises ``KeyboardInterrupt`` when a SIGINT came within :func:`interrupts_recorded` (once: the record is
    cleared)."""
    if _interrupted.is_set():
        _interrupted.clear()
        raise KeyboardInterrupt
