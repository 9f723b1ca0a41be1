"""Sweep what killed pdserve processes left behind.

A process stopped with SIGKILL runs no cleanup: its IPC folder (`pdserve-PID-*` in the temp folder,
engine and worker sockets inside) and the KV cache segment it created (`/dev/shm/pdserve-kv-PID-*`)
stay. Both names carry the owner's pid, so the next engine start removes those whose owner is gone.
A live owner's are never touched. (The pid is read in this machine's pid namespace: containers that
share /dev/shm or a temp folder must share the pid namespace too.)
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


def ipc_folder_prefix(pid: int) -> str:
    return f"pdserve-{pid}-"


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
    temp = temp_dir or Path(tempfile.gettempdir())
    for folder, pattern, remove in ((temp, IPC_FOLDER, lambda p: shutil.rmtree(p, ignore_errors=True)),
                                    (shm_dir, SEGMENT, lambda p: p.unlink(missing_ok=True))):
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
