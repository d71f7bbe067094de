"""Continuous batching over two lanes, admission by free KV blocks, preemption by recompute.

Each step serves one lane with either a prefill batch (admitting waiting requests) or a
decode batch (one token for every running request of the lane). `low_latency` is served
first, but while both lanes have work `throughput` gets 1/`throughput_share` of the
engine's time (over a sustained contention), so neither lane starves. The share is of
time, not of steps: a throughput step (a batch of 32 or 64) takes several times a
low_latency one, and one step in four would hand it over half the engine (deficit
round robin: throughput earns credit while low_latency runs and spends it running; see
`step_done`). `throughput_share` 1 gives throughput every step it has work for
(low_latency only when it has none).

With overlapping lanes (`schedule_lanes`, CUDA streams) both lanes run every step and no
turn is taken.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ac_observe.engine.block_manager import BlockManager
from ac_observe.engine.config import EngineConfig
from ac_observe.engine.sequence import FinishReason, Sequence, SequenceStatus
from ac_observe.metrics import LOW_LATENCY, THROUGHPUT


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full: the request is rejected, not dropped."""


class NeverFitsError(ValueError):
    """The request needs more KV blocks than the whole pool holds."""


@dataclass(slots=True)
class ScheduledBatch:
    lane: str
    is_prefill: bool
    seqs: list[Sequence]
    first_scheduled: list[Sequence] = field(default_factory=list)  # admitted for the first time


class Lane:
    __slots__ = ("name", "max_num_seqs", "waiting", "running")

    def __init__(self, name: str, max_num_seqs: int):
        self.name = name
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_waiting = config.max_waiting
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.throughput_share = config.throughput_share
        self.prefix_caching = config.enable_prefix_caching
        self.lanes = {lane.name: Lane(lane.name, lane.max_num_seqs) for lane in config.lanes}
        self.num_preemptions = 0
        # Seconds of engine time throughput is owed (> 0: its turn) while both lanes have
        # work (see schedule and step_done). `_contended`: whether the last step counts.
        self._throughput_credit = 0.0
        self._contended = False

    @property
    def num_waiting(self) -> int:
        return sum(len(lane.waiting) for lane in self.lanes.values())

    @property
    def num_running(self) -> int:
        return sum(len(lane.running) for lane in self.lanes.values())

    def has_work(self) -> bool:
        return any(lane.has_work() for lane in self.lanes.values())

    def live_sequences(self) -> list[Sequence]:
        return [seq for lane in self.lanes.values() for seq in (*lane.waiting, *lane.running)]

    def add(self, seq: Sequence) -> None:
        if seq.lane not in self.lanes:
            raise ValueError(f"unknown lane {seq.lane!r}; use low_latency or throughput")
        if self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.max_waiting} requests)")
        worst_len = min(len(seq) + seq.params.max_tokens, self.max_model_len)
        if not self.block_manager.fits_ever(worst_len):
            raise NeverFitsError(
                f"request needs {worst_len} tokens of KV cache; the pool holds "
                f"{self.block_manager.num_blocks * self.block_manager.block_size}")
        self.lanes[seq.lane].waiting.append(seq)

    def schedule_lanes(self) -> list[ScheduledBatch]:
        """A batch for every lane that has work, low_latency first (overlapping lanes).

        NOTE: a later lane's decode may preempt to make room, but never a sequence that an
        earlier lane's batch of this round holds."""
        batches: list[ScheduledBatch] = []
        for lane in (self.lanes[LOW_LATENCY], self.lanes[THROUGHPUT]):
            taken = [seq for batch in batches for seq in batch.seqs]
            batch = self._schedule_prefill(lane) or self._schedule_decode(lane, taken)
            if batch is not None:
                batches.append(batch)
        return batches

    def schedule(self) -> ScheduledBatch | None:
        low, high = self.lanes[LOW_LATENCY], self.lanes[THROUGHPUT]
        contended = low.has_work() and high.has_work()
        if not high.has_work():
            self._throughput_credit = 0.0  # a lane that empties owes and is owed nothing
        elif not low.has_work():
            # No credit is hoarded while low_latency is away; a debt stands, so throughput
            # cannot take more than its share by contending in short bursts.
            self._throughput_credit = min(self._throughput_credit, 0.0)
        order = [high, low] if high.has_work() and (
            self.throughput_share == 1 or self._throughput_credit > 0) else [low, high]
        for lane in order:
            batch = self._schedule_prefill(lane) or self._schedule_decode(lane)
            if batch is not None:
                # Only a turn the share chose is accounted: a lane that ran because the
                # other could not (its requests wait for KV blocks) earns or owes nothing.
                self._contended = contended and lane is order[0]
                return batch
        self._contended = False
        return None

    def step_done(self, lane: str, seconds: float) -> None:
        """A step `schedule` gave has run for `seconds`: while both lanes had work,
        throughput earns 1/(share - 1) of low_latency's time and spends its own; over a
        sustained contention it gets 1/share of the time. The turn flips as the credit
        crosses zero, so credit stays under one low_latency step's worth and a debt under
        one throughput step (a long one is a long wait for low_latency: no step is cut)."""
        if not self._contended or self.throughput_share == 1:
            return
        seconds = max(seconds, 1e-6)  # a clock too coarse to see a step still turns
        if lane == THROUGHPUT:
            self._throughput_credit -= seconds
        else:
            self._throughput_credit += seconds / (self.throughput_share - 1)

    def _schedule_prefill(self, lane: Lane) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        first: list[Sequence] = []
        num_tokens = 0
        while lane.waiting and len(lane.running) < lane.max_num_seqs:
            seq = lane.waiting[0]
            if scheduled and num_tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.block_manager.try_allocate(seq, self.prefix_caching):
                break
            num_tokens += len(seq) - seq.num_computed_tokens
            lane.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if not seq.timeline.first_scheduled_ns:
                seq.timeline.first_scheduled_ns = time.monotonic_ns()
                first.append(seq)
            lane.running.append(seq)
            scheduled.append(seq)
        return ScheduledBatch(lane.name, True, scheduled, first) if scheduled else None

    def _schedule_decode(self, lane: Lane,
                         taken: list[Sequence] = ()) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        for seq in list(lane.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below while making room for an earlier one
            while not self.block_manager.can_append(seq):
                victim = self._pick_victim(exclude=seq, scheduled=[*taken, *scheduled])
                self._preempt(victim or seq)
                if victim is None:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        return ScheduledBatch(lane.name, False, scheduled) if scheduled else None

    def _pick_victim(self, exclude: Sequence, scheduled: list[Sequence]) -> Sequence | None:
        """The most recently admitted running throughput request; a low_latency one only
        to make room for another low_latency request (throughput never preempts it)."""
        lanes = [self.lanes[THROUGHPUT]] + (
            [self.lanes[LOW_LATENCY]] if exclude.lane == LOW_LATENCY else [])
        for lane in lanes:
            for seq in reversed(lane.running):
                if seq is not exclude and seq not in scheduled:
                    return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.lanes[seq.lane].running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.lanes[seq.lane].waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove a request wherever it is and free every block it holds."""
        lane = self.lanes[seq.lane]
        if seq.status is SequenceStatus.RUNNING:
            lane.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            lane.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.timeline.finished_ns = time.monotonic_ns()
