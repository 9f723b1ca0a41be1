"""A request as the engine sees it: tokens, progress, blocks, and its place in the lifecycle."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.block_pool import Block
from pdserve.engine.messages import RequestTimes
from pdserve.engine.prefix_pull import PullHint
from pdserve.kv.block_hash import BlockHash
from pdserve.sampling import SamplingParams
from pdserve.worker.protocol import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV will be recomputed
    PREALLOCATED = "preallocated"  # decode role: blocks held, prompt KV arriving from a prefill instance
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "prefilled"
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in this request's blocks
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    blocks: list[Block] = field(default_factory=list)
    group_blocks: list[list[Block | None]] = field(default_factory=list)  # layer groups 1.. (engine/group_tables.py)
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, kept across preemption
    num_committed_blocks: int = 0  # leading blocks already offered to the prefix cache
    times: RequestTimes = field(default_factory=RequestTimes)
    # Prefill side of a PD pair: finish after the first token and keep the blocks until the KV is sent.
    kv_producer: bool = False
    # params.prompt_logprobs: gathered chunk by chunk, sent once with the first output token
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    num_resumed: int = 0  # a migrated answer: the prompt's last tokens are output streamed elsewhere
    priority: int = 0  # --scheduling-policy priority: lower is served first
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify in the next step
    lora_name: str | None = None  # the LoRA adapter it computes with; its KV blocks hash apart (lora_hash_root)
    kv_pull: PullHint | None = None  # a router's word: a peer holds a longer prefix (--enable-kv-pull)
    disk_read: bool = False  # its prefix was read from the disk tier (once: a second read would evict the first's)
    prefix_tiers: dict[BlockHash, str] = field(default_factory=dict)  # prefix blocks copied in from below the device

    def add_prompt_logprobs(self, first_position: int, entries: list[TokenLogprobs]) -> None:
        """Entries for prompt tokens first_position ..; a recompute after preemption repeats known ones."""
        have = len(self.prompt_logprobs) + 1  # the first prompt token has no logprob
        if first_position <= have < first_position + len(entries):
            self.prompt_logprobs.extend(entries[have - first_position:])

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)  # prompt + output, appended in place

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def mark_finished(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.times.finished = time.time()

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
