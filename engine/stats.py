"""Where the engine's figures are born: request timelines and step times become metrics.

`EngineStats` turns engine events into the catalog's series through a `TelemetryWriter`
(or keeps only its in-memory lane totals when the engine runs without telemetry).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_manager import BlockManager, PrefixCacheStats
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence
from engine.telemetry import SkeletonLabeler, TelemetryWriter

NS = 1e-9

_KV_COUNTERS = (
    ("query_blocks", "ac_kv_cache_query_blocks_total"),
    ("hit_blocks", "ac_kv_cache_hit_blocks_total"),
    ("query_tokens", "ac_kv_cache_query_tokens_total"),
    ("hit_tokens", "ac_kv_cache_hit_tokens_total"),
    ("evictions", "ac_kv_cache_evictions_total"),
)


@dataclass(slots=True)
class LaneTotals:
    """Per-lane device time and the host window it fell in (for busy <= elapsed checks)."""
    busy_seconds: float = 0.0
    num_steps: int = 0
    first_step_start_ns: int = 0
    last_step_end_ns: int = 0


@dataclass(slots=True)
class EngineStats:
    writer: TelemetryWriter | None
    skeleton_labels: SkeletonLabeler
    lanes: dict[str, LaneTotals] = field(default_factory=dict)
    _kv_exported: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _preemptions_exported: int = 0

    def lane(self, name: str) -> LaneTotals:
        totals = self.lanes.get(name)
        if totals is None:
            totals = self.lanes[name] = LaneTotals()
        return totals

    def on_rejected(self, lane: str) -> None:
        if self.writer:
            self.writer.inc("ac_requests_total", stream=lane, status="rejected")

    def on_accepted(self, seq: Sequence) -> None:
        if self.writer and seq.skeleton is not None:
            self.writer.observe("ac_skeleton_complexity", float(seq.skeleton.depth))
            self.writer.inc("ac_skeleton_requests_total",
                            skeleton=self.skeleton_labels.label(seq.skeleton.skeleton_id))

    def on_step(self, lane: str, is_prefill: bool, device_seconds: float, start_ns: int,
                end_ns: int) -> None:
        totals = self.lane(lane)
        totals.busy_seconds += device_seconds
        totals.num_steps += 1
        totals.first_step_start_ns = totals.first_step_start_ns or start_ns
        totals.last_step_end_ns = end_ns
        if self.writer:
            name = "ac_prefill_gpu_seconds" if is_prefill else "ac_decode_step_gpu_seconds"
            self.writer.observe(name, device_seconds, stream=lane)
            self.writer.inc("ac_cuda_stream_busy_seconds_total", device_seconds, stream=lane)

    def on_first_scheduled(self, seq: Sequence) -> None:
        if self.writer:
            self.writer.observe("ac_queue_time_seconds", seq.timeline.queue_ns * NS,
                                stream=seq.lane)
            self.writer.inc("ac_prompt_tokens_total", seq.num_prompt_tokens)

    def on_token(self, seq: Sequence, previous_token_ns: int) -> None:
        if not self.writer:
            return
        self.writer.inc("ac_generation_tokens_total")
        timeline = seq.timeline
        if previous_token_ns == 0:
            self.writer.observe("ac_inference_latency_seconds", timeline.ttft_ns * NS,
                                stream=seq.lane)
        else:
            self.writer.observe("ac_inter_token_latency_seconds",
                                (timeline.last_token_ns - previous_token_ns) * NS,
                                stream=seq.lane)

    def on_finished(self, seq: Sequence) -> None:
        if not self.writer:
            return
        reason = seq.finish_reason
        status = {FinishReason.ABORTED: "aborted", FinishReason.ERROR: "error"}.get(reason, "ok")
        self.writer.inc("ac_requests_total", stream=seq.lane, status=status)
        if status == "ok":
            self.writer.observe("ac_e2e_latency_seconds", seq.timeline.e2e_ns * NS,
                                stream=seq.lane)

    def on_state(self, scheduler: Scheduler, block_manager: BlockManager) -> None:
        """After every step: KV counters (as deltas), gauges, preemptions."""
        if not self.writer:
            return
        stats, exported = block_manager.stats, self._kv_exported
        for attr, metric in _KV_COUNTERS:
            delta = getattr(stats, attr) - getattr(exported, attr)
            if delta:
                self.writer.inc(metric, delta)
                setattr(exported, attr, getattr(stats, attr))
        delta = scheduler.num_preemptions - self._preemptions_exported
        if delta:
            self.writer.inc("ac_preemptions_total", delta)
            self._preemptions_exported = scheduler.num_preemptions
        self.writer.set("ac_kv_cache_usage_ratio", block_manager.usage)
        self.writer.set("ac_kv_cache_blocks", block_manager.num_blocks)
        for lane in scheduler.lanes.values():
            self.writer.set("ac_requests_running", len(lane.running), stream=lane.name)
            self.writer.set("ac_requests_waiting", len(lane.waiting), stream=lane.name)

