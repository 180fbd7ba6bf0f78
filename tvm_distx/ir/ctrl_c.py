"""Ctrl-C while TVM runs: reported as an interruption, never as a compiler failure.

TVM's passes call back into Python (our module passes, TVMScript printers, pass
instruments). A Ctrl-C that lands in such a callback raises ``KeyboardInterrupt`` there,
and TVM's FFI carries it back to the caller as an empty ``RuntimeError``: a user who
pressed Ctrl-C would read "stage 'build' failed inside TVM: RuntimeError". While
:class:`CtrlCWatch` is entered, each SIGINT is noted before the handler in place runs, and
an exception that leaves the block after a Ctrl-C becomes the ``KeyboardInterrupt`` it
stands for.
"""

from __future__ import annotations

import signal
import threading
from types import TracebackType

__all__ = ["CtrlCWatch"]


class CtrlCWatch:
    """Context manager: an exception raised after a Ctrl-C leaves as ``KeyboardInterrupt``.

    It only watches in the main thread while a Python SIGINT handler is installed (the
    only case in which a Ctrl-C reaches Python code at all); elsewhere it does nothing.

    Examples
    --------
    >>> with CtrlCWatch():
    ...     pass
    """

    def __init__(self) -> None:
        self.pressed = False
        self._previous = None

    def _noted(self, signum: int, frame) -> None:
        self.pressed = True
        self._previous(signum, frame)

    def __enter__(self) -> CtrlCWatch:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):
                self._previous = previous
                signal.signal(signal.SIGINT, self._noted)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if err is not None and self.pressed and not isinstance(err, KeyboardInterrupt):
            raise KeyboardInterrupt from err
