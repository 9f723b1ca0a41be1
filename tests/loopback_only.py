"""The test session in a network namespace of its own whose only interface is `lo`.

Tests, benchmarks and examples may talk to 127.0.0.0/8 and [::1] only. Inside this namespace anything else
(the machine's outward address, which Ray and some servers pick by default, or any other host) is
unreachable, so a test that strays fails instead of quietly sending traffic. Every process a test starts
(servers, Ray nodes, launch's instances) inherits the namespace.

It needs CAP_SYS_ADMIN (root, as on our CI machines). Where that is missing, or PDSERVE_TEST_NETWORK=host is
set, the session runs on the host's network and the report header says so.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
IFREQ = "16sH22x"  # struct ifreq: the interface's name, then its flags
OPT_OUT = "PDSERVE_TEST_NETWORK"


def enter_loopback_namespace() -> str:
    """Move this (still single-threaded) process into a new network namespace and bring `lo` up there; what
    the session's network is, in words."""
    if os.environ.get(OPT_OUT) == "host":
        return f"the host's ({OPT_OUT}=host)"
    if os.environ.get(OPT_OUT) == "loopback-only":  # a parent already did it (pytest inside pytest)
        return "a namespace with only lo (inherited)"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        return f"the host's (a namespace of its own was refused: {os.strerror(ctypes.get_errno())})"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(IFREQ, fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))
    os.environ[OPT_OUT] = "loopback-only"
    return "a namespace with only lo: traffic off 127.0.0.0/8 and ::1 fails"


def outward_address_reachable(timeout: float = 1.0) -> bool:
    """Whether a datagram socket can be aimed off this machine (the route Ray uses to find its address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1, not contacted: a UDP connect sends nothing
        except OSError:
            return False
    return True
