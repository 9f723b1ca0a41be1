"""When a sequence is finished: EOS, stop token ids, max_tokens, the model's context (torch-free: the
scheduler runs it in the engine process)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.sampling.sampling_params import SamplingParams


def check_stop(
    params: SamplingParams,
    output_token_ids: Sequence[int],
    eos_token_ids: Sequence[int],
    max_model_len_left: int | None = None,
    num_earlier: int = 0,
) -> str | None:
    """Finish reason after the last appended token: "stop", "length" or None.

    max_model_len_left is how many more tokens fit in the model's context after the
    current output (max_model_len - prompt_len - len(output)); <= 0 ends with "length".
    num_earlier counts output tokens generated before these (a migrated answer's, on another instance).
    """
    num_out = len(output_token_ids) + num_earlier
    if output_token_ids and num_out >= params.min_tokens:
        last = output_token_ids[-1]
        if not params.ignore_eos and last in eos_token_ids:
            return "stop"
        if params.stop_token_ids and last in params.stop_token_ids:
            return "stop"
    if params.max_tokens is not None and num_out >= params.max_tokens:
        return "length"
    if max_model_len_left is not None and max_model_len_left <= 0:
        return "length"
    return None
