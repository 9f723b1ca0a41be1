"""Give freed heap memory back to the OS (glibc only; a no-op elsewhere).

Loading a tokenizer parses a few MB of JSON into ~40 MB of short-lived allocations that glibc keeps
in its arenas: without this, the router and the API server each stayed ~30 MB larger for their life.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


def release_freed_memory() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # musl has no malloc_trim
        pass
