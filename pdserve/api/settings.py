"""`pdserve serve`'s server settings: each field is a flag (pdserve/config/flags.py) in --help's "server"
group. The engine's flags are its config's (config/engine.py); FastDeploy's accepted flags are their own
table (config/fastdeploy_flags.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.admission.settings import RATE_LIMIT_HELP, TPOT_HELP, TTFT_HELP
from pdserve.config.flags import option
from pdserve.http.members import router_urls
from pdserve.tool_calling.parsers import PARSERS
from pdserve.tracing.setup import ENDPOINT_HELP, detailed_trace_modules
from pdserve.utils.cluster_auth import ENV

API_KEY_ENV = "PDSERVE_API_KEY"


SERVER = "server"  # the --help group


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    host: str = option("127.0.0.1", "address to listen on (0.0.0.0 for all interfaces)", group=SERVER)
    port: int = option(8000, group=SERVER)
    metrics_port: int | None = option(None, "Prometheus port (default: a free port, logged)", group=SERVER)
    served_model_name: str | None = option(None, "the model name clients send (default: from the path)", group=SERVER)
    max_concurrency: int = option(256, "requests in flight before answering 429", group=SERVER)
    ttft_slo_ms: float | None = option(None, TTFT_HELP, group=SERVER)
    tpot_slo_ms: float | None = option(None, TPOT_HELP, group=SERVER)
    rate_limit: str | None = option(None, RATE_LIMIT_HELP, group=SERVER)
    data_parallel_size: int = option(
        1, "engine replicas behind this server, each with its own scheduler, KV cache and workers (and its share of "
           "the cores); requests are balanced by load and prompt prefix; in PD roles each registers as its own "
           "endpoint (/dp/R), with the R-th port of --pd-comm-port", group=SERVER, aliases=("-dp",))
    router: list[str] | None = option(
        None, "router URL to register with, e.g. http://127.0.0.1:8000 (host:port means http://host:port); a "
              "comma-separated list registers with each (several routers of one deployment)",
        type=router_urls, group=SERVER)
    advertise_host: str | None = option(
        None, "the address the router and peers should use for this instance (default: --host, or this "
              "machine's address when --host is 0.0.0.0)", group=SERVER)
    host_id: str | None = option(
        None, "which host this is, for choosing ipc between P and D (default: hostname and boot id); give "
              "instances on one machine different ids to make them act as separate hosts", group=SERVER)
    cluster_secret: str | None = option(
        None, f"shared by the router and every instance: signs registration, control messages and KV connections "
              f"(default: ${ENV}; prefer the variable, a command line is visible to all)", env=ENV, group=SERVER)
    generation_config: str = option(
        "auto", "default sampling for fields a request leaves out: auto (the model folder's generation_config.json, "
                "as vLLM), none (OpenAI's defaults), or a folder holding one", group=SERVER)
    api_key: str | None = option(
        None, f"clients must send 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV})", env=API_KEY_ENV,
        group=SERVER)
    tool_call_parser: str = option("hermes", "how tool calls are read from the model's text (vLLM's names)",
                                    choices=sorted(PARSERS), group=SERVER)
    enable_auto_tool_choice: bool = option(
        False, "accepted for vLLM's command lines: tool_choice auto is always served", switch=True, group=SERVER)
    otlp_traces_endpoint: str | None = option(None, ENDPOINT_HELP, group=SERVER)
    collect_detailed_traces: str | None = option(
        None, "with --otlp-traces-endpoint: a span per engine step that computed the request (vLLM's values are "
              "taken: model, worker, all, comma-separated; a pdserve step is all of them)", nargs="?", const="all",
        type=detailed_trace_modules, group=SERVER)
