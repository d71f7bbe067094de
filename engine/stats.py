"""Where the engine's figures are born: request timelines and step times become metrics.

`EngineStats` turns engine events into the catalog's series through a `TelemetryWriter`
(or keeps only its in-memory lane totals when the engine runs without telemetry).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ac_observe import metrics as m

from ac_observe.engine.block_manager import BlockManager
from ac_observe.engine.scheduler import Scheduler
from ac_observe.engine.sequence import FinishReason, Sequence
from ac_observe.engine.telemetry import SkeletonLabeler, TelemetryWriter

NS = 1e-9



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
    _evictions_exported: int = 0
    _preemptions_exported: int = 0

    def lane(self, name: str) -> LaneTotals:
        totals = self.lanes.get(name)
        if totals is None:
            totals = self.lanes[name] = LaneTotals()
        return totals

    def on_rejected(self, lane: str) -> None:
        if self.writer:
            self.writer.inc(m.REQUESTS, stream=lane, status="rejected")

    def on_accepted(self, seq: Sequence) -> None:
        if not self.writer:
            return
        self.writer.observe(m.FRONTEND, seq.timeline.frontend_ns * NS, stream=seq.lane)
        if seq.skeleton is not None:
            seq.skeleton_label = self.skeleton_labels.label(seq.skeleton.skeleton_id)
            self.writer.observe(m.SKELETON_COMPLEXITY, float(seq.skeleton.depth))
            self.writer.inc(m.SKELETON_REQUESTS, skeleton=seq.skeleton_label)

    def on_step(self, lane: str, phase: str, device_seconds: float, start_ns: int,
                end_ns: int) -> None:
        totals = self.lane(lane)
        totals.busy_seconds += device_seconds
        totals.num_steps += 1
        totals.first_step_start_ns = totals.first_step_start_ns or start_ns
        totals.last_step_end_ns = end_ns
        if self.writer:
            spec = m.PREFILL_GPU if phase == m.PHASE_PREFILL else m.DECODE_STEP_GPU
            self.writer.observe(spec, device_seconds, stream=lane)
            self.writer.inc(m.STREAM_BUSY, device_seconds, stream=lane)
            self.writer.inc(m.ENGINE_STEPS, stream=lane, phase=phase)

    def on_kernel_sample(self, found: dict[tuple[str, str], dict[str, float]]) -> None:
        """A sampled step's seconds per class, for each of its batches' lane and phase."""
        if not self.writer:
            return
        for (lane, phase), classes in found.items():
            self.writer.inc(m.KERNEL_SAMPLED_STEPS, stream=lane, phase=phase)
            for cls, seconds in classes.items():
                self.writer.observe(m.KERNEL_SECONDS, seconds, stream=lane, phase=phase,
                                    **{"class": cls})

    def on_first_scheduled(self, seq: Sequence, block_size: int) -> None:
        """Admission: queue time, and the prefix-cache lookup of the prompt (a sequence is
        first scheduled exactly when it first gets blocks; re-admission is recompute)."""
        if not self.writer:
            return
        self.writer.observe(m.QUEUE_TIME, seq.timeline.queue_ns * NS, stream=seq.lane)
        self.writer.inc(m.PROMPT_TOKENS, seq.num_prompt_tokens)
        if seq.kv_miss_blocks:  # looked up (empty when prefix caching is off)
            skeleton = seq.skeleton_label
            self.writer.inc(m.KV_QUERY_BLOCKS, seq.kv_query_blocks, skeleton=skeleton)
            self.writer.inc(m.KV_HIT_BLOCKS, seq.kv_hit_blocks, skeleton=skeleton)
            self.writer.inc(m.KV_QUERY_TOKENS, seq.num_prompt_tokens, skeleton=skeleton)
            self.writer.inc(m.KV_HIT_TOKENS, seq.kv_hit_blocks * block_size, skeleton=skeleton)
            for reason, count in zip(m.MISS_REASONS, seq.kv_miss_blocks):
                if count:
                    self.writer.inc(m.KV_MISS_BLOCKS, count, reason=reason)
                    self.writer.inc(m.KV_MISS_TOKENS, count * block_size, reason=reason)

    def on_token(self, seq: Sequence, previous_token_ns: int) -> None:
        if not self.writer:
            return
        self.writer.inc(m.GENERATION_TOKENS)
        timeline = seq.timeline
        if previous_token_ns == 0:
            self.writer.observe(m.INFERENCE_LATENCY, timeline.ttft_ns * NS,
                                stream=seq.lane)
        else:
            self.writer.observe(m.INTER_TOKEN_LATENCY,
                                (timeline.last_token_ns - previous_token_ns) * NS,
                                stream=seq.lane)

    def on_first_text(self, seq: Sequence) -> None:
        if self.writer:
            self.writer.observe(m.FIRST_TEXT, seq.timeline.first_text_latency_ns * NS,
                                stream=seq.lane)

    def on_finished(self, seq: Sequence) -> None:
        if not self.writer:
            return
        reason = seq.finish_reason
        status = {FinishReason.ABORTED: "aborted", FinishReason.ERROR: "error"}.get(reason, "ok")
        self.writer.inc(m.REQUESTS, stream=seq.lane, status=status)
        if status == "ok":
            self.writer.observe(m.E2E_LATENCY, seq.timeline.e2e_ns * NS,
                                stream=seq.lane)

    def on_state(self, scheduler: Scheduler, block_manager: BlockManager) -> None:
        """After every step: evictions and their ages, preemptions, gauges."""
        if not self.writer:
            block_manager.eviction_ages.clear()
            return
        delta = block_manager.stats.evictions - self._evictions_exported
        if delta:
            self.writer.inc(m.KV_EVICTIONS, delta)
            self._evictions_exported = block_manager.stats.evictions
        if block_manager.eviction_ages:
            self.writer.observe_many(m.KV_EVICTION_AGE, block_manager.eviction_ages)
            block_manager.eviction_ages.clear()
        delta = scheduler.num_preemptions - self._preemptions_exported
        if delta:
            self.writer.inc(m.PREEMPTIONS, delta)
            self._preemptions_exported = scheduler.num_preemptions
        self.on_gauges(scheduler, block_manager)

    def on_gauges(self, scheduler: Scheduler, block_manager: BlockManager) -> None:
        """On every change of who holds blocks or waits (admission, finish, abort, step)."""
        if not self.writer:
            return
        self.writer.set(m.KV_USAGE, block_manager.usage)
        self.writer.set(m.KV_BLOCKS, block_manager.num_blocks)
        for lane in scheduler.lanes.values():
            self.writer.set(m.REQUESTS_RUNNING, len(lane.running), stream=lane.name)
            self.writer.set(m.REQUESTS_WAITING, len(lane.waiting), stream=lane.name)



class NullStats(EngineStats):
    """An engine without instrumentation: every event is dropped unlooked-at."""

    def __init__(self):
        super().__init__(None, SkeletonLabeler(0, 1))

    def on_rejected(self, lane): pass
    def on_accepted(self, seq): pass
    def on_step(self, lane, phase, device_seconds, start_ns, end_ns): pass
    def on_kernel_sample(self, found): pass
    def on_first_scheduled(self, seq, block_size): pass
    def on_token(self, seq, previous_token_ns): pass
    def on_first_text(self, seq): pass
    def on_finished(self, seq): pass
    def on_state(self, scheduler, block_manager):
        block_manager.eviction_ages.clear()  # (not kept without instrumentation; belt)
    def on_gauges(self, scheduler, block_manager): pass
