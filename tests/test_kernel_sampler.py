"""Sampled kernel time: which steps run under the profiler, how each op or kernel is
classed, and that the exported seconds per class are the profiler's own figures.

On CPU the tiny model's steps are profiled for real; the CUDA path (kernels found through
the op that launched them) is checked here on events shaped like the profiler's and, for
real, by scripts/gpu_check.py.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest
import torch
from torch.autograd.profiler import profile, record_function

from ac_observe import metrics as m
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.service import Daemon
from ac_observe.engine import kernel_sampler as ks
from ac_observe.engine.config import EngineConfig
from ac_observe.engine.llm_engine import Engine, SamplingParams
from support.kernel_reference import classes_from_function_events
from support.kernel_reference import inclusive_us as _inclusive_us
from support.telemetry import family_value, read_with_multiprocess_collector

LANE = m.THROUGHPUT


def _reference(prof) -> dict:
    return classes_from_function_events(prof, device_kernels=False)


def test_the_tiny_models_steps_are_classed_from_the_profilers_own_figures(tmp_path):
    """Every step sampled: each exported class sum is the profiler's, the named classes
    hold >= 95 % of the step's op time, and the norm and attention sums are exactly the
    profiler's totals under aten::rms_norm and the model's attention scopes."""
    directory = tmp_path / "e"
    config = EngineConfig(telemetry_dir=str(directory), engine_name="e", model_name="m",
                          kernel_sample_steps=1, kernel_sample_budget=1.0)
    rng = random.Random(1)
    with Engine(config, start=False) as engine:
        for round_ in range(2):  # a warm-up round (first-run allocations), then measured
            for _ in range(6):
                engine.add_request([rng.randrange(256) for _ in range(40)],
                                   params=SamplingParams(max_tokens=3, ignore_eos=True),
                                   lane=LANE)
            if round_ == 0:
                engine.run_until_idle()
        samples_before = engine.kernel_sampler.num_samples
        checked, other_shares = [], []
        for _ in range(3):  # a prefill, then two decode steps
            before = read_with_multiprocess_collector(directory)
            engine.step()
            after = read_with_multiprocess_collector(directory)
            prof = engine.kernel_sampler.last_profile
            reference = _reference(prof)
            assert len(reference) == 1, reference
            (key, classes_us), = reference.items()
            lane, phase = key
            checked.append(phase)
            total = sum(classes_us.values())
            # >= 95 % named is judged on the median step: one op stalled by the VM's host
            # (a 4 ms index_select in a 33 ms step, 13.5 %, seen once in CI) must not decide
            # it. Every step, the prefill alone included, stays under 20 % (a phase-only op
            # the classes miss).
            other_shares.append((classes_us.get("other", 0.0) / total, classes_us))
            assert other_shares[-1][0] <= 0.20, classes_us
            assert {"gemm", "attention", "norm", "rope", "activation", "sampling"} <= \
                set(classes_us)
            assert classes_us["norm"] == pytest.approx(_inclusive_us(prof, "aten::rms_norm"),
                                                       abs=0.01)
            for cls, scope in (("attention", ks.SCOPE_ATTENTION),
                               ("activation", ks.SCOPE_ACTIVATION)):
                assert classes_us[cls] == pytest.approx(
                    _inclusive_us(prof, scope, self_too=False), abs=0.01)
            for cls in m.KERNEL_CLASSES:
                labels = {"stream": lane, "phase": phase, "class": cls}
                exported = family_value(after, "ac_kernel_seconds", "ac_kernel_seconds_sum",
                                        **labels) - \
                    family_value(before, "ac_kernel_seconds", "ac_kernel_seconds_sum", **labels)
                assert exported == pytest.approx(classes_us.get(cls, 0.0) / 1e6, abs=2e-9), cls
                count = family_value(after, "ac_kernel_seconds", "ac_kernel_seconds_count",
                                     **labels) - \
                    family_value(before, "ac_kernel_seconds", "ac_kernel_seconds_count", **labels)
                assert count == (1 if cls in classes_us else 0), cls
        assert engine.kernel_sampler.num_samples == samples_before + 3
    assert checked == [m.PHASE_PREFILL, m.PHASE_DECODE, m.PHASE_DECODE]
    share, classes_us = sorted(other_shares, key=lambda pair: pair[0])[1]
    assert share <= 0.05, classes_us


def test_the_outermost_name_decides_and_only_the_step_counts():
    a, b = torch.ones(64, 64), torch.ones(64, 64)
    ks._active += 1
    try:
        with profile(use_kineto=True) as prof:
            torch.mm(a, b)  # outside any step: not counted
            with ks.step_scope(LANE, m.PHASE_DECODE):
                torch.mm(a, b)                               # gemm
                with ks.scope(ks.SCOPE_ATTENTION):
                    torch.mm(a, b).softmax(-1)               # attention, softmax included
                with ks.scope(ks.SCOPE_ROPE):
                    a.mul(b)                                 # rope, by its scope only
                a.add(b)                                     # other
                b.argmax()                                   # sampling, by its own name
                a.to(torch.float64)                          # memcpy (a cast)
            with ks.step_scope(m.LOW_LATENCY, m.PHASE_PREFILL):
                torch.mm(a, b)
    finally:
        ks._active -= 1
    found = ks.attribute(prof.kineto_results.events(), device_kernels=False)
    assert set(found) == {(LANE, m.PHASE_DECODE), (m.LOW_LATENCY, m.PHASE_PREFILL)}
    decode = found[LANE, m.PHASE_DECODE]
    assert set(decode) == {"gemm", "attention", "rope", "other", "sampling", "memcpy"}
    assert set(found[m.LOW_LATENCY, m.PHASE_PREFILL]) == {"gemm"}
    reference = _reference(prof)
    for key, classes in found.items():
        assert classes == pytest.approx({c: us * 1e3 for c, us in reference[key].items()},
                                        abs=2)
    # The attention scope's children, softmax and the GEMM, are all attention.
    assert decode["attention"] == pytest.approx(
        _inclusive_us(prof, ks.SCOPE_ATTENTION, self_too=False) * 1e3, abs=2)


@pytest.mark.parametrize("name, cls", [
    ("ampere_sgemm_128x64_tn", "gemm"),
    ("mkldnn::_linear_pointwise", "gemm"),  # the CPU projections on packed weights
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("nvjet_tst_128x64_64x8_2x1_v_bz_coopA_TNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8::Params)", "gemm"),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float> >(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float>, float, float)", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "attention"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float, float const*, float const*, float const*, float*, float*, float*)", "norm"),
    ("void at::native::(anonymous namespace)::rms_norm_kernel<c10::BFloat16>", "norm"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(float*, float const*, int, int, int, bool const*, int, bool)", "sampling"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>", "sampling"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4> >", "sampling"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
    ("Memset (Device)", "memcpy"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>", "memcpy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)", None),
    ("aten::linear", "gemm"), ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2> >", "activation"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>", "activation"),
    ("aten::silu", "activation"), ("aten::_fused_rms_norm", "norm"), ("aten::normal_", None), ("aten::mul_", None),
    ("aten::index_copy_", None), ("aten::embedding", None),
])
def test_classes_by_name(name, cls):
    assert ks.classify(name) == cls


@dataclass
class _Event:
    """A profiler event as `_KinetoEvent` presents it (the CUDA path's shape)."""
    name_: str
    kind: str
    thread: int
    start: int
    duration: int
    correlation: int = 0
    linked: int = 0

    def name(self): return self.name_
    def activity_type(self): return self.kind
    def is_async(self): return False
    def start_thread_id(self): return self.thread
    def start_ns(self): return self.start
    def duration_ns(self): return self.duration
    def correlation_id(self): return self.correlation
    def linked_correlation_id(self): return self.linked


def test_cuda_kernels_are_found_through_the_op_that_launched_them():
    """Kernels link to the aten op they ran under (kineto's linked correlation id); a
    kernel launched with no op around it (a graph replay) links to nothing and is placed
    by its launch call's time, whose thread id is CUPTI's, not the ops'."""
    step = ks.STEP_SCOPES[LANE, m.PHASE_DECODE]
    host = [
        _Event("aten::mm", "cpu_op", 1, 0, 10, correlation=1),          # outside any step
        _Event(step, "user_annotation", 1, 100, 900, correlation=2),
        _Event("aten::linear", "cpu_op", 1, 110, 50, correlation=3),
        _Event("aten::mm", "cpu_op", 1, 115, 40, correlation=4),
        _Event(ks.SCOPE_ATTENTION, "user_annotation", 1, 200, 300, correlation=5),
        _Event("aten::bmm", "cpu_op", 1, 210, 20, correlation=6),
        _Event("aten::copy_", "cpu_op", 1, 240, 20, correlation=7),
        _Event("aten::add", "cpu_op", 1, 600, 10, correlation=8),
        _Event("aten::to", "cpu_op", 1, 700, 10, correlation=9),
        _Event("aten::mm", "cpu_op", 2, 150, 10, correlation=10),       # another thread
        _Event("cudaLaunchKernel", "cuda_runtime", 4242, 120, 5, correlation=501, linked=4),
        _Event("cudaGraphLaunch", "cuda_runtime", 4242, 650, 5, correlation=502),
        _Event("cudaLaunchKernel", "cuda_runtime", 4242, 660, 5, correlation=503),
        _Event("cudaLaunchKernel", "cuda_runtime", 4242, 5, 2, correlation=504),
    ]
    device = [
        _Event("ampere_sgemm_128x64_tn", "kernel", 7, 1000, 4000, correlation=500, linked=1),
        _Event("ampere_sgemm_128x64_tn", "kernel", 7, 5000, 3000, correlation=501, linked=4),
        _Event("ampere_sgemm_64x32_nn", "kernel", 7, 8000, 700, linked=6),   # attention
        _Event("void at::native::index_copy_kernel_impl<float>", "kernel", 7, 8800, 80,
               linked=7),                                  # a copy kernel, in attention
        _Event("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 7, 9000, 60, linked=7),
        _Event("void elementwise_kernel<add>", "kernel", 7, 9100, 90, linked=8),    # other
        _Event("Memset (Device)", "gpu_memset", 7, 9200, 11, linked=9),
        _Event("flash_fwd_kernel", "kernel", 7, 9300, 500, correlation=502),  # graph replay
        _Event("mystery_kernel", "kernel", 7, 9900, 33, correlation=503),     # by nothing
        _Event("ampere_sgemm_128x64_tn", "kernel", 7, 9940, 44, correlation=504),  # no step
        _Event("ampere_sgemm_128x64_tn", "kernel", 8, 9950, 999, linked=10),  # no step
        _Event(step, "gpu_user_annotation", 7, 1000, 9000, linked=2),   # a span, not work
    ]
    found = ks.attribute(host + device, device_kernels=True)
    assert found == {(LANE, m.PHASE_DECODE): {
        "gemm": 3000, "attention": 700 + 80 + 500, "memcpy": 60 + 11, "other": 90 + 33}}
    # On CPU the same host events count their self time instead.
    cpu = ks.attribute(host, device_kernels=False)
    assert cpu == {(LANE, m.PHASE_DECODE): {
        "gemm": 50, "attention": 20 + 20, "other": 10, "memcpy": 10}}


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_every_nth_step_of_each_lane_and_phase_within_the_budget():
    clock = _Clock()
    sampler = ks.KernelSampler(3, 0.01, torch.device("cpu"), clock=clock)
    decode, prefill = (LANE, m.PHASE_DECODE), (LANE, m.PHASE_PREFILL)

    def step(keys, seconds, idle=0.0):
        sampled = sampler.begin(keys)
        clock.now += seconds
        sampler.end()
        clock.now += idle
        return sampled

    # Each key counts its own steps: the 3rd decode and the 3rd prefill are sampled, and
    # sampling one does not restart the other's count.
    assert [step(keys, 0.01) for keys in ([decode], [prefill], [decode], [decode])] == \
        [False, False, False, True]
    assert step([prefill], 0.01) is False
    # The sampled decode step took as long as usual: it costs nothing beyond the
    # profiler's own time; this 3rd prefill step takes 0.51 s where 0.01 is usual: it is
    # charged 0.5 s, which the 1 % budget earns back in 50 s.
    charged = sampler.overhead_seconds
    assert charged < 0.005
    sampled = sampler.begin([prefill])
    clock.now += 0.51
    sampler.end()
    assert sampled and sampler.overhead_seconds - charged == pytest.approx(0.5, abs=0.005)
    # Due again after 3 more decode steps 10 s apart, but over budget (-0.4995 + 0.2051):
    # skipped, and it stays due until the budget has refilled, 3 steps (0.3 s) later;
    # then every 3rd step again.
    assert [step([decode], 0.01, idle=10.0) for _ in range(9)] == \
        [False, False, False, False, False, True, False, False, True]
    # After an idle hour the budget holds a minute's worth (0.6 s), not 36 s: two 0.5 s
    # samples in a row are not both allowed.
    clock.now += 3600
    costly = []
    for _ in range(3):
        for _ in range(2):
            step([decode], 0.01)
        sampled = sampler.begin([decode])
        clock.now += 0.51
        sampler.end()
        costly.append(sampled)
    assert costly == [True, True, False]


def test_off_never_profiles_and_someone_elses_profiler_is_left_alone():
    off = ks.KernelSampler(0, 0.005, torch.device("cpu"))
    assert not any(off.begin([(LANE, m.PHASE_DECODE)]) for _ in range(5))
    on = ks.KernelSampler(1, 1.0, torch.device("cpu"))
    with profile(use_kineto=True):
        assert not on.begin([(LANE, m.PHASE_DECODE)])
        assert on.end() == {}
    assert on.begin([(LANE, m.PHASE_DECODE)])  # still due: sampled once the user's ended
    with record_function("ac::step/throughput/decode"):
        torch.ones(3).add(1)
    assert on.end()[LANE, m.PHASE_DECODE]["other"] > 0


def test_sampled_fraction_and_kernel_time_through_the_daemon(tmp_path):
    root = tmp_path / "telemetry"
    config = EngineConfig(telemetry_dir=str(root / "e1"), engine_name="e1", model_name="m1",
                          kernel_sample_steps=4, kernel_sample_budget=1.0)
    daemon = Daemon(DaemonConfig(telemetry_root=root, window_seconds=600,
                                 collectors=("engine",)))
    t0 = time.time()
    with Engine(config, start=False) as engine:
        daemon.run_cycle(now=t0)
        # One request alone in the throughput lane: 1 prefill step, then 23 decode steps.
        engine.add_request([1] * 20, params=SamplingParams(max_tokens=24, ignore_eos=True),
                           lane=LANE)
        engine.run_until_idle()
        daemon.run_cycle(now=t0 + 30)
    decode = {"stream": LANE, "phase": m.PHASE_DECODE}
    answer = daemon.query("kernel_sampled_fraction", 600, {"phase": m.PHASE_DECODE},
                          now=t0 + 30)["series"]
    # Decode steps 4, 8, ..., 20 of 23 were sampled: 5/23, not the 1/4 a rate would say.
    assert [(s["labels"]["stream"], s["mean"]) for s in answer] == \
        [(LANE, pytest.approx(100 * 5 / 23))]
    overall = daemon.query("kernel_sampled_fraction", 600, {}, now=t0 + 30)["series"]
    assert [s["mean"] for s in overall] == [pytest.approx(100 * 5 / 24)]
    times = daemon.query("kernel_time_ms", 600, {**decode, "class": "gemm"}, now=t0 + 30)
    assert [s["samples"] for s in times["series"]] == [5]
    assert 0 < times["series"][0]["p50"] < 1e4


_SERVER_LOAD = """
import asyncio
from ac_observe.engine.config import EngineConfig
from ac_observe.engine.llm_engine import SamplingParams
from ac_observe.engine.server import EngineService

service = EngineService(EngineConfig(kernel_sample_steps=1, kernel_sample_budget=1.0))
asyncio.run(service.load())  # as the server loads it: on a worker thread
engine = service.ready()
engine.generate([5, 6, 7], params=SamplingParams(max_tokens=3, ignore_eos=True))
service.close()  # joins the engine's thread: the last step's sample is in (the output it
print("samples", engine.kernel_sampler.num_samples)  # delivered came before it was)
"""


@pytest.mark.slow
def test_the_engine_servers_kernel_samples_write_nothing_to_stderr():
    """The server builds its engine on a worker thread and samples on the engine's own;
    kineto, whose client was registered on the thread that imported torch, would write
    "ERROR: External init callback must run in same thread as registerClient" to stderr
    at the first sample (an operator reads it as a fault), and its per-start log lines
    after. Neither appears, and the samples are taken."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", _SERVER_LOAD], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) >= 3  # a prefill and two decode steps
    assert "External init callback" not in done.stderr, done.stderr
    assert "profiler_start" not in done.stderr, done.stderr
