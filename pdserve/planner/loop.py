"""The planner's loop: every interval read the deployment, predict the next interval's load, size each side,
decide the roles of the instances that may change role, and change them one at a time (each drains first).
Every decision goes to the log and /metrics; `--planner-dry-run` changes nothing."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from pdserve.http.members import post_signed
from pdserve.planner.correction import Correction
from pdserve.planner.deployment import Deployment, DeploymentView
from pdserve.planner.metrics import PlannerMetrics
from pdserve.planner.observe import Snapshot, interval
from pdserve.planner.predictor import LoadPredictor
from pdserve.planner.profile import fetch_profile
from pdserve.planner.roles import RoleCounts, RolePlanner, changes
from pdserve.planner.settings import PlannerSettings
from pdserve.planner.sizing import DeploymentProfile, needs

log = logging.getLogger("pdserve.planner")


class Planner:
    def __init__(self, settings: PlannerSettings, client: httpx.AsyncClient, metrics: PlannerMetrics,
                 profile: DeploymentProfile | None = None) -> None:
        self.settings, self.client, self.metrics = settings, client, metrics
        self.profile = profile
        self.deployment = Deployment(client, settings.router or [])
        self.predictor = LoadPredictor(settings.planner_predictor)
        self.roles = RolePlanner(settings.planner_settle, settings.planner_headroom)
        self.correction = Correction()
        self._last: tuple[Snapshot, float] | None = None

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except httpx.HTTPError as e:
                log.warning("planner interval skipped: %s", e)
            await asyncio.sleep(max(0.0, self.settings.planner_interval - (time.monotonic() - started)))

    async def tick(self) -> None:
        view = await self.deployment.read()
        if not view.members:
            log.warning("planner: no instance registered (or no router answered): interval skipped")
            return
        now = time.monotonic()
        snapshot = Snapshot.of(view.router_metrics, view.instance_metrics)
        last, self._last = self._last, (snapshot, now)
        if last is None:
            return  # an interval needs two looks
        seen = interval(last[0], snapshot, now - last[1])
        self.predictor.observe(seen)
        pool = await self._pool(view)
        if len(pool) < 2 or not await self._have_profile(pool):
            return
        current = RoleCounts.of(list(pool.values()))
        self.correction.observe(seen, self.profile, current.prefill + current.mixed, current.decode + current.mixed)
        s = self.settings
        load = self.predictor.predict()
        need = needs(load, self.correction.applied(self.profile), s.planner_ttft_slo_ms / 1e3,
                     s.planner_tpot_slo_ms / 1e3, s.planner_interval)
        decision = self.roles.step(current, need)
        self.metrics.looked(load, need, current, decision.target, self.correction)
        log.info("planner: %.2f req/s, prompt %.0f, answer %.0f tokens (profile x%.2f prefill, x%.2f ITL) -> needs "
                 "%.2f prefill, %.2f decode%s; %s: %s", load.rate, load.prompt_len, load.output_len,
                 self.correction.prefill, self.correction.decode, need.prefill, need.decode,
                 f" ({need.reason})" if need.reason else "", "move" if decision.move else "stay", decision.reason)
        if decision.move:
            busy = {m.url: m.in_flight for m in view.members}
            for url, role in changes(pool, decision.target, busy):
                await self._change(url, pool[url], role)

    async def _pool(self, view: DeploymentView) -> dict[str, str]:
        """url -> role of the instances in the pool that may change role."""
        return {m.url: m.role for m in view.members if m.in_pool and await self.deployment.switchable(m)}

    async def _have_profile(self, pool: dict[str, str]) -> bool:
        if self.profile is not None:
            return True
        for url in pool:
            if (profile := await fetch_profile(self.client, url)) is not None:
                self.profile = profile
                log.info("planner: profile from %s's load calibration: %s", url, profile)
                return True
        log.warning("planner: no profile (--planner-profile) and no instance was calibrated (--calibrate-load): "
                    "not sizing yet")
        return False

    async def _change(self, url: str, before: str, role: str) -> None:
        if self.settings.planner_dry_run:
            log.info("planner (dry run): would change %s from %s to %s", url, before, role)
            self.metrics.acted(role, "dry_run", 0.0)
            return
        started = time.monotonic()
        body = {"role": role, "drain_timeout": self.settings.planner_drain_timeout}
        try:
            r = await post_signed(self.client, url, "/role", body, timeout=self.settings.planner_drain_timeout + 30)
            outcome = "ok" if r.status_code == 200 else "refused"
            detail = r.text[:300]
        except httpx.HTTPError as e:
            outcome, detail = "failed", str(e)
        seconds = time.monotonic() - started
        self.metrics.acted(role, outcome, seconds)
        if outcome == "ok":
            log.info("planner: %s changed from %s to %s in %.2f s", url, before, role, seconds)
        else:
            log.warning("planner: %s could not change from %s to %s (%s): %s", url, before, role, outcome, detail)
