"""Which family of a vLLM or SGLang `/metrics` becomes which family of the contract: data,
one row per source family, every version in use (vLLM V0, V1; SGLang).

Names are as prometheus_client's parser gives them (a counter without `_total`). Where
several rows feed one contract family (a name an engine renamed), the first one the
endpoint has wins, so a V1 server that still exports the deprecated name counts once.
Sources: vllm/engine/metrics.py (V0), vllm/v1/metrics/loggers.py (V1),
python/sglang/srt/metrics/collector.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from ac_observe import metrics as m
from ac_observe.friendly import FRIENDLY, Friendly


@dataclass(frozen=True, slots=True)
class Row:
    source: str           # the engine's family name
    type: str             # the type it must have there
    target: m.MetricSpec  # the contract family it feeds (histograms keep their own edges)
    # A gauge whose negative values mean "not measured" (V0's hit rate is -1 without
    # prefix caching): those samples are left out, not exported.
    negative_is_absent: bool = False

    def __post_init__(self) -> None:
        if self.type != self.target.type:
            raise ValueError(f"{self.source}: a {self.type} cannot feed {self.target.name}")


_H, _C, _G = m.HISTOGRAM, m.COUNTER, m.GAUGE

VLLM = (
    Row("vllm:time_to_first_token_seconds", _H, m.INFERENCE_LATENCY),
    Row("vllm:inter_token_latency_seconds", _H, m.INTER_TOKEN_LATENCY),       # V1 >= 0.11
    Row("vllm:time_per_output_token_seconds", _H, m.INTER_TOKEN_LATENCY),     # V0, V1 < 0.11
    Row("vllm:e2e_request_latency_seconds", _H, m.E2E_LATENCY),
    Row("vllm:request_queue_time_seconds", _H, m.QUEUE_TIME),
    Row("vllm:request_prefill_time_seconds", _H, m.REQUEST_PREFILL),
    Row("vllm:request_decode_time_seconds", _H, m.REQUEST_DECODE),
    Row("vllm:num_requests_running", _G, m.REQUESTS_RUNNING),
    Row("vllm:num_requests_waiting", _G, m.REQUESTS_WAITING),
    Row("vllm:kv_cache_usage_perc", _G, m.KV_USAGE),                          # V1 >= 0.9
    Row("vllm:gpu_cache_usage_perc", _G, m.KV_USAGE),                         # V0, V1 < 0.9
    Row("vllm:prefix_cache_queries", _C, m.KV_QUERY_TOKENS),                  # V1, tokens
    Row("vllm:gpu_prefix_cache_queries", _C, m.KV_QUERY_TOKENS),              # V1 < 0.9
    Row("vllm:prefix_cache_hits", _C, m.KV_HIT_TOKENS),
    Row("vllm:gpu_prefix_cache_hits", _C, m.KV_HIT_TOKENS),
    Row("vllm:gpu_prefix_cache_hit_rate", _G, m.KV_REPORTED_HIT, True),       # V0, blocks
    Row("vllm:num_preemptions", _C, m.PREEMPTIONS),
    Row("vllm:prompt_tokens", _C, m.PROMPT_TOKENS),
    Row("vllm:generation_tokens", _C, m.GENERATION_TOKENS),
)

SGLANG = (
    Row("sglang:time_to_first_token_seconds", _H, m.INFERENCE_LATENCY),
    Row("sglang:inter_token_latency_seconds", _H, m.INTER_TOKEN_LATENCY),
    Row("sglang:time_per_output_token_seconds", _H, m.INTER_TOKEN_LATENCY),
    Row("sglang:e2e_request_latency_seconds", _H, m.E2E_LATENCY),
    Row("sglang:queue_time_seconds", _H, m.QUEUE_TIME),
    Row("sglang:num_running_reqs", _G, m.REQUESTS_RUNNING),
    Row("sglang:num_queue_reqs", _G, m.REQUESTS_WAITING),
    Row("sglang:token_usage", _G, m.KV_USAGE),
    Row("sglang:cache_hit_rate", _G, m.KV_REPORTED_HIT),
    Row("sglang:prompt_tokens", _C, m.PROMPT_TOKENS),
    Row("sglang:generation_tokens", _C, m.GENERATION_TOKENS),
)

TABLES = {m.KIND_VLLM: VLLM, m.KIND_SGLANG: SGLANG}
# The engine's own label that holds its served model's name.
MODEL_LABEL = "model_name"
# vLLM V1's data-parallel rank ("0" for most servers).
RANK_LABEL = "engine"


def kind_of(names) -> str | None:
    """The engine kind whose families these are (by their prefix), or None."""
    for kind in TABLES:
        if any(name.startswith(kind + ":") for name in names):
            return kind
    return None

# What a kind's servers export at all: a figure none of its rows feeds is "not exported by
# vLLM" in the CLI, never an empty table or a zero.
TARGETS = {kind: frozenset(row.target.name for row in rows) for kind, rows in TABLES.items()}
KIND_TITLES = {m.KIND_VLLM: "vLLM", m.KIND_SGLANG: "SGLang"}
# A family the daemon computes stands for the engine family it is computed from.
_COMPUTED_FROM = {m.STREAM_UTILIZATION.name: m.STREAM_BUSY.name}


def exports(kind: str, friendly: Friendly) -> bool:
    """Whether servers of this kind export what a friendly name reads (any of its
    fallbacks will do: a vLLM's token hit rate answers kv_cache_hit_rate)."""
    names = [_COMPUTED_FROM.get(spec.name, spec.name) for spec in friendly.families()]
    if all(name in TARGETS[kind] for name in names):
        return True
    return any(exports(kind, FRIENDLY[other]) for _, other in friendly.fallbacks)
