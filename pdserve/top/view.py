"""One frame of `pdserve top`: a router's /cluster answer as a rich table (pure: no I/O)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

COLUMNS = ("member", "role", "state", "in flight", "running", "waiting", "KV device", "KV host", "KV disk",
           "TTFT p50/p90 ms", "ITL p50/p90 ms", "req/min", "429/min", "restarts")


def frame(cluster: dict[str, Any]) -> Group:
    router = cluster["router"]
    minute = router["last_minute"]
    title = Text.assemble(
        ("pdserve ", "bold"), (router["url"], "cyan"),
        ("  serving" if router["can_serve"] else "  NO ROUTE", "green" if router["can_serve"] else "bold red"),
        f"  last minute: {minute['requests']} requests, {minute['refused']} refused, {minute['failed']} failed",
        f"  policies: prefill {router['prefill_policy']}, decode {router['decode_policy']}, pd {router['pd_policy']}")
    table = Table(*COLUMNS, expand=False, pad_edge=False)
    for member in sorted(cluster["members"], key=lambda m: (m["role"], m["url"])):
        table.add_row(*member_row(member))
    return Group(title, table)


def member_row(m: dict[str, Any]) -> list[str | Text]:
    status = m.get("status") or {}
    role = status.get("role") or m["role"]
    if "error" in status:
        state = _state(m).append(f" (no status: {status['error']})"[:40], "red")
        return [m["url"], role, state, str(m["in_flight_requests"]),
                *["-"] * 9, str(m["restarts"])]
    kv = status.get("kv", {})
    minute = status.get("last_minute", {})
    return [m["url"], role, _state(m), str(status.get("in_flight", m["in_flight_requests"])),
            str(status.get("running", "-")), str(status.get("waiting", "-")),
            _usage(kv.get("device")), _usage(kv.get("host")), _usage(kv.get("disk")),
            _pair(minute.get("ttft_ms")), _pair(minute.get("itl_ms")), str(minute.get("requests", "-")),
            str(minute.get("refused", "-")), str(m["restarts"])]


def _state(m: dict[str, Any]) -> Text:
    if m.get("draining"):
        return Text("draining", "yellow")
    return Text("healthy", "green") if m["healthy"] else Text("down", "bold red")


def _usage(tier: dict | None) -> str:
    return "-" if tier is None else f"{tier['usage'] * 100:.0f}% of {tier['blocks']}"


def _pair(p: dict | None) -> str:
    if not p or p.get("p50") is None:
        return "-"
    return f"{p['p50']:.0f}/{p['p90']:.0f}"
