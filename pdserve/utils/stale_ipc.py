"""Sweep what killed pdserve processes left behind.

A process stopped with SIGKILL runs no cleanup: its IPC folder (`pdserve-PID-*` in the temp folder, or in
/tmp where the temp folder's path is too long for a socket; engine and worker sockets inside) and the KV cache
segment it created (`/dev/shm/pdserve-kv-PID-*`) stay. Both names carry the owner's pid, so the next engine start
removes those whose owner is gone. A live owner's are never touched. (The pid is read in this machine's pid
namespace: containers that share /dev/shm or a temp folder must share the pid namespace too.)
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from pathlib import Path

import psutil

log = logging.getLogger("pdserve.engine")

IPC_FOLDER = re.compile(r"^pdserve-(\d+)-")
SEGMENT = re.compile(r"^pdserve-kv-(\d+)-")
SHM = Path("/dev/shm")


SOCKET_PATH_MAX = 107  # AF_UNIX: a socket's path holds 108 bytes with its terminating NUL
SOCKET_ROOM = 16  # the longest path pdserve makes inside an IPC folder: "/engine/w.ranks"
FALLBACK_ROOT = Path("/tmp")


def ipc_folder_prefix(pid: int) -> str:
    return f"pdserve-{pid}-"


def ipc_roots() -> list[Path]:
    """Where IPC folders are made: the temp folder, and /tmp for when its path is too long for a socket."""
    temp = Path(tempfile.gettempdir())
    return [temp] if temp == FALLBACK_ROOT else [temp, FALLBACK_ROOT]


def make_ipc_folder(pid: int) -> str:
    """A new private folder for a process's IPC sockets: in the temp folder, or in /tmp where the temp folder's
    path leaves no room for a socket's (a deep TMPDIR: zmq refuses such a socket only once it binds it)."""
    for root in ipc_roots():
        longest = len(str(root / f"{ipc_folder_prefix(pid)}{'x' * 8}")) + SOCKET_ROOM  # mkdtemp adds 8 characters
        if longest <= SOCKET_PATH_MAX and root.is_dir():
            return tempfile.mkdtemp(prefix=ipc_folder_prefix(pid), dir=root)
    temp = ipc_roots()[0]
    raise OSError(f"no folder for the engine's IPC sockets: the temp folder {temp} is {len(str(temp))} characters "
                  f"long, which leaves no room under the {SOCKET_PATH_MAX}-character limit of a socket's path, and "
                  f"{FALLBACK_ROOT} is not there; set TMPDIR to a shorter folder")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # another user's process: alive as far as we can tell
        return False


def sweep_stale(temp_dir: Path | None = None, shm_dir: Path = SHM) -> list[str]:
    """Remove IPC folders and KV segments whose owner process is gone; returns their names."""
    removed = []
    places = [(t, IPC_FOLDER, lambda p: shutil.rmtree(p, ignore_errors=True)) for t in
              ([temp_dir] if temp_dir else ipc_roots())]
    for folder, pattern, remove in [*places, (shm_dir, SEGMENT, lambda p: p.unlink(missing_ok=True))]:
        try:
            entries = list(folder.iterdir())
        except OSError:  # no /dev/shm (macOS) or an unreadable folder
            continue
        for path in entries:
            if (m := pattern.match(path.name)) and _gone(int(m.group(1))):
                try:
                    remove(path)
                    removed.append(path.name)
                except OSError as e:  # another user's, or removed meanwhile
                    log.debug("could not remove stale %s: %s", path, e)
    if removed:
        log.warning("removed %d IPC folder(s) and KV segment(s) left by killed processes: %s", len(removed),
                    ", ".join(sorted(removed)))
    return removed
