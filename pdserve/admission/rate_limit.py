"""Fair shares: token buckets per client key, on requests per second and on tokens per second.

`--rate-limit FILE` names a YAML file, read again when it changes (checked at most once a second):

    default:                  # every key not listed below gets its own buckets of this size
      requests_per_second: 2
      tokens_per_second: 2000
    keys:
      sk-team-a:              # a Bearer token
        requests_per_second: 10
        tokens_per_second: 20000
        burst_seconds: 2      # bucket depth in seconds of its rate (default 1)
      user:alice:             # the request's `user` field (with no token, or the server's one --api-key)
        requests_per_second: 1

A request takes one request token and its prompt tokens when admitted; its generated tokens are taken when
it ends. The token bucket may go into debt (a prompt larger than the bucket still passes when the bucket is
full); while a bucket is empty or in debt, the key's requests are refused (429) with the seconds until it refills.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from pdserve.admission.predictor import Refusal

log = logging.getLogger("pdserve.admission")

RELOAD_CHECK_S = 1.0


@dataclass(frozen=True)
class Limit:
    requests_per_second: float | None = None
    tokens_per_second: float | None = None
    burst_seconds: float = 1.0

    @classmethod
    def parse(cls, name: str, spec: object) -> Limit:
        if not isinstance(spec, dict):
            raise ValueError(f"{name}: expected requests_per_second / tokens_per_second / burst_seconds")
        unknown = set(spec) - {"requests_per_second", "tokens_per_second", "burst_seconds"}
        if unknown:
            raise ValueError(f"{name}: unknown field(s) {', '.join(sorted(unknown))}")
        limit = cls(**spec)
        for field, value in vars(limit).items():
            if value is not None and (not isinstance(value, int | float) or value <= 0):
                raise ValueError(f"{name}.{field} must be a positive number, got {value!r}")
        return limit


class Bucket:
    def __init__(self, rate: float, depth: float) -> None:
        self.rate, self.depth = rate, depth
        self.level, self.updated = depth, time.monotonic()

    def refill(self, now: float) -> None:
        self.level = min(self.depth, self.level + max(0.0, now - self.updated) * self.rate)
        self.updated = max(now, self.updated)

    def wait(self, need: float) -> float:
        """Seconds until the level reaches `need` (0: now)."""
        return max(0.0, (need - self.level) / self.rate)


class KeyState:
    def __init__(self, limit: Limit) -> None:
        self.limit = limit
        b = limit.burst_seconds
        self.requests = Bucket(limit.requests_per_second, max(1.0, limit.requests_per_second * b)) \
            if limit.requests_per_second else None
        self.tokens = Bucket(limit.tokens_per_second, limit.tokens_per_second * b) if limit.tokens_per_second else None


class RateLimits:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.default, self.keys = self._load()
        self._mtime = path.stat().st_mtime
        self._checked = time.monotonic()
        self._state: dict[str, KeyState] = {}

    def _load(self) -> tuple[Limit | None, dict[str, Limit]]:
        try:
            data = yaml.safe_load(self.path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"--rate-limit {self.path}: {e}") from None
        if not isinstance(data, dict) or set(data) - {"default", "keys"}:
            raise ValueError(f"--rate-limit {self.path}: expected `default:` and `keys:` at the top")
        default = Limit.parse("default", data["default"]) if data.get("default") is not None else None
        keys = data.get("keys") or {}
        if not isinstance(keys, dict):
            raise ValueError(f"--rate-limit {self.path}: `keys` must map each key to its limits")
        return default, {str(k): Limit.parse(f"keys.{k}", v) for k, v in keys.items()}

    def _reload_if_changed(self, now: float) -> None:
        if now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        try:
            mtime = self.path.stat().st_mtime
            if mtime == self._mtime:
                return
            self._mtime = mtime
            self.default, self.keys = self._load()
        except (OSError, ValueError) as e:
            log.error("rate limits not reloaded, the last good ones stay: %s", e)
            return
        self._state = {k: s for k, s in self._state.items() if self._limit(k) == s.limit}  # changed ones start full
        log.info("rate limits reloaded from %s (%d keys)", self.path, len(self.keys))

    def _limit(self, key: str) -> Limit | None:
        return self.keys.get(key, self.default)

    def admit(self, key: str, prompt_tokens: int) -> Refusal | None:
        """Take one request and its prompt tokens from the key's buckets, or say when to come back."""
        now = time.monotonic()
        self._reload_if_changed(now)
        limit = self._limit(key)
        if limit is None:
            return None
        state = self._state.get(key)
        if state is None:
            state = self._state[key] = KeyState(limit)
        waits = []
        for bucket, need in ((state.requests, 1.0), (state.tokens, 1e-9)):
            if bucket is not None:
                bucket.refill(now)
                waits.append(bucket.wait(need))
        if max(waits, default=0.0) > 0:
            return Refusal("rate_limit", f"rate limit of this client key reached ({_describe(limit)}); retry later",
                           max(waits))
        if state.requests is not None:
            state.requests.level -= 1
        self.charge(key, prompt_tokens)
        return None

    def charge(self, key: str, tokens: int) -> None:
        """Tokens the key used (a prompt at admission, the generated ones at the end)."""
        state = self._state.get(key)
        if state is not None and state.tokens is not None:
            state.tokens.refill(time.monotonic())
            state.tokens.level -= tokens


def _describe(limit: Limit) -> str:
    parts = [f"{limit.requests_per_second:g} requests/s" if limit.requests_per_second else "",
             f"{limit.tokens_per_second:g} tokens/s" if limit.tokens_per_second else ""]
    return ", ".join(p for p in parts if p)


def client_key(authorization: str | None, user: str | None, server_api_key: str | None) -> str:
    """Whose share a request takes: its Bearer token, unless that is the server's one shared --api-key; then its
    `user` field; else one anonymous share."""
    token = (authorization or "").removeprefix("Bearer ").strip()
    if token and token != server_api_key:
        return token
    return f"user:{user}" if user else "anonymous"
