"""A stop flag that a signal handler may set.

A `threading.Event` must not be set from a signal handler: the handler runs in the main thread between two
bytecodes, possibly inside that same thread's `Event.wait`, and `Event.set` then waits for a lock the
interrupted frame holds (seen: `pdserve launch` deaf to Ctrl-C, three handlers stacked on one lock). Setting this
flag takes no lock: a bool and a byte written to a pipe that waiters select on.
"""

from __future__ import annotations

import os
import select


class StopFlag:
    """The `is_set` / `wait` / `set` of `threading.Event`, signal-safe; once set it stays set."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            try:
                os.write(self._write, b"x")
            except BlockingIOError:  # the pipe is full: waiters wake anyway
                pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False when `timeout` seconds passed first."""
        if not self._set:
            select.select([self._read], [], [], timeout)
        return self._set
