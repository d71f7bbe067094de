"""Timing invariants and the telemetry files a separate daemon process reads."""
from __future__ import annotations

import json
import random

from ac_observe.engine.config import EngineConfig
from ac_observe.engine.llm_engine import Engine, QueueFullError, SamplingParams
from ac_observe.metrics import BUNDLED_ENGINE_METRICS, COUNTER
from support.telemetry import family_value as _value
from support.telemetry import read_with_multiprocess_collector as _read_in_other_process


def _workload(engine, n=24, seed=0):
    rng = random.Random(seed)
    system = "<system>You are terse.</system>\n" * 20
    handles = []
    for i in range(n):
        lane = "low_latency" if i % 3 == 0 else "throughput"
        messages = [{"role": "user", "content": f"# Q{i}\n- item\n```json\n{{\"a\": [{i}]}}\n```"}]
        handles.append(engine.add_request(
            messages=messages, system=system if rng.random() < 0.7 else None, lane=lane,
            params=SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True)))
    return [h.result() for h in handles]


def test_timing_invariants_hold_on_every_request_and_lane(tmp_path):
    with Engine(EngineConfig(telemetry_dir=str(tmp_path))) as engine:
        outs = _workload(engine)
        lanes = dict(engine.stats.lanes)
    for out in outs:
        t = out.trace
        assert 0 <= t.queue_ns <= t.ttft_ns <= t.e2e_ns
        assert (t.prefill_ms + t.decode_ms) * 1e6 <= t.e2e_ns
        assert t.prefill_ms > 0
    assert set(lanes) == {"low_latency", "throughput"}
    for totals in lanes.values():
        elapsed = (totals.last_step_end_ns - totals.first_step_start_ns) / 1e9
        assert 0 < totals.busy_seconds <= elapsed


def test_telemetry_files_hold_every_engine_metric_with_type_and_labels(tmp_path):
    # Kernel sampling every 2nd step, unlimited: its families appear with the first sample.
    with Engine(EngineConfig(telemetry_dir=str(tmp_path), engine_name="e1",
                             model_name="tiny-test", max_waiting=40, kernel_sample_steps=2,
                             kernel_sample_budget=1.0)) as engine:
        outs = _workload(engine)
        rejected = 0
        # Overflow the queue while the engine is busy: its steps are held for 0.5 s, so
        # the queue fills however many it admitted first.
        engine.step_delay_seconds = 0.5
        for _ in range(400):
            try:
                engine.add_request([1] * 50, params=SamplingParams(max_tokens=64))
            except QueueFullError:
                rejected += 1
                if rejected == 5:
                    break
        engine.close()
        stats = engine.block_manager.stats
        info = json.loads((tmp_path / "engine.json").read_text())
    assert info["engine"] == "e1" and info["model"] == "tiny-test"
    assert {"pid", "api_address", "started_at", "engine_id"} <= set(info)
    families = _read_in_other_process(tmp_path)
    for spec in BUNDLED_ENGINE_METRICS:
        family = spec.name[:-6] if spec.type == COUNTER else spec.name
        assert family in families, spec.name
        fam = families[family]
        assert fam["type"] == spec.type, spec.name
        for name, labels, _ in fam["samples"]:
            expected = set(spec.labels) | ({"le"} if name.endswith("_bucket") else set())
            assert set(labels) == expected, (spec.name, labels)
            assert labels["engine"] == "e1" and labels["model"] == "tiny-test"
    ok = _value(families, "ac_requests", "ac_requests_total", status="ok")
    assert ok >= len(outs)
    assert _value(families, "ac_requests", "ac_requests_total", status="rejected") == rejected > 0
    ttft_count = _value(families, "ac_inference_latency_seconds",
                        "ac_inference_latency_seconds_count")
    assert ttft_count >= len(outs)
    assert _value(families, "ac_kv_cache_hit_blocks", "ac_kv_cache_hit_blocks_total") == \
        stats.hit_blocks > 0
    assert _value(families, "ac_kv_cache_query_tokens", "ac_kv_cache_query_tokens_total") == \
        stats.query_tokens
    depth_count = _value(families, "ac_skeleton_complexity", "ac_skeleton_complexity_count")
    assert depth_count == len(outs)
    skeleton_labels = {lab["skeleton"] for name, lab, _ in
                       families["ac_skeleton_requests"]["samples"]}
    assert "other" in skeleton_labels and len(skeleton_labels) <= 21


