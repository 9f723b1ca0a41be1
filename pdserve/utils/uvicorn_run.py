"""Run a uvicorn server and say (once) when it listens; fail clearly when it cannot."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import uvicorn

# On SIGTERM uvicorn waits for open requests to end; without a bound, a connection that never ends
# holds a stopping instance forever (all of its processes asleep, the supervisor waiting).
# Past this, what still runs is cancelled and the stop goes on.
GRACEFUL_SHUTDOWN_S = 5


def server_config(app: object, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning",
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A bound socket for uvicorn; with `reuse_port`, several processes listen on the port at once
    (SO_REUSEPORT: the kernel spreads new connections among them, and one that dies refuses none)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"could not listen on {host}:{port} (is the port in use?): {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


async def serve_and_announce(server: uvicorn.Server, announcement: str,
                             sockets: list[socket.socket] | None = None) -> None:
    async def announce() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.05)
        if server.started:
            print(announcement, flush=True)

    task = asyncio.create_task(announce())
    await server.serve(sockets=sockets)
    task.cancel()
    if not server.started:
        cfg = server.config
        raise OSError(f"could not listen on {cfg.host}:{cfg.port} (is the port in use?)")


class LateListeningServer(uvicorn.Server):
    """A uvicorn server that can start listening on one more socket once it runs: a router that shares
    its port with others takes connections there only when it can route them (`ready`), not while its
    instances are still registering with it after a restart."""

    async def listen_when(self, sock: socket.socket, ready: Callable[[], bool], timeout: float) -> None:
        while not self.started and not self.should_exit:
            await asyncio.sleep(0.05)
        deadline = asyncio.get_running_loop().time() + timeout
        while not ready() and asyncio.get_running_loop().time() < deadline and not self.should_exit:
            await asyncio.sleep(0.1)
        if self.should_exit:
            return
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            # what uvicorn.Server.startup builds for each of its own sockets
            return config.http_protocol_class(config=config, server_state=self.server_state,
                                              app_state=self.lifespan.state, _loop=_loop)

        loop = asyncio.get_running_loop()
        self.servers.append(await loop.create_server(create_protocol, sock=sock, backlog=config.backlog))
