"""Ctrl-C that stops a run cleanly.

Outside a critical section, SIGINT raises KeyboardInterrupt at once (a model call or a build can be
abandoned: nothing is half written). Inside one (writing a source file, the summary, the commit),
it is deferred and raised when the section ends, so what was being written is written whole.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class InterruptGuard:
    """Installs a SIGINT handler for the duration of a `with` block (main thread only)."""

    def __init__(self) -> None:
        self._depth = 0
        self.pending = False
        self.interrupted = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        self.interrupted = True
        if self._depth:
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextmanager
    def critical(self):
        """A section that Ctrl-C does not cut; a Ctrl-C received inside is raised after it."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