def test_trace_ttft_lands_in_the_latency_histogram(tmp_path):
    with Engine(EngineConfig(telemetry_dir=str(tmp_path))) as engine:
        out = engine.generate("hello", params=SamplingParams(max_tokens=3), lane="low_latency")
    families = _read_in_other_process(tmp_path)
    ttft = out.trace.ttft_ns / 1e9
    total = _value(families, "ac_inference_latency_seconds",
                   "ac_inference_latency_seconds_sum", stream="low_latency")
    assert abs(total - ttft) < 1e-6


def test_restarted_engine_counters_stay_monotonic(tmp_path):
    for _ in range(2):
        with Engine(EngineConfig(telemetry_dir=str(tmp_path))) as engine:
            engine.generate("hi", params=SamplingParams(max_tokens=2, ignore_eos=True))
    families = _read_in_other_process(tmp_path)
    assert _value(families, "ac_requests", "ac_requests_total", status="ok") == 2
    assert _value(families, "ac_generation_tokens", "ac_generation_tokens_total") == 4


def test_without_instrumentation_the_engine_answers_the_same_and_records_nothing(
        tmp_path, monkeypatch):
    """The baseline of the overhead benchmark: the same tokens, and nothing observed (no
    telemetry files, statistics, kernel samples or skeletons)."""
    import pytest

    from ac_observe.engine import llm_engine
    from ac_observe.engine.stats import EngineStats, NullStats
    parsed, real = [], llm_engine.skeleton_of_request
    monkeypatch.setattr(llm_engine, "skeleton_of_request",
                        lambda *a: parsed.append(a) or real(*a))
    outputs = {}
    for on in (True, False):
        directory = tmp_path / f"on-{on}"
        config = EngineConfig(telemetry_dir=str(directory) if on else None,
                              instrumentation=on, kernel_sample_steps=1,
                              kernel_sample_budget=1.0)
        with Engine(config) as engine:
            outputs[on] = [o.new_token_ids for o in _workload(engine, n=8)]
            stats, lanes, sampler = engine.stats, dict(engine.stats.lanes), engine.kernel_sampler
            seqs_parsed = len(parsed)
            parsed.clear()
        if on:
            assert lanes and seqs_parsed == 8 and directory.is_dir()
        else:
            assert isinstance(stats, NullStats) and lanes == {} and seqs_parsed == 0
            assert sampler.every_steps == 0
            assert not directory.exists()
    assert outputs[True] == outputs[False] and all(outputs[True])
    # Every event hook is dropped, including any added to EngineStats later.
    hooks = {name for name in vars(EngineStats) if name.startswith("on_")}
    assert hooks and all(getattr(NullStats, name) is not getattr(EngineStats, name)
                         for name in hooks)
    # Nothing accumulates: a small pool evicts, and no eviction age is kept for anyone.
    with Engine(EngineConfig(instrumentation=False, num_kv_blocks=64)) as engine:
        _workload(engine, n=24)
        assert engine.block_manager.stats.evictions > 0
        assert engine.block_manager.eviction_ages == []
    with pytest.raises(ValueError, match="writes no telemetry"):
        EngineConfig(telemetry_dir=str(tmp_path), instrumentation=False)


def test_an_engine_without_telemetry_keeps_no_event_loop_figures():
    """Instrumented but with no telemetry directory (the Python API's default): the event
    loop's figures (its lag 10 times a second, each stream's first bytes) are dropped at
    each flush, not kept for a writer that never comes."""
    with Engine(EngineConfig()) as engine:
        for _ in range(1000):
            engine.stats.on_loop_lag(0.001)
            engine.stats.on_first_sent("default", 0.01, 0.001)
        engine.generate("hi", params=SamplingParams(max_tokens=2, ignore_eos=True))
        with engine._lock:
            engine.stats.flush()
            assert len(engine.stats._from_loop) == 0


