"""Where the engine's figures are born: request timelines and step times become metrics.

`EngineStats` turns engine events into the catalog's series through a `TelemetryWriter`
(or keeps only its in-memory lane totals when the engine runs without telemetry).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from ac_observe import metrics as m
from ac_observe.engine.block_manager import BlockManager
from ac_observe.engine.scheduler import Scheduler
from ac_observe.engine.sequence import FinishReason, Sequence
from ac_observe.engine.telemetry import Series, SkeletonLabeler, TelemetryWriter

log = logging.getLogger("ac_observe.engine")

NS = 1e-9
# Per-step figures are kept in lists and handed to the writer at most this often (and
# whenever the engine goes idle, admits or rejects a request, and at close): the daemon
# reads once a second. Only `flush` writes the files, so what a reader sees was written
# together (a step's count with its sampled-step count, a request's with its latencies).
FLUSH_SECONDS = 0.05


@dataclass(slots=True)
class LaneTotals:
    """Per-lane device time and the host window it fell in (for busy <= elapsed checks)."""
    busy_seconds: float = 0.0
    num_steps: int = 0
    first_step_start_ns: int = 0
    last_step_end_ns: int = 0


class _LaneSeries:
    """A lane's per-step series, resolved once, and what its steps and tokens added since
    the last flush (the hot path appends to lists; `commit` hands them to the writer)."""
    __slots__ = ("step_gpu", "busy", "steps", "batch", "ttft", "itl", "prefill", "running",
                 "waiting", "step_seconds", "step_sequences", "busy_seconds", "ttft_seconds",
                 "itl_seconds", "prefill_seconds")

    def __init__(self, writer: TelemetryWriter, lane: str):
        self.step_seconds: dict[str, list[float]] = {m.PHASE_PREFILL: [], m.PHASE_DECODE: []}
        # each step's sequences, beside its seconds (one entry a step, in the same order)
        self.step_sequences: dict[str, list[int]] = {m.PHASE_PREFILL: [], m.PHASE_DECODE: []}
        self.busy_seconds = 0.0
        self.ttft_seconds: list[float] = []
        self.itl_seconds: list[float] = []
        self.prefill_seconds: list[float] = []
        self.step_gpu = {m.PHASE_PREFILL: writer.series(m.PREFILL_GPU, stream=lane),
                         m.PHASE_DECODE: writer.series(m.DECODE_STEP_GPU, stream=lane)}
        self.steps = {phase: writer.series(m.ENGINE_STEPS, stream=lane, phase=phase)
                      for phase in (m.PHASE_PREFILL, m.PHASE_DECODE)}
        self.batch = {phase: writer.series(m.BATCH_SEQUENCES, stream=lane, phase=phase)
                      for phase in (m.PHASE_PREFILL, m.PHASE_DECODE)}
        self.busy = writer.series(m.STREAM_BUSY, stream=lane)
        self.ttft = writer.series(m.INFERENCE_LATENCY, stream=lane)
        self.itl = writer.series(m.INTER_TOKEN_LATENCY, stream=lane)
        self.prefill = writer.series(m.REQUEST_PREFILL, stream=lane)
        self.running = writer.series(m.REQUESTS_RUNNING, stream=lane)
        self.waiting = writer.series(m.REQUESTS_WAITING, stream=lane)

    def commit(self) -> None:
        for phase, seconds in self.step_seconds.items():
            if seconds:
                self.step_gpu[phase].observe_many(seconds)
                self.steps[phase].inc(len(seconds))
                self.batch[phase].observe_many(self.step_sequences[phase])
                seconds.clear()
                self.step_sequences[phase].clear()
        if self.busy_seconds:
            self.busy.inc(self.busy_seconds)
            self.busy_seconds = 0.0
        for pending, series in ((self.ttft_seconds, self.ttft), (self.itl_seconds, self.itl),
                                (self.prefill_seconds, self.prefill)):
            if pending:
                series.observe_many(pending)
                pending.clear()


@dataclass(slots=True)
class EngineStats:
    writer: TelemetryWriter | None
    skeleton_labels: SkeletonLabeler
    lanes: dict[str, LaneTotals] = field(default_factory=dict)
    _evictions_exported: int = 0
    _preemptions_exported: int = 0
    _by_lane: dict[str, _LaneSeries] = field(default_factory=dict)
    _tokens: Series | None = None
    _kv_usage: Series | None = None
    _kv_blocks: Series | None = None
    _pending_tokens: int = 0
    _gauges: tuple = ()
    _flushed: float = 0.0
    _flush_failed: bool = False
    _scheduler: Scheduler | None = None
    _block_manager: BlockManager | None = None
    # Figures the event loop measures (delivery, its own lag): appended there without the
    # engine's lock (a deque's append is atomic), written by the next flush.
    _from_loop: deque = field(default_factory=deque)

    def bind(self, scheduler: Scheduler, block_manager: BlockManager) -> None:
        """The engine's scheduler and KV pool, whose state each flush writes (evictions,
        preemptions, gauges: read when written, never per step)."""
        self._scheduler, self._block_manager = scheduler, block_manager

    def _lane_series(self, lane: str) -> _LaneSeries:
        series = self._by_lane.get(lane)
        if series is None:
            series = self._by_lane[lane] = _LaneSeries(self.writer, lane)
            if self._tokens is None:  # the engine-wide ones, with the first lane's
                self._tokens = self.writer.series(m.GENERATION_TOKENS)
                self._kv_usage = self.writer.series(m.KV_USAGE)
                self._kv_blocks = self.writer.series(m.KV_BLOCKS)
        return series

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
                end_ns: int, num_seqs: int) -> None:
        """One model step of a lane's batch: its device time, host span and sequences."""
        totals = self.lane(lane)
        totals.busy_seconds += device_seconds
        totals.num_steps += 1
        totals.first_step_start_ns = totals.first_step_start_ns or start_ns
        totals.last_step_end_ns = end_ns
        if self.writer:
            series = self._lane_series(lane)
            series.step_seconds[phase].append(device_seconds)
            series.step_sequences[phase].append(num_seqs)
            series.busy_seconds += device_seconds

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
            for reason, count in zip(m.MISS_REASONS, seq.kv_miss_blocks, strict=False):
                if count:
                    self.writer.inc(m.KV_MISS_BLOCKS, count, reason=reason)
                    self.writer.inc(m.KV_MISS_TOKENS, count * block_size, reason=reason)

    def on_tokens(self, lane: str, first_token_seconds: list[float],
                  gap_seconds: list[float], prefill_seconds: Iterable[float] = ()) -> None:
        """A batch's new tokens: time to first token of the sequences that got their
        first (and their prefill phase, first scheduled to then: with front-end and queue
        time it adds up to the TTFT), and the gap since the previous token of the others
        (one write per bucket touched, not one per token)."""
        if not self.writer:
            return
        series = self._lane_series(lane)
        self._pending_tokens += len(first_token_seconds) + len(gap_seconds)
        series.ttft_seconds += first_token_seconds
        series.itl_seconds += gap_seconds
        series.prefill_seconds += prefill_seconds

    def on_first_text(self, seq: Sequence) -> None:
        if self.writer:
            self.writer.observe(m.FIRST_TEXT, seq.timeline.first_text_latency_ns * NS,
                                stream=seq.lane)

    def on_first_sent(self, lane: str, sent_seconds: float, lag_seconds: float) -> None:
        """A stream's first content bytes handed to the socket (the event loop's thread):
        arrival to then, and first text ready to then."""
        self._from_loop.append((m.FIRST_TOKEN_SENT, sent_seconds, lane))
        self._from_loop.append((m.DELIVERY_LAG, lag_seconds, lane))

    def on_loop_lag(self, seconds: float) -> None:
        """One sample of the event loop's lag (the event loop's thread)."""
        self._from_loop.append((m.EVENT_LOOP_LAG, seconds, None))

    def _write_from_loop(self) -> None:
        while self._from_loop:
            spec, seconds, lane = self._from_loop.popleft()
            if lane is None:
                self.writer.observe(spec, seconds)
            else:
                self.writer.observe(spec, seconds, stream=lane)

    def on_finished(self, seq: Sequence) -> None:
        if not self.writer:
            return
        reason = seq.finish_reason
        status = {FinishReason.ABORTED: "aborted", FinishReason.ERROR: "error"}.get(reason, "ok")
        self.writer.inc(m.REQUESTS, stream=seq.lane, status=status)
        if status == "ok":
            # e2e = front-end + queue + prefill phase + decode phase, request by request
            self.writer.observe(m.E2E_LATENCY, seq.timeline.e2e_ns * NS,
                                stream=seq.lane)
            self.writer.observe(m.REQUEST_DECODE, seq.timeline.decode_phase_ns * NS,
                                stream=seq.lane)

    def _write_state(self) -> None:
        """The scheduler's and the KV pool's state as it is now: evictions and their ages,
        preemptions, and the gauges (written only when they changed)."""
        scheduler, block_manager = self._scheduler, self._block_manager
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
        lanes = scheduler.lanes.values()
        gauges = (block_manager.usage, block_manager.num_blocks,
                  *[(len(lane.running), len(lane.waiting)) for lane in lanes])
        if gauges == self._gauges:
            return  # nothing admitted, finished or freed since the last flush
        self._gauges = gauges
        for lane in lanes:
            series = self._lane_series(lane.name)
            series.running.set(len(lane.running))
            series.waiting.set(len(lane.waiting))
        self._kv_usage.set(block_manager.usage)
        self._kv_blocks.set(block_manager.num_blocks)

    def flush(self) -> None:
        """What the steps since the last flush added, and the state now, into the
        telemetry files. Called under the engine's lock (as every hook is): on admission
        and rejection, when the loop goes idle, at close, and from `flush_due`."""
        self._flushed = time.monotonic()
        if not self.writer:
            self._block_manager.eviction_ages.clear()  # not kept without telemetry
            self._from_loop.clear()  # nor the loop's figures: 10 a second, forever
            return
        try:
            self._write_state()
            self._write_from_loop()
            for series in self._by_lane.values():
                series.commit()
            if self._pending_tokens:
                self._tokens.inc(self._pending_tokens)
                self._pending_tokens = 0
            self.writer.flush()
        except Exception:  # a full disk costs figures, never a request or the engine
            if not self._flush_failed:
                log.exception("telemetry flush failed; figures are kept and retried")
            self._flush_failed = True
        else:
            self._flush_failed = False

    def flush_due(self) -> None:
        """After a step: flush if FLUSH_SECONDS passed since the last flush."""
        if time.monotonic() - self._flushed >= FLUSH_SECONDS:
            self.flush()


class NullStats(EngineStats):
    """An engine without instrumentation: every event is dropped unlooked-at."""

    def __init__(self):
        super().__init__(None, SkeletonLabeler(0, 1))

    def on_rejected(self, lane): pass
    def on_accepted(self, seq): pass
    def on_step(self, lane, phase, device_seconds, start_ns, end_ns, num_seqs): pass
    def on_kernel_sample(self, found): pass
    def on_first_scheduled(self, seq, block_size): pass
    def on_tokens(self, lane, first_token_seconds, gap_seconds, prefill_seconds=()): pass
    def on_first_text(self, seq): pass
    def on_first_sent(self, lane, sent_seconds, lag_seconds): pass
    def on_loop_lag(self, seconds): pass
    def on_finished(self, seq): pass
    def flush(self): pass
    def flush_due(self): pass
