"""Sampled kernel time: now and then one step runs under the PyTorch profiler, and the
time of every kernel (on a GPU) or operator (on CPU) in it is added up per class.

Which step: each lane and phase (prefill, decode) counts its own steps, and its every Nth
step is sampled (`kernel_sample_steps`, 0 = off), unless sampling has spent its budget
(`kernel_sample_budget`, a share of wall time: 0.5 % by default; 1 = no limit). What a sample costs
is measured, not assumed: the profiler's start and stop, reading its events, and how much
longer the sampled steps ran than their lane's and phase's usual step. The budget refills
at its share of wall time and holds at most a minute's worth, so a burst after a quiet
hour is still held to the budget.

What is counted: ops and kernels inside a step's own scope (`ac::step/<lane>/<phase>`,
opened by the model runner around the forward pass and sampling of a sampled step);
input preparation, post-processing and other threads are not. On CUDA that is each
kernel, memcpy and memset on the device, found through the op that launched it; on CPU
it is each operator's self time (its time minus its children's), so nothing is counted
twice.

Which class: the outermost enclosing scope or op whose name says one wins: a GEMM inside
`aten::scaled_dot_product_attention` is attention time, an `aten::mul_` inside the
model's `ac::rope` scope is RoPE. Device copies and sets are memcpy wherever they were
issued from. A kernel whose launching ops say nothing (a graph replay) is classed by its
own name; what nothing names is `other`. Kernel names never become labels.

NOTE: the profiler is process-wide. A sample is skipped while another profiler (a user's
`torch.profiler`) is running, and the model's scopes cost one flag test while no sample
runs. Kineto's per-start log lines are silenced (KINETO_LOG_LEVEL=6, unless set).
"""
from __future__ import annotations

import bisect
import logging
import os
import re
import time
from collections import defaultdict
from contextlib import nullcontext

import torch
from torch.autograd import profiler as autograd_profiler
from torch.autograd.profiler import record_function

from ac_observe.metrics import KERNEL_CLASSES, LANES, PHASES

log = logging.getLogger(__name__)

STEP_SCOPE = "ac::step/"
SCOPE_ATTENTION, SCOPE_GEMM, SCOPE_ROPE, SCOPE_NORM, SCOPE_ACTIVATION, SCOPE_SAMPLING = (
    "ac::attention", "ac::gemm", "ac::rope", "ac::norm", "ac::activation", "ac::sampling")
STEP_SCOPES = {(lane, phase): f"{STEP_SCOPE}{lane}/{phase}" for lane in LANES for phase in PHASES}
_SCOPE_KEYS = {name: key for key, name in STEP_SCOPES.items()}

# (class, pattern) in order: the first match names an op's or a kernel's class. Patterns
# cover PyTorch's CPU operators, CUDA kernel names (cuBLAS/CUTLASS/nvjet GEMMs, flash and
# memory-efficient attention, PyTorch's norm, softmax, sort and reduction kernels) and
# the model's own scopes. tests/test_kernel_sampler.py holds real kernel names of each.
CLASS_RULES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (cls, re.compile(pattern, re.IGNORECASE)) for cls, pattern in (
        ("memcpy", r"\bmemcpy|\bmemset|copy_kernel|^aten::(copy_|_to_copy|to|clone|contiguous)$"),
        ("attention", r"^ac::attention$|attention|\battn|flash|fmha|paged_|sdpa|"
                      r"^aten::_?(efficient|cudnn)_attention"),
        ("gemm", r"^ac::gemm$|^aten::(mm|addmm|bmm|baddbmm|matmul|linear|addmv|mv|_int_mm|dot)$|"
                 r"^mkldnn::_linear_pointwise|gemm|gemv|"
                 r"cutlass|cublas|xmma|nvjet|splitk"),
        ("norm", r"^ac::norm$|rms_?norm|layer_?norm|group_?norm|batch_?norm"),
        ("rope", r"^ac::rope$|rope|rotary"),
        ("activation", r"^ac::activation$|silu|gelu|swiglu|geglu|act_and_mul|"
                       r"^aten::(relu|sigmoid|tanh)_?$"),
        ("sampling", r"^ac::sampling$|multinomial|argmax|argmin|topk|top_k|sort|softmax|"
                     r"exponential|cumsum|gumbel"),
    ))
