"""Friendly metric names for the CLI and query API, as data.

kind: gauge (samples as they are), histogram (quantiles from bucket deltas), rate (per
second from a counter), ratio (delta of one counter over the delta of another).
`scale` turns the stored unit into the one the name promises.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Friendly:
    name: str
    kind: str
    source: str             # family name (counters without _total)
    unit: str
    scale: float
    help: str
    denominator: str = ""   # ratio only


FRIENDLY = {f.name: f for f in (
    Friendly("inference_latency_ns", "histogram", "ac_inference_latency_seconds", "ns", 1e9,
             "Time to first token (arrival to first token ready)."),
    Friendly("queue_time_ns", "histogram", "ac_queue_time_seconds", "ns", 1e9,
             "Arrival to first scheduled."),
    Friendly("e2e_latency_ms", "histogram", "ac_e2e_latency_seconds", "ms", 1e3,
             "Arrival to finish."),
    Friendly("inter_token_latency_ms", "histogram", "ac_inter_token_latency_seconds", "ms", 1e3,
             "Time between output tokens."),
    Friendly("prefill_gpu_ms", "histogram", "ac_prefill_gpu_seconds", "ms", 1e3,
             "Device time of a prefill step."),
    Friendly("decode_step_gpu_ms", "histogram", "ac_decode_step_gpu_seconds", "ms", 1e3,
             "Device time of a decode step."),
    Friendly("skeleton_complexity", "histogram", "ac_skeleton_complexity", "levels", 1.0,
             "Prompt skeleton depth."),
    Friendly("kv_cache_hit_rate", "ratio", "ac_kv_cache_hit_blocks", "%", 100.0,
             "Prefix-cache hits over lookups, in full blocks.",
             denominator="ac_kv_cache_query_blocks"),
    Friendly("kv_cache_token_hit_rate", "ratio", "ac_kv_cache_hit_tokens", "%", 100.0,
             "Prompt tokens served from the prefix cache over prompt tokens.",
             denominator="ac_kv_cache_query_tokens"),
    Friendly("kv_cache_usage", "gauge", "ac_kv_cache_usage_ratio", "%", 100.0,
             "KV blocks held by requests."),
    Friendly("cuda_stream_utilization", "gauge", "ac_cuda_stream_utilization", "%", 100.0,
             "Busy fraction of each lane's stream."),
    Friendly("requests_per_second", "rate", "ac_requests", "req/s", 1.0,
             "Finished requests per second, by status."),
    Friendly("generation_tokens_per_second", "rate", "ac_generation_tokens", "tok/s", 1.0,
             "Generated tokens per second."),
    Friendly("prompt_tokens_per_second", "rate", "ac_prompt_tokens", "tok/s", 1.0,
             "Prompt tokens admitted per second."),
    Friendly("preemptions_per_second", "rate", "ac_preemptions", "1/s", 1.0,
             "Requests preempted per second."),
    Friendly("requests_running", "gauge", "ac_requests_running", "requests", 1.0,
             "Requests holding KV blocks."),
    Friendly("requests_waiting", "gauge", "ac_requests_waiting", "requests", 1.0,
             "Requests waiting for admission."),
    Friendly("gpu_utilization", "gauge", "ac_gpu_utilization_ratio", "%", 100.0,
             "GPU busy fraction (NVML)."),
    Friendly("gpu_memory_used_bytes", "gauge", "ac_gpu_memory_used_bytes", "B", 1.0,
             "Device memory in use."),
    Friendly("gpu_power_watts", "gauge", "ac_gpu_power_watts", "W", 1.0, "Board power."),
    Friendly("gpu_temperature_celsius", "gauge", "ac_gpu_temperature_celsius", "°C", 1.0,
             "GPU temperature."),
    Friendly("gpu_sm_clock_hertz", "gauge", "ac_gpu_sm_clock_hertz", "Hz", 1.0, "SM clock."),
    Friendly("gpu_sm_occupancy", "gauge", "ac_gpu_sm_occupancy_ratio", "%", 100.0,
             "SM occupancy (GPM, Hopper+)."),
    Friendly("gpu_sm_active", "gauge", "ac_gpu_sm_active_ratio", "%", 100.0,
             "SM active (GPM, Hopper+)."),
    Friendly("gpu_tensor_active", "gauge", "ac_gpu_tensor_active_ratio", "%", 100.0,
             "Tensor cores active (GPM, Hopper+)."),
    Friendly("gpu_dram_active", "gauge", "ac_gpu_dram_active_ratio", "%", 100.0,
             "DRAM bandwidth used (GPM, Hopper+)."),
)}


def watched_families() -> set[str]:
    """Families whose history the daemon keeps for queries."""
    names = set()
    for f in FRIENDLY.values():
        names.add(f.source)
        if f.denominator:
            names.add(f.denominator)
    return names

