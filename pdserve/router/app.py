"""The router's HTTP face: membership, health, metrics, and OpenAI requests forwarded to their route."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from pdserve.config.roles import Role
from pdserve.deploy.cluster_auth import SIGNATURE_HEADER, AuthError, SignatureCheck
from pdserve.http.auth import bearer_auth
from pdserve.http.disconnect import until_disconnect
from pdserve.http.wire import Registration
from pdserve.router.forward import Forwarder, error_response
from pdserve.router.health import HealthChecker
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import Policy, make_policy
from pdserve.router.prefill_decider import PrefillDecider
from pdserve.router.prompt import PromptReader
from pdserve.router.registry import Registry
from pdserve.router.selector import Selector
from pdserve.router.settings import RouterSettings

log = logging.getLogger("pdserve.router")


class Unregistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str


def build_router_app(settings: RouterSettings, reader: PromptReader,
                     static_instances: Iterable[Registration] = ()) -> FastAPI:
    """`static_instances` (--instances) are in the pool from the start, without heartbeats."""
    static_instances = list(static_instances)
    registry = Registry(settings.instance_expiry, settings.fail_threshold, settings.success_threshold)
    metrics = RouterMetrics(registry)
    decider = (PrefillDecider(settings.max_local_prefill_length, settings.max_prefill_queue_tokens,
                              settings.local_prefill_decode_requests)
               if settings.pd_policy == "conditional" else None)
    selector = Selector(registry, _policy(settings.prefill_policy, settings),
                        _policy(settings.decode_policy, settings), settings.mixed_fallback, decider,
                        metrics.count_decision)
    signatures = SignatureCheck((settings.cluster_secret or "").encode())
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=settings.request_timeout, sock_connect=5.0),
            auto_decompress=False)  # bytes pass through as the instance sent them
        checker = HealthChecker(registry, client, settings.health_interval, settings.health_timeout)
        state["checker"] = checker
        state["forwarder"] = Forwarder(client, registry, selector, settings.max_retries, metrics.retries.inc,
                                       settings.migration_limit, metrics.count_migration)
        for info in static_instances:
            registry.register(info, static=True)
        task = asyncio.create_task(checker.run())
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.can_serve = selector.can_serve  # serve.py: when a router sharing its port may take connections
    if settings.api_key:
        app.middleware("http")(bearer_auth(settings.api_key))

    async def signed_body(raw: Request) -> bytes | JSONResponse:
        body = await raw.body()
        try:
            signatures.verify(raw.url.path, body, raw.headers.get(SIGNATURE_HEADER))
        except AuthError as e:
            client = raw.client.host if raw.client else "?"
            log.warning("refused %s from %s: %s", raw.url.path, client, e)
            metrics.refused.labels("registration").inc()
            return error_response(f"registration refused: {e}", 403, "permission_error")
        return body

    @app.post("/register")
    async def register(raw: Request) -> Response:
        body = await signed_body(raw)
        if isinstance(body, Response):
            return body
        try:
            info = Registration.model_validate_json(body)
        except ValidationError as e:
            return error_response(f"bad registration: {e.errors()[0].get('msg')}", 400, "invalid_request_error")
        instance, probe = registry.register(info)
        if probe:
            state["checker"].probe_soon(instance)
        return JSONResponse({"status": "ok", "healthy": instance.healthy})

    @app.post("/unregister")
    async def unregister(raw: Request) -> Response:
        body = await signed_body(raw)
        if isinstance(body, Response):
            return body
        try:
            registry.unregister(Unregistration.model_validate_json(body).url)
        except ValidationError:
            return error_response("bad unregistration: a url is needed", 400, "invalid_request_error")
        return JSONResponse({"status": "ok"})

    @app.get("/registered")
    async def registered() -> dict:
        return {"instances": [i.as_dict() for i in registry.all()]}

    app.get("/instances")(registered)  # the first router's name for it

    @app.get("/registered_number")
    async def registered_number() -> dict:
        counts = {role.value: 0 for role in (Role.PREFILL, Role.DECODE, Role.MIXED)}
        healthy = dict(counts)
        for i in registry.all():
            counts[i.role] += 1
            healthy[i.role] += i.healthy
        return {**counts, "healthy": healthy}

    @app.get("/health")
    async def health() -> Response:
        if selector.can_serve():
            return Response(status_code=200)
        return error_response(selector.why_not(), 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.prometheus), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await _to_any_instance(raw, "/v1/models")

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        return await _to_any_instance(raw, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        return await _to_any_instance(raw, "/detokenize")

    async def _to_any_instance(raw: Request, path: str) -> Response:
        """A request any instance answers alike (they serve one model): the first healthy one."""
        live = registry.healthy()
        if not live:
            return error_response("no instance is registered and healthy", 503)
        body = await _read_limited(raw, settings.max_request_bytes) if raw.method == "POST" else None
        if raw.method == "POST" and body is None:
            return error_response("the request body is too large", 413, "invalid_request_error")
        forwarder: Forwarder = state["forwarder"]
        headers = {**_passed_headers(raw.headers), "content-type": "application/json"}
        try:
            async with forwarder.client.request(raw.method, f"{live[0].url}{path}", data=body, headers=headers) as r:
                return Response(await r.read(), status_code=r.status, media_type="application/json")
        except (TimeoutError, aiohttp.ClientError) as e:
            return error_response(f"instance {live[0].url} did not answer: {e}", 502)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await _forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await _forward(raw, "/v1/chat/completions")

    @app.post("/v1/responses")
    async def responses(raw: Request) -> Response:
        return await _forward(raw, "/v1/responses")

    async def _forward(raw: Request, path: str) -> Response:
        response = await _forward_checked(raw, path)
        metrics.requests.labels(str(response.status_code)).inc()
        return response

    async def _forward_checked(raw: Request, path: str) -> Response:
        body = await _read_limited(raw, settings.max_request_bytes)
        if body is None:
            metrics.refused.labels("too_large").inc()
            return error_response(f"the request body is larger than {settings.max_request_bytes} bytes "
                                  "(--max-request-bytes)", 413, "invalid_request_error")
        try:
            parsed = json.loads(body)
            if not isinstance(parsed, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return error_response(f"the request body is not valid JSON: {e}", 400, "invalid_request_error")
        request = reader.read(path, parsed)
        work = state["forwarder"].forward(path, parsed, request, _passed_headers(raw.headers))
        # A streamed answer stops when the client does (its generator is closed); a whole one would not.
        return await (work if parsed.get("stream") else until_disconnect(raw, work))

    return app


def _policy(name: str, settings: RouterSettings) -> Policy:
    return make_policy(name, balance_abs=settings.cache_balance_abs, balance_rel=settings.cache_balance_rel,
                       min_match=settings.cache_min_match)


def _passed_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """What the router passes to instances: the client's credentials (instances may check the same key)."""
    auth = headers.get("authorization")
    return {"authorization": auth} if auth else {}


async def _read_limited(raw: Request, limit: int) -> bytes | None:
    """The body, or None if it is over `limit` bytes (checked before reading when the length is declared)."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    body = bytearray()
    async for chunk in raw.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
