"""The engine: requests in, token streams out. `step()` is schedule, run, postprocess.

A background thread drives `step()`; callers add requests, iterate their outputs and
abort them from any thread. Scheduler state is only touched under `self._lock`, and never
while the model runs, so adding a request never waits for a step.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ac_observe.engine.block_manager import BlockManager
from ac_observe.engine.config import EngineConfig
from ac_observe.engine.evicted_hashes import DEFAULT_CAPACITY as DEFAULT_EVICTED_MEMORY
from ac_observe.engine.kernel_sampler import KernelSampler, prime_profiler
from ac_observe.engine.model_runner import ModelRunner
from ac_observe.engine.scheduler import NeverFitsError, QueueFullError, ScheduledBatch, Scheduler
from ac_observe.engine.sequence import FinishReason, SamplingParams, Sequence
from ac_observe.engine.skeleton import Skeleton, skeleton_of_request, skeleton_of_text
from ac_observe.engine.stats import NS, EngineStats, NullStats
from ac_observe.engine.telemetry import SkeletonLabeler, TelemetryWriter
from ac_observe.engine.tokenizer import IncrementalDetokenizer, load_tokenizer
from ac_observe.metrics import DEFAULT_LANE, MISS_REASONS, PHASE_DECODE, PHASE_PREFILL

log = logging.getLogger("ac_observe.engine")
IDLE_FLUSH_SECONDS = 0.25

__all__ = ["Engine", "RequestOutput", "TraceDetail", "QueueFullError", "NeverFitsError",
           "SamplingParams", "FinishReason"]


@dataclass(slots=True)
class TraceDetail:
    """What a client sees of one request's path through the engine (trace headers)."""
    frontend_ns: int
    queue_ns: int
    ttft_ns: int
    first_text_ns: int     # arrival to the first non-empty text (0 until there is one)
    e2e_ns: int
    prefill_ms: float
    decode_ms: float
    kv_hit_blocks: int
    kv_query_blocks: int
    kv_miss_blocks: dict[str, int]  # looked-up blocks that missed, by reason
    skeleton_depth: int
    stream: str
    num_preemptions: int


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    stop_sequence: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    trace: TraceDetail | None  # set on the first token and at the finish
    # Arrival to the first non-empty text, on the one output that carries it (else 0).
    first_text_ns: int = 0


class RequestHandle:
    """Outputs of one request, in order; iterate it (or wait for `result`) from any thread.

    A consumer that only wants the result is woken once, at the finish, not per token.
    """

    def __init__(self, engine: Engine, request_id: str):
        self.engine = engine
        self.request_id = request_id
        self._outputs: deque[RequestOutput] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._finished = False
        self._streaming = False

    def _deliver(self, out: RequestOutput) -> None:
        with self._cond:
            self._outputs.append(out)
            self._finished = self._finished or out.finished
            if self._streaming or out.finished:
                self._cond.notify_all()

    def __iter__(self) -> Iterator[RequestOutput]:
        self._streaming = True
        while True:
            with self._cond:
                while not self._outputs:
                    self._cond.wait()
                out = self._outputs.popleft()
            yield out
            if out.finished:
                return

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Block until the request finishes; the merged output."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._finished, timeout):
                raise TimeoutError(f"request {self.request_id} still running")
            outputs = list(self._outputs)
            self._outputs.clear()
        last = outputs[-1]
        last.new_token_ids = [t for out in outputs for t in out.new_token_ids]
        last.new_text = "".join(out.new_text for out in outputs)
        return last

    def abort(self) -> None:
        self.engine.abort(self.request_id)


class _Request:
    """Engine-side state of a request beyond its Sequence: detokenizing and delivery."""
    __slots__ = ("seq", "detok", "emitted_chars", "deliver", "stop_hold")

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer,
                 deliver: Callable[[RequestOutput], None]):
        self.seq = seq
        self.detok = detok
        self.emitted_chars = 0
        self.deliver = deliver
        # A stop string may be split across tokens: hold back what could be its start.
        self.stop_hold = max((len(s) for s in seq.params.stop), default=1) - 1


