"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and
/v1/unload_lora_adapter {"lora_name"}; on with --enable-lora-runtime-loading (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). The engine reads and checks the adapter before it is listed."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from pdserve.api.async_engine import EngineError
from pdserve.api.lora import LoRAServing
from pdserve.api.state import APIError, ServerDep, ServerState
from pdserve.config.lora import RUNTIME_LOADING_ENV, LoRAModule
from pdserve.engine import messages

router = APIRouter()


class LoadLoRA(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRA(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's body may carry it; adapters are known by name here


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRA, state: ServerDep) -> PlainTextResponse:
    lora = _runtime(state)
    if body.lora_name in lora.adapters or body.lora_name == state.model_name:
        raise APIError(f"the LoRA adapter '{body.lora_name}' has already been loaded", param="lora_name")
    try:
        await state.engine.call(messages.LoadLoRA(body.lora_name, body.lora_path), timeout=120)
    except EngineError as e:
        raise APIError(str(e), param="lora_path") from None
    lora.adapters[body.lora_name] = LoRAModule(body.lora_name, body.lora_path)
    state.announce_loras()
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRA, state: ServerDep) -> PlainTextResponse:
    lora = _runtime(state)
    if body.lora_name not in lora.adapters:
        raise APIError(f"the LoRA adapter '{body.lora_name}' cannot be found", 404, "model_not_found",
                       param="lora_name")
    try:
        await state.engine.call(messages.UnloadLoRA(body.lora_name))
    except EngineError as e:
        raise APIError(str(e), 409, "conflict", param="lora_name") from None
    del lora.adapters[body.lora_name]
    state.announce_loras()
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _runtime(state: ServerState) -> LoRAServing:
    if state.lora is None or not state.lora.runtime_loading:
        raise APIError("loading LoRA adapters at run time is off: start the server with --enable-lora "
                       f"--enable-lora-runtime-loading (or {RUNTIME_LOADING_ENV}=True)", 404, "not_found")
    return state.lora
