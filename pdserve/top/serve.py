"""`pdserve top --url ROUTER`: the deployment's members, refreshed every --interval seconds until Ctrl-C;
`--once` prints one frame (for scripts and logs)."""

from __future__ import annotations

import argparse
import time

import httpx
from rich.console import Console
from rich.live import Live
from rich.text import Text

from pdserve.top.view import frame


def add_top_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a router of the deployment")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--width", type=int, default=None, help="columns (default: the terminal's)")


def fetch(url: str) -> dict:
    r = httpx.get(f"{url.rstrip('/')}/cluster", timeout=5)
    r.raise_for_status()
    return r.json()


def top_main(args: argparse.Namespace) -> int:
    console = Console(width=args.width)
    if args.once:
        try:
            console.print(frame(fetch(args.url)))
        except httpx.HTTPError as e:
            raise OSError(f"the router at {args.url} did not answer /cluster: {e}") from None
        return 0
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            try:
                live.update(frame(fetch(args.url)), refresh=True)
            except httpx.HTTPError as e:
                live.update(Text(f"the router at {args.url} did not answer /cluster: {e}", "bold red"), refresh=True)
            time.sleep(args.interval)
