"""The cluster secret: how routers, prefill and decode instances know each other.

Every member of a deployment gets the same secret (`--cluster-secret`, or the environment variable
PDSERVE_CLUSTER_SECRET, which is how child processes receive it: a command line is readable by
every user of the host). It is never sent; it keys HMAC-SHA256 tags, one label per use:

- registration with the router: the path and body are signed with a timestamp
  (`X-PDServe-Signature`), and the router takes each signature once;
- the PD control plane (ZMQ): every message carries a timestamp, a nonce and a tag; ZMQ hides
  connects and reconnects, so each message is checked rather than each connection, and a replayed
  tag is refused;
- the tcp KV stream: the receiver sends a random challenge on accept and takes no byte of KV until
  the writer answers it with the right tag.

Without a secret the same framing is used with an empty key: it authenticates nothing, but two
members whose secrets differ see a clear "bad tag" error instead of garbage.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

ENV = "PDSERVE_CLUSTER_SECRET"
SIGNATURE_HEADER = "X-PDServe-Signature"
MAX_SKEW = 300.0  # seconds a signed message stays valid (covers clock skew between hosts)
_CONTROL = struct.Struct("<4sd8s32s")  # magic, timestamp, nonce, tag; the payload follows
_CONTROL_MAGIC = b"PDC1"
_CHALLENGE_BYTES = 16


class AuthError(Exception):
    pass


def cluster_secret() -> bytes:
    return os.environ.get(ENV, "").encode()


def _tag(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(secret, label, hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


# ---- HTTP (registration) -----------------------------------------------------------------------

def sign_body(secret: bytes, path: str, body: bytes, now: float | None = None) -> str:
    ts = f"{time.time() if now is None else now:.6f}"
    return f"t={ts},sig={_tag(secret, b'http', path.encode(), b' ', ts.encode(), b'.', body).hex()}"


class SignatureCheck:
    """The router's side: a fresh signature of this path and body, never seen before."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self._seen: dict[bytes, float] = {}
        self._next_prune = 0.0

    def verify(self, path: str, body: bytes, header: str | None, now: float | None = None) -> None:
        """Raises AuthError unless `header` signs `path` and `body` with the secret, and is new."""
        now = time.time() if now is None else now
        sig = _verify(self.secret, path, body, header, now)
        if sig in self._seen:
            raise AuthError("replayed signature")
        self._seen[sig] = now
        if now > self._next_prune:
            self._seen = {s: t for s, t in self._seen.items() if now - t <= 2 * MAX_SKEW}
            self._next_prune = now + 10.0


def _verify(secret: bytes, path: str, body: bytes, header: str | None, now: float) -> bytes:
    if not header:
        raise AuthError(f"no {SIGNATURE_HEADER} header (the instance needs --cluster-secret)")
    try:
        fields = dict(part.split("=", 1) for part in header.split(","))
        ts, sig = fields["t"], bytes.fromhex(fields["sig"])
        age = now - float(ts)
    except (KeyError, ValueError):
        raise AuthError(f"malformed {SIGNATURE_HEADER} header") from None
    if not hmac.compare_digest(sig, _tag(secret, b"http", path.encode(), b" ", ts.encode(), b".", body)):
        raise AuthError("bad signature (is --cluster-secret the same on the router and the instance?)")
    if abs(age) > MAX_SKEW:
        raise AuthError(f"signature is {age:.0f} s old (clocks apart, or a replay)")
    return sig


# ---- ZMQ control messages ----------------------------------------------------------------------

class ControlSeal:
    """Seals outgoing control messages and opens incoming ones, refusing forged or replayed ones."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._seen: dict[bytes, float] = {}  # tags of messages already opened, until they expire
        self._next_prune = 0.0

    def seal(self, payload: bytes) -> bytes:
        ts, nonce = time.time(), os.urandom(8)
        tag = _tag(self._secret, b"control", struct.pack("<d", ts), nonce, payload)
        return _CONTROL.pack(_CONTROL_MAGIC, ts, nonce, tag) + payload

    def open(self, raw: bytes) -> bytes:
        """The payload of a sealed message. Raises AuthError."""
        if len(raw) < _CONTROL.size or raw[:4] != _CONTROL_MAGIC:
            raise AuthError("not a sealed pdserve control message")
        _, ts, nonce, tag = _CONTROL.unpack_from(raw)
        payload = raw[_CONTROL.size:]
        if not hmac.compare_digest(tag, _tag(self._secret, b"control", struct.pack("<d", ts), nonce, payload)):
            raise AuthError("bad tag (forged, or --cluster-secret differs between the instances)")
        now = time.time()
        if abs(now - ts) > MAX_SKEW:
            raise AuthError(f"message is {now - ts:.0f} s old")
        if tag in self._seen:
            raise AuthError("replayed message")
        self._seen[tag] = ts
        if now > self._next_prune:
            self._seen = {t: s for t, s in self._seen.items() if now - s <= MAX_SKEW}
            self._next_prune = now + 10.0
        return payload


# ---- tcp KV stream -----------------------------------------------------------------------------

def challenge_peer(sock: socket.socket, secret: bytes, timeout: float = 10.0) -> None:
    """Receiver side, right after accept: raises AuthError unless the peer proves it has the secret."""
    nonce = os.urandom(_CHALLENGE_BYTES)
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        sock.sendall(nonce)
        answer = _recv_exactly(sock, 32)
    except (OSError, ConnectionError) as e:
        raise AuthError(f"no answer to the challenge: {e}") from None
    finally:
        sock.settimeout(previous)
    if not hmac.compare_digest(answer, _tag(secret, b"kv-stream", nonce)):
        raise AuthError("wrong answer to the challenge (no or another --cluster-secret)")


def answer_challenge(sock: socket.socket, secret: bytes) -> None:
    """Writer side, right after connect. Raises OSError/ConnectionError if the link breaks."""
    sock.sendall(_tag(secret, b"kv-stream", _recv_exactly(sock, _CHALLENGE_BYTES)))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)