assert {cls for cls, _ in CLASS_RULES} | {"other"} == set(KERNEL_CLASSES)
_DEVICE_COPIES = frozenset(("gpu_memcpy", "gpu_memset"))
_DEVICE_WORK = frozenset(("kernel",)) | _DEVICE_COPIES
_HOST_EVENTS = frozenset(("cpu_op", "user_annotation"))
_LAUNCH_CALLS = frozenset(("cuda_runtime", "cuda_driver"))


_MISSING = object()
_class_cache: dict[str, str | None] = {}


def classify(name: str) -> str | None:
    """The class an op's, kernel's or scope's name says, or None when it says none."""
    cls = _class_cache.get(name, _MISSING)
    if cls is _MISSING:
        cls = next((cls for cls, pattern in CLASS_RULES if pattern.search(name)), None)
        if len(_class_cache) < 8192:  # templated kernel names are many, but not unbounded
            _class_cache[name] = cls
    return cls


def attribute(events, device_kernels: bool) -> dict[tuple[str, str], dict[str, int]]:
    """Nanoseconds per class for each (lane, phase) step scope in a profile's events
    (`_KinetoEvent`s, or anything with their methods). device_kernels: count the device's
    kernels, memcpys and memsets (CUDA); else the host operators' self time (CPU)."""
    host, device, launches = _read_events(events, device_kernels)
    host.sort()  # by thread, then start, the longer (enclosing) event first
    closed, launchers = _host_tree(host, device_kernels)
    totals: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    if not device_kernels:
        for _, _, cls, key, child_ns, own_ns, is_op, _ in closed:
            if key is not None and is_op:
                totals[key][cls or "other"] += max(own_ns - child_ns, 0)
        return {key: dict(classes) for key, classes in totals.items()}
    placed = _Placer(closed)
    for linked, correlation, ns, name, is_copy in device:
        launcher = launchers.get(linked)
        if launcher is None and correlation in launches:
            # Launched with no op around it (a graph replay, a Triton or extension kernel):
            # placed by when its launch call ran, inside a step scope on that scope's thread.
            launcher = placed.at(launches[correlation])
        if launcher is None or launcher[3] is None:
            continue  # launched outside a sampled step's scope
        cls = "memcpy" if is_copy else launcher[2] or classify(name) or "other"
        totals[launcher[3]][cls] += ns
    return {key: dict(classes) for key, classes in totals.items()}


def _read_events(events, device_kernels: bool) -> tuple[list[tuple], list[tuple], dict]:
    """(host events, device work, launch calls' start by correlation id) of a profile;
    device work and launches only with device_kernels."""
    host, device, launches = [], [], {}
    for event in events:  # each field read once: the bindings' calls are the cost here
        kind = event.activity_type()
        if kind in _HOST_EVENTS:
            if not event.is_async():
                host.append((event.start_thread_id(), event.start_ns(), -event.duration_ns(),
                             event.name(), kind == "cpu_op", event.correlation_id()))
        elif not device_kernels:
            continue
        elif kind in _DEVICE_WORK:
            device.append((event.linked_correlation_id(), event.correlation_id(),
                           event.duration_ns(), event.name(), kind in _DEVICE_COPIES))
        elif kind in _LAUNCH_CALLS:  # cudaLaunchKernel & co: when each kernel was issued
            launches[event.correlation_id()] = event.start_ns()
    return host, device, launches


