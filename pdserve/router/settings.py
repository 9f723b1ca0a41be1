"""The router's settings: each field is a `pdserve router` flag (pdserve/config/flags.py), and `pdserve
launch` gives its routers theirs from the same fields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.admission.settings import RATE_LIMIT_HELP, TPOT_HELP, TTFT_HELP
from pdserve.balancing.policies import POLICIES
from pdserve.config.flags import option
from pdserve.router.prefill_decider import PD_POLICIES
from pdserve.tracing.setup import ENDPOINT_HELP
from pdserve.utils.cluster_auth import ENV

API_KEY_ENV = "PDSERVE_API_KEY"


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    host: str = option("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)")
    port: int = option(8000)
    reuse_port: bool = option(
        False, "share --port with other routers of the deployment (SO_REUSEPORT): the kernel spreads connections "
               "among them, so one router's death refuses no connection", switch=True)
    own_port: int | None = option(
        None, "a second port only this router listens on, for registrations and /metrics when several routers "
              "share --port (instances list every router's own port in their --router)")
    prefill_policy: str = option("least_tokens", "picks who computes the prompt: a prefill or a mixed instance",
                                 choices=POLICIES)
    decode_policy: str = option("least_requests", "with mixed instances alone, also picks among them",
                                choices=POLICIES)
    pd_policy: str = option(
        "always", "always: every prompt is computed on a prefill instance; conditional: on the decode instance "
                  "when what it lacks of the prompt is at most --max-local-prefill-length tokens, or when the "
                  "prefill instance is backed up (Dynamo's disaggregated router)", choices=PD_POLICIES)
    max_local_prefill_length: int = option(256, "conditional: uncached prompt tokens a decode instance computes itself")
    max_prefill_queue_tokens: int = option(
        4096, "conditional: the prefill instance's in-flight prompt tokens from which prompts are computed on the "
              "decode instance instead")
    local_prefill_decode_requests: int = option(
        -1, "conditional: a decode instance with at most this many requests in flight computes any prompt itself "
            "(-1: never for this reason; pdserve launch, whose decode instance borrows the prefill instance's cores "
            "while it is idle, sets it)")
    max_retries: int = option(2, "tries on other instances when one fails before the client has seen a byte")
    migration_limit: int = option(
        3, "times a stream whose instance fails mid-answer is resumed on another route where the client is "
           "(Dynamo's name; 0: the stream ends with an error event)")
    instances: Path | None = option(
        None, "YAML file with a static list of instances (each: role, url, and for PD the fields instances "
              "register: pd_comm, transports, host_id, compatibility_key, block_size, kv_events)")
    instance_expiry: float = option(10.0, "seconds without a heartbeat before a registered instance is forgotten")
    health_interval: float = option(2.0, "seconds between /health probes")
    health_timeout: float = option(2.0)
    fail_threshold: int = option(3, "failed probes in a row that take an instance out of the pool",
                                 flag="--health-failure-threshold")
    success_threshold: int = option(2, "good probes in a row that bring it back", flag="--health-success-threshold")
    kv_overlap_score_weight: float = option(
        1.0, "cache_aware: weight of the prompt blocks an instance would compute and has queued for prefill (Dynamo's "
             "name)")
    kv_decode_load_weight: float = option(
        0.1, "cache_aware: weight of the prompt blocks of the requests decoding on an instance (Dynamo: 1.0; on a CPU "
             "box decoding streams delay a prompt far less than queued prefills)")
    tokenizer: str | None = option(
        None, "model path whose tokenizer reads prompts (default: the embedded model); 'none' estimates token "
              "counts from text and disables cache_aware")
    api_key: str | None = option(None, f"clients must send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})",
                                 env=API_KEY_ENV)
    cluster_secret: str | None = option(None, f"instances must sign registrations with it (default: ${ENV})", env=ENV)
    max_request_bytes: int = option(16 << 20, "larger request bodies get 413")
    ttft_slo_ms: float | None = option(None, TTFT_HELP)
    tpot_slo_ms: float | None = option(None, TPOT_HELP)
    rate_limit: str | None = option(None, RATE_LIMIT_HELP)
    load_interval: float = option(0.1, "seconds between polls of each instance's /load (admission by SLO)")
    admitting_routers: int = option(
        1, "routers admitting to the same instances, behind one port or load balancer (pdserve launch sets it): "
           "until an instance takes them, each counts what it sent that many times, as connections are spread "
           "evenly (two routers each admitted a whole burst's worth within one poll)")
    request_timeout: float = option(600.0, "seconds an instance may take to answer")
    otlp_traces_endpoint: str | None = option(None, ENDPOINT_HELP)