class Engine:
    """NOTE: with `start=True` the engine thread builds the model and runs every step, so
    all tensor work stays on one thread. (A thread doing CPU tensor work after another
    thread has used the OpenMP pool runs at about half speed here, so keep that one thread
    the only one.) With `start=False` the caller builds and drives it through `step()`."""

    def __init__(self, config: EngineConfig | None = None, start: bool = True):
        self.config = config or EngineConfig()
        self._requests: dict[str, _Request] = {}
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._stopped = False
        self._thread: threading.Thread | None = None
        if self.config.kernel_sampling_steps:
            prime_profiler()
        if not start:
            self._build()
            return
        built = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self._build()
            except BaseException as exc:  # handed to the constructor's caller
                failure.append(exc)
                return
            finally:
                built.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="ac-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            self._thread = None
            raise failure[0]

    def _build(self) -> None:
        config = self.config
        self.runner = ModelRunner(config)
        model_config = self.runner.model.config
        self.model_name = config.model_name or model_config.name
        self.tokenizer = load_tokenizer(config.model, model_config)
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size,
            config.evicted_hash_memory or max(DEFAULT_EVICTED_MEMORY, 4 * self.runner.num_blocks))
        self.overlap_lanes = config.overlap_lanes == "on" or (
            config.overlap_lanes == "auto" and self.runner.device.type == "cuda")
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        writer = None
        if config.telemetry_dir:
            writer = TelemetryWriter(config.telemetry_dir, {
                "engine_id": uuid.uuid4().hex, "api_address": config.api_address,
                "device": str(self.runner.device),
                "num_kv_blocks": self.block_manager.num_blocks, "block_size": config.block_size,
                # The eBPF collector names launches on these streams by lane.
                "cuda_streams": {lane: stream.cuda_stream
                                 for lane, stream in self.runner.streams.items()},
            }, engine=config.engine_name, model=self.model_name, buffered=True)
        # Fault injection (EngineConfig.fault_injection): a delay before every step, and
        # the prefix cache flushed before a step at least this often (0: never).
        self.step_delay_seconds = 0.0
        self.prefix_flush_seconds = 0.0
        self._flushed_at = 0.0
        self.instrumented = config.instrumentation
        self.kernel_sampler = KernelSampler(
            config.kernel_sampling_steps,
            config.kernel_sample_budget, self.runner.device)
        self.block_manager.track_eviction_ages = self.instrumented
        self.stats = EngineStats(writer, SkeletonLabeler(config.skeleton_top_k,
                                                          config.skeleton_min_count)) \
            if self.instrumented else NullStats()
        self.stats.bind(self.scheduler, self.block_manager)
        self.stats.flush()  # the gauges from the start

    # ----- public API -------------------------------------------------------------------

    def start(self) -> None:
        """Drive an engine built with start=False from a background thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ac-engine", daemon=True)
            self._thread.start()

    def add_request(self, prompt: str | list[int] | None = None, *,
                    messages: list[dict] | None = None, system=None,
                    params: SamplingParams | None = None, lane: str = DEFAULT_LANE,
                    request_id: str | None = None, arrival_ns: int | None = None,
                    on_output: Callable[[RequestOutput], None] | None = None) -> RequestHandle:
        """Queue a request: a prompt (text or token ids) or chat messages.

        `arrival_ns` (time.monotonic_ns) is when the request reached the server; every
        latency counts from there (default: now). Raises QueueFullError (waiting queue
        full), NeverFitsError (larger than the whole KV pool) or ValueError (empty, longer
        than the context) without queueing it.
        """
        arrival_ns = arrival_ns or time.monotonic_ns()
        params = params or SamplingParams()
        token_ids, skeleton = self._tokenize(prompt, messages, system)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens; the model's context holds "
                             f"{self.max_model_len} including at least one generated token")
        request_id = request_id or f"req_{os.getpid():x}_{next(self._ids):08x}"
        seq = Sequence(request_id, token_ids, params, lane, arrival_ns)
        seq.skeleton = skeleton
        handle = RequestHandle(self, request_id)
        deliver = on_output or handle._deliver
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in flight")
            try:
                seq.timeline.queued_ns = time.monotonic_ns()
                self.scheduler.add(seq)
            except (QueueFullError, NeverFitsError):
                self.stats.on_rejected(lane if lane in self.scheduler.lanes else DEFAULT_LANE)
                self.stats.flush()
                raise
            self._requests[request_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer),
                                                  deliver)
            self.stats.on_accepted(seq)
            self.stats.flush()  # the queue's gauges move on admission, before any step
            self._wakeup.notify()
        return handle

    def generate(self, prompt=None, **kwargs) -> RequestOutput:
        return self.add_request(prompt, **kwargs).result()

    def stream(self, prompt=None, **kwargs) -> Iterator[RequestOutput]:
        handle = self.add_request(prompt, **kwargs)
        try:
            yield from handle
        finally:
            handle.abort()  # no-op once finished; frees the blocks if the caller walked away

    def generate_batch(self, prompts: list, params: SamplingParams | None = None,
                       **kwargs) -> list[RequestOutput]:
        handles = [self.add_request(p, params=params, **kwargs) for p in prompts]
        return [h.result() for h in handles]

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the next step runs."""
        with self._lock:
            if request_id in self._requests:
                self._aborts.add(request_id)
                self._wakeup.notify()

    def prompt_logits(self, token_ids: list[int]):
        """Logits at every prompt position, computed through the paged cache (for checks
        against reference implementations). Uses fresh blocks, never the prefix cache."""
        seq = Sequence("prompt-logits", token_ids, SamplingParams())
        with self._lock:
            if not self.block_manager.try_allocate(seq, use_cache=False):
                raise NeverFitsError("not enough free KV blocks for the prompt")
            try:
                return self.runner.prompt_logits(seq)
            finally:
                self.block_manager.free(seq)

    def count_tokens(self, prompt=None, messages=None, system=None) -> int:
        return len(self._tokenize(prompt, messages, system)[0])

    def load_summary(self) -> dict:
        """KV pool and queue occupancy, as /health reports it."""
        with self._lock:
            return {"kv_blocks": self.block_manager.num_blocks,
                    "kv_blocks_free": self.block_manager.num_free_blocks,
                    "block_size": self.block_manager.block_size,
                    "requests_running": self.scheduler.num_running,
                    "requests_waiting": self.scheduler.num_waiting}

    def is_alive(self) -> bool:
        """Serving: not closed, and the engine thread (if any) is running."""
        return not self._stopped and (self._thread is None or self._thread.is_alive())

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._requests)

    def check_invariants(self) -> None:
        with self._lock:
            self.block_manager.check_invariants(self.scheduler.live_sequences())

    def close(self) -> None:
        with self._lock:
            self._stopped = True
            self._aborts.update(self._requests)
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():  # stuck in a step: leave its state to it
                log.error("the engine thread did not stop within 30 s")
                return
        with self._lock:
            self._process_aborts()
            self.stats.flush()
        if self.stats.writer:
            self.stats.writer.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- the loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not self._aborts and not self.scheduler.has_work():
                    self.stats.flush()  # idle: every figure written
                    # Woken now and then while idle too: the event loop's figures (first
                    # bytes sent, its lag) arrive without a step to flush them.
                    self._wakeup.wait(IDLE_FLUSH_SECONDS)
                if self._stopped:
                    return
            try:
                self.step()
            except Exception:  # never let one bad step kill the engine thread
                log.exception("engine step failed")

    def step(self) -> bool:
        """One scheduling step: schedule, run, postprocess. Returns False when there was
        nothing to run.

        With overlapping lanes (CUDA by default) it schedules a batch for every lane that
        has work and launches them all before waiting on any, so the lanes' streams run
        together; each lane is postprocessed as its own step completes."""
        with self._lock:
            self._process_aborts()
            if self.prefix_flush_seconds and \
                    time.monotonic() - self._flushed_at >= self.prefix_flush_seconds:
                self.block_manager.flush_prefix_cache()
                self._flushed_at = time.monotonic()
            batches = (self.scheduler.schedule_lanes() if self.overlap_lanes
                       else [b for b in (self.scheduler.schedule(),) if b is not None])
            if not batches:
                self.stats.flush()  # aborts of requests that had not run yet
                return False
            for batch in batches:
                for seq in batch.first_scheduled:
                    self.stats.on_first_scheduled(seq, self.block_manager.block_size)
        if self.step_delay_seconds:  # fault injection: a slower engine, device timers honest
            time.sleep(self.step_delay_seconds)
        keys = [(batch.lane, PHASE_PREFILL if batch.is_prefill else PHASE_DECODE)
                for batch in batches]
        sampled = self.kernel_sampler.begin(keys)
        completed = set()
        try:
            launched = []
            for batch, key in zip(batches, keys, strict=False):
                start_ns = time.monotonic_ns()
                try:
                    launched.append((batch, key, self.runner.launch(batch), start_ns))
                except Exception:
                    self._fail_batch(batch)
            for batch, key, pending, start_ns in launched:
                try:
                    next_tokens, device_seconds = self.runner.finish(pending)
                except Exception:
                    self._fail_batch(batch)
                    continue
                end_ns = time.monotonic_ns()
                completed.add(key)
                with self._lock:  # the outputs first: no figure stands in their way
                    self._postprocess(batch, next_tokens, device_seconds, end_ns)
                    self.scheduler.step_done(batch.lane, (end_ns - start_ns) * NS)
                    self.stats.on_step(batch.lane, key[1], device_seconds, start_ns, end_ns,
                                       len(batch.seqs))
        finally:
            found = self.kernel_sampler.end(completed)
            with self._lock:
                if sampled:
                    self.stats.on_kernel_sample(found)
                self.stats.flush_due()
        return True

    def _fail_batch(self, batch: ScheduledBatch) -> None:
        log.exception("model step failed; failing its %d requests", len(batch.seqs))
        with self._lock:
            for seq in batch.seqs:
                self._finish(self._requests[seq.request_id], FinishReason.ERROR)

    def run_until_idle(self) -> None:
        """Drive steps on the caller's thread (engines built with start=False)."""
        while self.step():
            pass

    # ----- internals --------------------------------------------------------------------

    def _tokenize(self, prompt, messages, system) -> tuple[list[int], Skeleton | None]:
        if messages is not None:
            flat = [{"role": m["role"], "content": _flatten(m.get("content", ""))}
                    for m in messages]
            ids = self.tokenizer.apply_chat_template(flat, _flatten(system) if system else None)
            return ids, (skeleton_of_request(system, messages) if self.instrumented else None)
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), (skeleton_of_text(prompt)
                                                   if self.instrumented else None)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            vocab = self.runner.model.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ValueError(f"token ids must lie in [0, {vocab})")
            return list(prompt), None
        raise ValueError("give a prompt (text or token ids) or messages")

    def _process_aborts(self) -> None:
        if not self._aborts:
            return
        for request_id in self._aborts:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, FinishReason.ABORTED)
        self._aborts.clear()

    def _postprocess(self, batch: ScheduledBatch, next_tokens: list[int | None],
                     device_seconds: float, now_ns: int) -> None:
        first_token_seconds, gap_seconds, prefill_seconds = [], [], []
        try:
            for seq, token_id in zip(batch.seqs, next_tokens, strict=False):
                request = self._requests[seq.request_id]
                seq.num_computed_tokens = len(seq)
                self.block_manager.commit(seq)
                if token_id is None:  # its own sampling failed; the batch goes on
                    self._finish(request, FinishReason.ERROR)
                    continue
                if batch.is_prefill:
                    seq.timeline.prefill_seconds += device_seconds
                else:
                    seq.timeline.decode_seconds += device_seconds
                seq.token_ids.append(token_id)
                timeline = seq.timeline
                previous_ns = timeline.last_token_ns
                timeline.last_token_ns = now_ns
                if not timeline.first_token_ns:
                    timeline.first_token_ns = now_ns
                if previous_ns:
                    gap_seconds.append((now_ns - previous_ns) * NS)
                else:
                    first_token_seconds.append(timeline.ttft_ns * NS)
                    prefill_seconds.append(timeline.prefill_phase_ns * NS)
                self._emit(request, token_id, previous_ns == 0)
        finally:  # the tokens made so far are counted even if a delivery raised
            self.stats.on_tokens(batch.lane, first_token_seconds, gap_seconds,
                                 prefill_seconds)

    def _emit(self, request: _Request, token_id: int, first: bool) -> None:
        seq, params = request.seq, request.seq.params
        # The sampler never picks these before min_tokens (see engine/sampler.py).
        is_eos = (token_id in self.eos_token_ids and not params.ignore_eos) or \
            token_id in params.stop_token_ids
        reason = None
        if is_eos:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            reason = FinishReason.LENGTH
        if not is_eos:
            request.detok.push(token_id)
        if reason is not None:
            request.detok.flush()
        text = request.detok.text
        stop_sequence = None
        if params.stop:
            search_from = max(0, request.emitted_chars - request.stop_hold)
            found = [(text.find(s, search_from), s) for s in params.stop]
            found = [(i, s) for i, s in found if i >= 0]
            if found:
                cut, stop_sequence = min(found)
                text = text[:cut]
                reason = FinishReason.STOP_SEQUENCE
        end = len(text) if reason is not None else max(request.emitted_chars,
                                                       len(text) - request.stop_hold)
        new_text = text[request.emitted_chars:end]
        request.emitted_chars = end
        if new_text and not seq.timeline.first_text_ns:
            seq.timeline.first_text_ns = seq.timeline.last_token_ns
            self.stats.on_first_text(seq)
        if reason is not None:
            self._finish(request, reason, token_id, new_text, stop_sequence)
        else:
            request.deliver(self._output(request, [token_id], new_text, first))

    def _finish(self, request: _Request, reason: FinishReason, token_id: int | None = None,
                new_text: str = "", stop_sequence: str | None = None) -> None:
        seq = request.seq
        self.scheduler.finish(seq, reason)
        del self._requests[seq.request_id]
        self.stats.on_finished(seq)
        new_ids = [] if token_id is None else [token_id]
        out = self._output(request, new_ids, new_text, True)
        out.finished, out.finish_reason, out.stop_sequence = True, reason, stop_sequence
        request.deliver(out)

    def _output(self, request: _Request, new_ids: list[int], new_text: str,
                with_trace: bool) -> RequestOutput:
        seq = request.seq
        trace = None
        if with_trace:
            timeline = seq.timeline
            trace = TraceDetail(
                frontend_ns=timeline.frontend_ns, queue_ns=timeline.queue_ns,
                ttft_ns=timeline.ttft_ns, first_text_ns=timeline.first_text_latency_ns,
                e2e_ns=timeline.e2e_ns,
                prefill_ms=timeline.prefill_seconds * 1e3,
                decode_ms=timeline.decode_seconds * 1e3,
                kv_hit_blocks=seq.kv_hit_blocks, kv_query_blocks=seq.kv_query_blocks,
                kv_miss_blocks=dict(zip(MISS_REASONS, seq.kv_miss_blocks, strict=False)),
                skeleton_depth=seq.skeleton.depth if seq.skeleton else 0, stream=seq.lane,
                num_preemptions=seq.num_preemptions)
        # The first text is the output's whole text when nothing was emitted before it.
        first_text = bool(new_text) and request.emitted_chars == len(new_text)
        return RequestOutput(seq.request_id, new_ids, new_text, False, None, None,
                             seq.num_prompt_tokens, seq.num_output_tokens,
                             seq.num_cached_tokens, trace,
                             seq.timeline.first_text_latency_ns if first_text else 0)


def _flatten(content) -> str:
    """Text of a message's content: a string or a list of content blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(block.get("text", "") for block in content
                       if isinstance(block, dict) and block.get("type", "text") == "text")
    return ""