def test_the_engine_command_refuses_telemetry_without_instrumentation(tmp_path):
    from support.servers import run_cli
    out = run_cli("engine", "--no-instrumentation", "--telemetry-dir", str(tmp_path / "t"))
    assert out.returncode == 2
    assert "an engine without instrumentation writes no telemetry" in out.stderr
    assert not (tmp_path / "t").exists()


def test_an_idle_engine_has_written_every_figure_of_its_steps(tmp_path):
    """Steps hand their figures to the files in batches (at most every 50 ms); an engine
    that goes idle writes what is left, so a daemon reading a quiet engine misses nothing."""
    import time
    with Engine(EngineConfig(telemetry_dir=str(tmp_path), engine_name="e1")) as engine:
        out = engine.generate("hello", params=SamplingParams(max_tokens=5, ignore_eos=True),
                              lane="low_latency")
        assert out.num_output_tokens == 5
        deadline = time.monotonic() + 5
        while True:
            families = _read_in_other_process(tmp_path)
            tokens = _value(families, "ac_generation_tokens", "ac_generation_tokens_total")
            if tokens == 5 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert tokens == 5
        assert _value(families, "ac_inter_token_latency_seconds",
                      "ac_inter_token_latency_seconds_count", stream="low_latency") == 4
        assert _value(families, "ac_engine_steps", "ac_engine_steps_total",
                      stream="low_latency", phase="decode") == 4


def test_a_decode_step_that_takes_a_block_moves_the_usage_gauge_and_close_writes_it_all(
        tmp_path, monkeypatch):
    """KV usage moves in a decode step that admits and finishes nothing (a new block), and
    that step's figures reach the files at the next flush; close writes the rest."""
    with Engine(EngineConfig(telemetry_dir=str(tmp_path), engine_name="e1", num_kv_blocks=8,
                             block_size=16), start=False) as engine:
        engine.add_request(list(range(1, 16)), params=SamplingParams(max_tokens=8,
                                                                      ignore_eos=True))
        usages = []
        for _ in range(4):  # prefill (15 tokens: one block), then decode into a second
            engine.step()
            usages.append(engine.block_manager.usage)
        assert usages[0] < usages[-1]  # no admission or finish in between
        with engine._lock:
            engine.stats.flush()
        families = _read_in_other_process(tmp_path)
        assert _value(families, "ac_kv_cache_usage_ratio", "ac_kv_cache_usage_ratio") == \
            usages[-1]
        monkeypatch.setattr("ac_observe.engine.stats.FLUSH_SECONDS", 3600.0)
        engine.step()  # no flush due after it: its figures wait in memory
        assert _value(_read_in_other_process(tmp_path), "ac_generation_tokens",
                      "ac_generation_tokens_total") == 4
        engine.close()
    families = _read_in_other_process(tmp_path)
    assert _value(families, "ac_engine_steps", "ac_engine_steps_total", phase="decode") == 4
    assert _value(families, "ac_generation_tokens", "ac_generation_tokens_total") == 5


def test_the_start_time_is_taken_after_the_series_are_declared(tmp_path, monkeypatch):
    """engine.json's started_at comes after the writer declared every series and just
    before it writes that file: a daemon look that found no engine.json was earlier than
    the start it then reads (collectors/engine/collector.py tells a born engine by it)."""
    import time

    from ac_observe.engine.telemetry import TelemetryWriter
    declared = []
    declare = TelemetryWriter._declare_series

    def timed(self):
        declare(self)
        time.sleep(0.05)  # a slow disk
        declared.append(time.time())
    monkeypatch.setattr(TelemetryWriter, "_declare_series", timed)
    with Engine(EngineConfig(telemetry_dir=str(tmp_path / "e1"), engine_name="e1")):
        info = json.loads((tmp_path / "e1" / "engine.json").read_text())
    assert declared and info["started_at"] >= declared[0]
