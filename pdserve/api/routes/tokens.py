"""/tokenize and /detokenize (vLLM's): the model's tokenizer and chat template, without the engine."""

from __future__ import annotations

from fastapi import APIRouter

from pdserve.api.handling import check_model, template_ids
from pdserve.api.protocol import DetokenizeRequest, TokenizeRequest
from pdserve.api.state import APIError, ServerDep

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: ServerDep) -> dict:
    check_model(state, body.model)
    if body.messages is not None:
        ids = template_ids(state, body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs,
                           body.continue_final_message)
    elif body.prompt is not None:
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise APIError("either prompt or messages is required", param="prompt")
    out: dict = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = [state.tokenizer.token_text(t) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: ServerDep) -> dict:
    check_model(state, body.model)
    if any(not 0 <= t < state.tokenizer.vocab_size for t in body.tokens):
        raise APIError(f"token ids must be in [0, {state.tokenizer.vocab_size})", param="tokens")
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}
