"""The connectors of an instance's PD roles, behind the one KVConnector face the engine loop sees.

A prefill or decode instance holds its role's connector; a mixed one none; an instance that may change role
(--enable-role-switch) holds both from the start. Every held connector is polled whatever the role, and a PD request
of either side it holds is taken: so a role change cuts nothing short (a transfer in flight ends on the connector
that began it, a stream decodes to its end) and a router that chose this instance for its old role a moment before
the change is served. The role says what the instance advertises (`sides`: prefill takes the prefill side, decode
the decode side, a switchable mixed instance the decode side as well as whole requests).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from pdserve.config.roles import Role
from pdserve.engine.stats import PDStats

if TYPE_CHECKING:
    import zmq

    from pdserve.engine.kv_connector import KVConnector
    from pdserve.engine.messages import PDParams, RequestOutput
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler_output import ScheduledChunk
    from pdserve.kv.transfer_plan import TransferPlan
    from pdserve.worker.protocol import TokenLogprobs

SIDE_OF_ROLE = {Role.PREFILL: Role.PREFILL, Role.DECODE: Role.DECODE, Role.MIXED: Role.DECODE}


class RoleConnectors:
    def __init__(self, role: Role, connectors: dict[Role, KVConnector]) -> None:
        self.connectors = connectors
        self.role = role

    @property
    def port(self) -> int | None:
        prefill = self.connectors.get(Role.PREFILL)
        return prefill.port if prefill is not None else None

    @property
    def sides(self) -> list[str]:
        """The PD sides the current role takes (the registration tells routers)."""
        side = SIDE_OF_ROLE[self.role]
        return [str(side)] if side in self.connectors else []

    def can_take(self, role: Role) -> str | None:
        """Why this instance cannot change to `role` (None: it can)."""
        if role != Role.MIXED and role not in self.connectors:
            return f"this instance has no {role} parts: start it with --enable-role-switch"
        if role != self.role and len(self.connectors) < 2:
            return "this instance cannot change role: start it with --enable-role-switch"
        return None

    @property
    def sockets(self) -> list[zmq.Socket]:
        return [s for c in self.connectors.values() for s in c.sockets]

    @property
    def held(self) -> int:
        return sum(c.held for c in self.connectors.values())

    def add_request(self, request: Request, pd: PDParams) -> list[RequestOutput]:
        if Role(pd.role) not in self.connectors:
            raise ValueError(f"PD error: this is a {self.role} instance; it cannot take the {pd.role} side of a "
                             "PD request")
        return self.connectors[Role(pd.role)].add_request(request, pd)

    def transfers(self, chunks: list[ScheduledChunk]) -> list[TransferPlan]:
        return [t for c in self.connectors.values() for t in c.transfers(chunks)]

    def on_prefilled(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> None:
        for c in self.connectors.values():
            c.on_prefilled(request, token, logprobs)

    def poll(self) -> list[RequestOutput]:
        return [o for c in self.connectors.values() for o in c.poll()]

    def abort(self, request_id: str) -> Request | None:
        for c in self.connectors.values():
            if (request := c.abort(request_id)) is not None:
                return request
        return None

    def next_deadline(self) -> float | None:
        return min((d for c in self.connectors.values() if (d := c.next_deadline()) is not None), default=None)

    def during_step(self) -> None:
        for c in self.connectors.values():
            c.during_step()

    def stats(self) -> PDStats | None:
        parts = [s for c in self.connectors.values() if (s := c.stats()) is not None]
        return functools.reduce(PDStats.merged, parts) if parts else None

    def close(self) -> None:
        for c in self.connectors.values():
            c.close()
