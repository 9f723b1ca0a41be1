"""Before the engine says it is ready: time the calibration steps (admission/calibration.py) on the worker and
seed the load tracker with them, so admission judges the first request on measurements."""

from __future__ import annotations

import logging
import time

from pdserve.admission.calibration import CONTEXT, REPEATS, calibration_plan
from pdserve.admission.load import LoadTracker
from pdserve.config.engine import EngineConfig
from pdserve.engine.worker_client import WorkerClient, WorkerDied, WorkerFailed
from pdserve.utils.host_lock import host_lock
from pdserve.worker.protocol import CalibrateCommand

log = logging.getLogger("pdserve.engine")

LOCK_TIMEOUT = 60.0  # seconds to wait for other instances' calibrations before timing beside them


def calibrate_load(tracker: LoadTracker, worker: WorkerClient, config: EngineConfig, num_blocks: int,
                   max_model_len: int) -> None:
    """A calibration that fails leaves the tracker empty (admission then waits for real steps), said in the log."""
    plan = calibration_plan(config.max_num_seqs, config.max_num_batched_tokens, num_blocks, config.block_size,
                            max_model_len)
    if not plan:
        log.warning("load calibration skipped: the KV cache (%d blocks) holds none of its steps", num_blocks)
        return
    start = time.perf_counter()
    command = CalibrateCommand([(s.decodes, s.prompt_tokens) for s in plan], min(CONTEXT, max_model_len - 1),
                               REPEATS)
    try:
        # Instances starting side by side on one host (a launch) calibrate in turn: timed beside another's
        # calibration, a step took twice its time and admission refused what the instance could serve.
        with host_lock("calibration", LOCK_TIMEOUT) as waited:
            timed = worker.calibrate(command, config.startup_timeout)
    except (WorkerFailed, WorkerDied) as e:
        log.warning("load calibration failed, admission waits for real steps: %s", e)
        return
    steps = [(s.decodes, s.prompt_tokens, t) for s, t in zip(plan, timed.seconds, strict=True)]
    if refusal := tracker.calibrate(steps):
        log.warning("load calibration refused, admission waits for real steps: %s (steps: %s)", refusal, steps)
        return
    base, per_stream, per_token = tracker.step_costs()
    log.info("load calibration: %d steps in %.1f s (%.1f s waiting for other instances' calibrations): step %.1f "
             "ms + %.2f ms per stream + %.3f ms per prompt token, prefill %.0f tokens/s", len(plan),
             time.perf_counter() - start, waited, base * 1e3, per_stream * 1e3, per_token * 1e3, tracker.prefill_rate)
