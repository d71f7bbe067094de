"""A request inside the engine: its tokens, its KV block table and its timeline."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ac_observe.metrics import DEFAULT_LANE, NO_SKELETON


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"                    # an end-of-sequence token
    LENGTH = "length"                # max_tokens or the model's context
    STOP_SEQUENCE = "stop_sequence"  # a user stop string
    ABORTED = "aborted"
    ERROR = "error"


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False          # EOS does not end the request (stop_token_ids still do)
    min_tokens: int = 0               # EOS and stop_token_ids are not sampled before this many
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.seed is not None and not -(2 ** 63) <= self.seed < 2 ** 64:
            raise ValueError("seed must fit in 64 bits")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")


@dataclass(slots=True)
class Timeline:
    """Host monotonic instants (ns) of one request, plus its device-timed work.

    NOTE: arrival is when the server received the request (before parsing, validation and
    tokenization), so time to first token = front-end + queue + prefill phase, and the
    end-to-end time = that + decode phase: the parts add up exactly."""
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    queued_ns: int = 0             # entered the engine's waiting queue
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    first_text_ns: int = 0         # first non-empty text delivered
    last_token_ns: int = 0
    finished_ns: int = 0
    prefill_seconds: float = 0.0   # device time of the prefill step(s) that included it
    decode_seconds: float = 0.0    # device time of the decode steps that included it

    @property
    def frontend_ns(self) -> int:
        return self.queued_ns - self.arrival_ns if self.queued_ns else 0

    @property
    def queue_ns(self) -> int:
        return self.first_scheduled_ns - self.queued_ns if self.first_scheduled_ns else 0

    @property
    def first_text_latency_ns(self) -> int:
        return self.first_text_ns - self.arrival_ns if self.first_text_ns else 0

    @property
    def ttft_ns(self) -> int:
        return self.first_token_ns - self.arrival_ns if self.first_token_ns else 0

    @property
    def prefill_phase_ns(self) -> int:
        """First scheduled to first token: the steps that computed the prompt, and the
        host time and other lanes' steps between them (vLLM's prefill time)."""
        return self.first_token_ns - self.first_scheduled_ns if self.first_token_ns else 0

    @property
    def decode_phase_ns(self) -> int:
        """First token to finish (vLLM's decode time)."""
        return self.finished_ns - self.first_token_ns if self.finished_ns and \
            self.first_token_ns else 0

    @property
    def e2e_ns(self) -> int:
        return self.finished_ns - self.arrival_ns if self.finished_ns else 0


class Sequence:
    """NOTE: KV exists for token_ids[:num_computed_tokens]; the last token is always the
    input of the next step, so num_computed_tokens < len(token_ids) while running."""

    __slots__ = ("request_id", "lane", "token_ids", "num_prompt_tokens", "params", "status",
                 "block_table", "num_computed_tokens", "num_cached_tokens", "num_preemptions",
                 "finish_reason", "timeline", "generator", "skeleton", "kv_hit_blocks",
                 "kv_query_blocks", "kv_miss_blocks", "num_hashed_blocks", "block_hashes",
                 "skeleton_label")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 lane: str = DEFAULT_LANE, arrival_ns: int | None = None):
        if not prompt_token_ids:
            raise ValueError("prompt must hold at least one token")
        self.request_id = request_id
        self.lane = lane
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0      # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.timeline = Timeline() if arrival_ns is None else Timeline(arrival_ns)
        self.generator = None           # torch.Generator for seeded sampling
        self.skeleton = None            # engine.skeleton.Skeleton of the request, if known
        self.kv_hit_blocks = 0
        self.kv_query_blocks = 0
        self.kv_miss_blocks: tuple[int, ...] = ()  # misses by reason (metrics.MISS_REASONS)
        self.num_hashed_blocks = 0      # leading blocks of block_table whose hash is known
        self.block_hashes: list[bytes] = []  # chain hashes of the looked-up prompt blocks
        self.skeleton_label = NO_SKELETON  # the bounded `skeleton` label of its KV lookups

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def num_blocks_needed(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size
