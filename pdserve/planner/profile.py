"""A deployment's profile from an instance's own load calibration (`--calibrate-load`: before it was ready, the
engine timed decode steps of several batch sizes and prompt steps on its own weights; `/load` reports the fit).
`pdserve planner profile` saves it; the planner reads it at start when no file is given."""

from __future__ import annotations

import httpx
import msgspec

from pdserve.admission.load import LoadReport
from pdserve.planner.sizing import DeploymentProfile


def profile_of(report: LoadReport) -> DeploymentProfile | None:
    """None when the instance was not calibrated."""
    if report.quiet_prefill_rate <= 0 or report.quiet_step_base <= 0:
        return None
    return DeploymentProfile(report.quiet_prefill_rate, report.quiet_step_base, report.quiet_decode_cost,
                             report.max_num_seqs)


async def fetch_profile(client: httpx.AsyncClient, instance_url: str) -> DeploymentProfile | None:
    r = await client.get(f"{instance_url.rstrip('/')}/load")
    r.raise_for_status()
    report = msgspec.json.decode(r.content, type=LoadReport | None)
    return profile_of(report) if report is not None else None