def _host_tree(host: list[tuple], device_kernels: bool) -> tuple[list[list], dict[int, list]]:
    """The sorted host events nested by thread and time: every node, each inheriting its
    enclosing node's class and step key, and with device_kernels the node of each
    correlation id (what launched a kernel)."""
    launchers: dict[int, list] = {}
    stack: list[list] = []  # [thread, end, class, key, children's ns, own ns, is op, start]
    closed: list[list] = []
    for thread, start, minus_ns, name, is_op, correlation in host:
        while stack and (stack[-1][0] != thread or stack[-1][1] <= start):
            closed.append(stack.pop())
        parent = stack[-1] if stack else None
        cls = parent[2] if parent is not None and parent[2] else classify(name)
        key = parent[3] if parent is not None and parent[3] else _SCOPE_KEYS.get(name)
        node = [thread, start - minus_ns, cls, key, 0, -minus_ns, is_op, start]
        if parent is not None:
            parent[4] -= minus_ns
        stack.append(node)
        if device_kernels:
            launchers[correlation] = node
    closed.extend(stack)
    return closed, launchers


class _Placer:
    """The innermost host node enclosing an instant that lies in a step scope. Launch calls
    may carry another thread id than the ops (CUPTI's), so every thread is searched; only
    the engine's thread has step scopes."""

    def __init__(self, nodes: list[list]):
        by_thread: dict[int, list] = defaultdict(list)
        for node in nodes:
            by_thread[node[0]].append(node)
        self.threads = [(sorted(ns, key=lambda n: n[7])) for ns in by_thread.values()]
        self.starts = [[n[7] for n in ns] for ns in self.threads]

    def at(self, instant: int) -> list | None:
        for nodes, starts in zip(self.threads, self.starts, strict=False):
            i = bisect.bisect_right(starts, instant) - 1
            while i >= 0 and nodes[i][1] <= instant:  # nested: the first that encloses
                i -= 1                                 # the instant is the innermost
            if i >= 0 and nodes[i][3] is not None:
                return nodes[i]
        return None


def _profiler_flag_off() -> None:
    """torch marks the profiler on before starting it and off only after a clean stop: a
    failed start or stop would leave every later sample refused."""
    reset = getattr(autograd_profiler, "_set_is_profiler_enabled", None)
    try:
        if reset is not None and not torch._C._autograd._profiler_enabled():
            reset(False)
    except Exception:  # noqa: BLE001 - best effort on a private flag
        pass


# ----- the model's scopes: a flag test while no sample runs ------------------------------

_active = 0
_NULL = nullcontext()


_primed = False


