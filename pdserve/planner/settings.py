"""`pdserve planner`'s settings: each field is a flag (pdserve/config/flags.py); `pdserve launch --planner` gives
its planner theirs from the same fields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.config.flags import option
from pdserve.http.members import router_urls
from pdserve.utils.cluster_auth import ENV

PLANNER = "planner"  # the --help group


@dataclass(frozen=True, kw_only=True)
class PlannerSettings:
    router: list[str] | None = option(
        None, "the deployment's router(s), comma-separated: who is registered, and their refusals",
        type=router_urls, group=PLANNER)
    planner_interval: float = option(30.0, "seconds between the planner's looks at the load", group=PLANNER)
    planner_ttft_slo_ms: float = option(2000.0, "the time to first token the planner sizes the prefill side for",
                                        group=PLANNER)
    planner_tpot_slo_ms: float = option(100.0, "the time per output token the planner sizes the decode side for",
                                        group=PLANNER)
    planner_profile: Path | None = option(
        None, "the deployment's profile (`pdserve planner profile` writes it; default: read from the instances' "
              "load calibration, --calibrate-load, at start)", group=PLANNER)
    planner_predictor: str = option("holt", "how the next interval's load is predicted",
                                    choices=("holt", "moving_average"), group=PLANNER)
    planner_headroom: float = option(
        0.2, "a role change that moves capacity off a side needs the rest to carry the load plus this share",
        group=PLANNER)
    planner_settle: int = option(
        2, "intervals in a row that must want the same roles before a change the SLOs do not force", group=PLANNER)
    planner_drain_timeout: float = option(
        0.0, "seconds an instance may take to finish its requests before it changes role, else the change is given "
             "up (0: it changes at once; what is in flight goes on under the new role)", group=PLANNER)
    planner_dry_run: bool = option(False, "log and export the decisions, change nothing", switch=True,
                                   group=PLANNER)
    planner_metrics_port: int | None = option(None, "port of the planner's /metrics (default: a free one)",
                                              group=PLANNER)
    cluster_secret: str | None = option(None, f"signs role changes, as the instances' (default: ${ENV})", env=ENV,
                                        group=PLANNER)

    def check(self) -> None:
        if not self.router:
            raise ValueError("pdserve planner needs --router URL (the deployment's router)")
        if self.planner_interval <= 0 or self.planner_settle < 1 or self.planner_headroom < 0:
            raise ValueError("--planner-interval must be positive, --planner-settle at least 1, --planner-headroom "
                             "at least 0")
        if self.planner_ttft_slo_ms <= 0 or self.planner_tpot_slo_ms <= 0:
            raise ValueError("the planner's SLOs must be positive")
        if self.planner_profile is not None and not self.planner_profile.is_file():
            raise ValueError(f"--planner-profile {self.planner_profile}: no such file")