def quiet_profiler() -> None:
    """Silence kineto's per-start log lines (read when a profiler first starts), unless the
    user set KINETO_LOG_LEVEL."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def prime_profiler() -> None:
    """Start and stop one empty profile on this thread.

    NOTE: kineto registers its client on the thread that imported torch and, the first
    time any profiler starts on another thread (the engine's), writes "ERROR: External
    init callback must run in same thread as registerClient" to stderr: harmless, but an
    operator reads it as a fault. Its first start done here, on the engine's caller's
    thread (~3 ms, no tensor work), later starts are quiet. Once a process: call it on
    the thread that imported torch, before the engine is built on another."""
    global _primed
    quiet_profiler()
    if _primed or autograd_profiler._is_profiler_enabled:
        return  # done, or someone's profiler runs: kineto is already initialised
    _primed = True
    try:
        with autograd_profiler.profile(use_kineto=True):
            pass
    except Exception:  # the sampler will report a profiler that cannot start
        _profiler_flag_off()


def scope(name: str):
    """A profiler scope around a block, opened only during a sample (~0.4 us when not:
    for rare paths; hot ones call `scoped`)."""
    return record_function(name) if _active else _NULL


def scoped(name: str, fn, *args):
    """fn(*args), inside a profiler scope only during a sample (~0.1 us when not)."""
    if not _active:
        return fn(*args)
    with record_function(name):
        return fn(*args)


def sampling() -> bool:
    """Whether a sample runs now: a sampled decode step runs eagerly rather than replaying
    a CUDA graph, so its kernels sit inside the model's scopes and are classed."""
    return bool(_active)


def step_scope(lane: str, phase: str):
    return record_function(STEP_SCOPES[lane, phase]) if _active else _NULL


class KernelSampler:
    """Decides which steps to sample, runs the profiler around them and returns seconds
    per (lane, phase) and class. One per engine; called from the engine's loop only:
    `begin` before a step's launches, `end` after its last batch finished."""

    BURST_SECONDS = 60.0  # the budget holds at most this much wall time's worth

    def __init__(self, every_steps: int, budget: float, device: torch.device,
                 clock=time.perf_counter):
        if every_steps < 0 or not 0 < budget <= 1:
            raise ValueError("kernel sampling needs every_steps >= 0 and 0 < budget <= 1")
        self.every_steps = every_steps
        self.budget = budget
        self.device_kernels = device.type == "cuda"
        self.clock = clock
        self._countdown = {key: every_steps for key in STEP_SCOPES}
        self._usual: dict[tuple, float] = {}  # EWMA of unsampled steps' wall time, by batches
        self._allowance = 0.0
        self._refilled = clock()
        self._keys: tuple = ()
        self._began = 0.0
        self._profile = None
        self._profiler_seconds = 0.0
        self._warned = False
        self.last_profile = None  # the last sample's profiler, for tests and debugging
        self.num_samples = 0
        self.overhead_seconds = 0.0  # what sampling cost so far, as charged to the budget
        if self.every_steps:
            quiet_profiler()

    def begin(self, keys) -> bool:
        """Before a step, with the (lane, phase) of each of its batches: whether it is
        sampled (then all its batches are), the profiler running if so."""
        self._keys = keys = tuple(keys)
        self._began = self.clock()
        if not self.every_steps:
            return False
        due = False
        for key in keys:
            self._countdown[key] -= 1
            due = due or self._countdown[key] <= 0
        if not due:
            return False
        self._allowance = min(self._allowance + (self._began - self._refilled) * self.budget,
                              self.BURST_SECONDS * self.budget)
        self._refilled = self._began
        if (self._allowance < 0 and self.budget < 1) or autograd_profiler._is_profiler_enabled:
            return False  # over budget, or someone else profiles: stays due
        for key in keys:
            self._countdown[key] = self.every_steps
        profile = autograd_profiler.profile(
            use_kineto=True, use_device="cuda" if self.device_kernels else None)
        try:
            profile.__enter__()
        except Exception as exc:  # another profiler won the race, or kineto failed
            _profiler_flag_off()
            self._allowance -= self.clock() - self._began
            if not self._warned:
                log.warning("kernel sample skipped: the profiler did not start: %s", exc)
                self._warned = True
            return False
        global _active
        _active += 1
        self._profile = profile
        self._profiler_seconds = self.clock() - self._began
        return True

    def end(self, completed=None) -> dict[tuple[str, str], dict[str, float]]:
        """After the step: {(lane, phase): {class: seconds}} when it was sampled, else {},
        for the batches in `completed` (default all: a failed batch is not a sample). A
        sample is charged its step's wall time beyond the usual for these batches, and at
        least what the profiler's start, stop and reading took."""
        global _active
        profile, self._profile = self._profile, None
        if profile is None:
            if self.every_steps:
                wall = self.clock() - self._began
                usual = self._usual.get(self._keys)
                self._usual[self._keys] = wall if usual is None else usual + (wall - usual) / 16
            return {}
        _active -= 1
        stopping = self.clock()
        try:
            profile.__exit__(None, None, None)
            found = attribute(profile.kineto_results.events(), self.device_kernels)
        except Exception:  # a profiler failure loses a sample, never a step
            _profiler_flag_off()
            log.exception("kernel sample failed")
            found = {}
        if completed is not None:
            found = {key: classes for key, classes in found.items() if key in completed}
        if self.device_kernels and not found and not self._warned:
            log.warning("a kernel sample saw no device work: is libcupti available?")
            self._warned = True
        own = self._profiler_seconds + self.clock() - stopping
        spent = max(self.clock() - self._began - self._usual.get(self._keys, 0.0), own)
        self._allowance -= spent
        self.overhead_seconds += spent
        self.num_samples += 1
        self.last_profile = profile
        return {key: {cls: ns / 1e9 for cls, ns in classes.items()}
                for key, classes in found.items()}
