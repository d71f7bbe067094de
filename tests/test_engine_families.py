"""Every engine family, by value, after an event sequence the test drives step by step.

The engine runs on the test's thread (start=False) over a pool of 8 blocks of 16 tokens,
so which blocks are cached, hit and evicted follows from the sequence alone; the expected
figures below are worked out by hand in the comments. The daemon's own reader reads the
files, as it does in production.
"""
from __future__ import annotations

import bisect

import pytest

from ac_observe import metrics as m
from ac_observe.engine.config import EngineConfig
from ac_observe.engine.llm_engine import Engine, FinishReason, QueueFullError, SamplingParams
from ac_observe.engine.skeleton import skeleton_of_text
from support.telemetry import read_as_daemon, sample_value

BLOCK = 16
LOW, THROUGHPUT = m.LANES
TAG_PROMPT = "<a><b>x</b></a>"  # 15 bytes: never fills a block; skeleton depth 3


_read, _value = read_as_daemon, sample_value


def _params(max_tokens):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _buckets(spec, values):
    """Cumulative counts per `le` of observations, as the exposition carries them."""
    counts = [0] * (len(spec.buckets) + 1)
    for value in values:
        counts[bisect.bisect_left(spec.buckets, value)] += 1
    bounds = [*spec.buckets, float("inf")]
    return {bound: sum(counts[:i + 1]) for i, bound in enumerate(bounds)}


def test_every_engine_family_by_value(tmp_path):  # noqa: C901 - one check a family
    root = tmp_path / "telemetry"
    config = EngineConfig(telemetry_dir=str(root / "e1"), engine_name="e1", model_name="m1",
                          num_kv_blocks=8, max_waiting=2, kernel_sample_steps=5,
                          kernel_sample_budget=1.0)
    outs = {}
    with Engine(config, start=False) as engine:
        # 1. A: 40 tokens on throughput. R is queued beside it, then Z finds the queue full
        #    (rejected) and R is aborted before it ever runs.
        a_prompt = list(range(1, 41))
        a = engine.add_request(a_prompt, params=_params(8))
        r = engine.add_request([1, 2, 3], params=_params(4))
        with pytest.raises(QueueFullError):
            engine.add_request([4, 5, 6], params=_params(4))
        waiting = _read(root)
        r.abort()
        engine.run_until_idle()
        outs["A"] = a.result()
        assert r.result().finish_reason is FinishReason.ABORTED
        # 2. B shares A's first 32 tokens (2 full blocks, cached when A finished).
        b = engine.add_request(a_prompt[:32] + list(range(200, 220)), params=_params(4),
                               lane=LOW)
        engine.run_until_idle()
        outs["B"] = b.result()
        # 3. D's step fails (status error); E and F, the same prompt as D, run together
        #    in one step. Their 15 tokens never fill a block: nothing is cached or hit.
        real_launch = engine.runner.launch

        def fails_once(batch):
            engine.runner.launch = real_launch
            raise RuntimeError("injected step failure")

        engine.runner.launch = fails_once
        d = engine.add_request(TAG_PROMPT, params=_params(3), lane=LOW)
        engine.run_until_idle()
        assert d.result().finish_reason is FinishReason.ERROR
        e = engine.add_request(TAG_PROMPT, params=_params(1), lane=LOW)
        f = engine.add_request(TAG_PROMPT, params=_params(1), lane=LOW)
        engine.run_until_idle()
        outs["E"], outs["F"] = e.result(), f.result()
        # 4. C: 100 new tokens need 7 of the 8 blocks. Cached now: A's 2 shared blocks and
        #    B's third (3); the other 5 hold nothing reusable and go first, so C evicts 2.
        c = engine.add_request([(7 * i) % 250 + 3 for i in range(100)], params=_params(4))
        engine.run_until_idle()
        outs["C"] = c.result()
        evictions_before_g_h = engine.block_manager.stats.evictions
        # 5. G and H (40 tokens each, 40 new tokens) outgrow the pool together: H, the later
        #    admission, is preempted once and recomputed after G finishes.
        g = engine.add_request([250] + list(range(3, 42)), params=_params(40))
        h = engine.add_request([251] + list(range(3, 42)), params=_params(40))
        engine.run_until_idle()
        outs["G"], outs["H"] = g.result(), h.result()
        lanes = {name: (t.busy_seconds, t.num_steps) for name, t in engine.stats.lanes.items()}
        final = _read(root)

    # Queue gauges moved on admission, before any step ran.
    assert _value(waiting, "ac_requests_waiting", stream=THROUGHPUT) == 2
    assert _value(waiting, "ac_requests_waiting", stream=LOW) == 0
    assert _value(waiting, "ac_requests_running", stream=THROUGHPUT) == 0

    by_lane = {THROUGHPUT: ["A", "C", "G", "H"], LOW: ["B", "E", "F"]}
    tokens = {"A": 8, "B": 4, "C": 4, "E": 1, "F": 1, "G": 40, "H": 40}
    assert evictions_before_g_h == 2
    assert outs["H"].trace.num_preemptions == 1 and outs["G"].trace.num_preemptions == 0
    assert all(outs[k].num_output_tokens == n for k, n in tokens.items())

    expected = {
        ("ac_requests_total", THROUGHPUT, "ok"): 4, ("ac_requests_total", THROUGHPUT, "aborted"): 1,
        ("ac_requests_total", THROUGHPUT, "rejected"): 1,
        ("ac_requests_total", THROUGHPUT, "error"): 0,
        ("ac_requests_total", LOW, "ok"): 3, ("ac_requests_total", LOW, "error"): 1,
        ("ac_requests_total", LOW, "aborted"): 0, ("ac_requests_total", LOW, "rejected"): 0,
    }
    for (name, lane, status), value in expected.items():
        assert _value(final, name, stream=lane, status=status) == value, (lane, status)
    # Admitted prompts: A 40, B 52, D/E/F 15 each, C 100, G/H 40 each (R never ran).
    assert _value(final, "ac_prompt_tokens_total") == 40 + 52 + 3 * 15 + 100 + 2 * 40
    assert _value(final, "ac_generation_tokens_total") == sum(tokens.values())
    # Lookups: every full block before the last token, first admissions only:
    # A (40-1)//16 = 2, B 3, D/E/F 0, C 6, G 2, H 2. Hits: B's 2 blocks from A. Token-id
    # prompts have no skeleton ("none"); D and E count under "other", F under its id (the
    # label's third sighting, below).
    skeleton_id = skeleton_of_text(TAG_PROMPT).skeleton_id
    kv = {  # skeleton: query blocks, hit blocks, query tokens, hit tokens
        m.NO_SKELETON: (2 + 3 + 6 + 2 + 2, 2, 40 + 52 + 100 + 2 * 40, 2 * BLOCK),
        m.OTHER_SKELETON: (0, 0, 2 * 15, 0),
        skeleton_id: (0, 0, 15, 0),
    }
    for skeleton, values in kv.items():
        for name, value in zip(("query_blocks", "hit_blocks", "query_tokens", "hit_tokens"),
                               values, strict=False):
            assert _value(final, f"ac_kv_cache_{name}_total", skeleton=skeleton) == value, \
                (skeleton, name)
    # Misses: A's 2 blocks cold; B's third (after 2 hits) diverged; C's 6, G's 2 and H's 2
    # cold (never seen). Nothing looked up had been evicted.
    misses = {m.MISS_COLD: 2 + 6 + 2 + 2, m.MISS_DIVERGED: 1, m.MISS_EVICTED: 0}
    for reason, count in misses.items():
        assert _value(final, "ac_kv_cache_miss_blocks_total", reason=reason) == count, reason
        assert _value(final, "ac_kv_cache_miss_tokens_total", reason=reason) == \
            count * BLOCK, reason
    # One eviction age per eviction, all measured after the blocks were released.
    assert _value(final, "ac_kv_cache_eviction_age_seconds_count") == 2 + 5 + 2 + 1 + 1
    assert _value(final, "ac_kv_cache_eviction_age_seconds_sum") > 0
    # G+H take 6 blocks: C's unfilled tail, then 5 cached (5); their 4th blocks are the
    # last 2 cached (2). At 64 tokens each needs a 5th: H (25 tokens out) is preempted,
    # freeing 4 full blocks, and G's 5th evicts one of them (1). H comes back with 65
    # tokens on its 3 surviving blocks plus 2: G's unfilled tail and one cached (1).
    assert _value(final, "ac_kv_cache_evictions_total") == 2 + 5 + 2 + 1 + 1
    assert _value(final, "ac_preemptions_total") == 1
    assert _value(final, "ac_kv_cache_blocks") == 8
    assert _value(final, "ac_kv_cache_usage_ratio") == 0
    for lane in m.LANES:
        assert _value(final, "ac_requests_running", stream=lane) == 0
        assert _value(final, "ac_requests_waiting", stream=lane) == 0

    # Histograms: counts, sums and every bucket, from the requests' own trace figures.
    for lane, names in by_lane.items():
        traces = [outs[k].trace for k in names]
        # The parts of a request's time add up, request by request: TTFT = front-end +
        # queue + prefill phase, e2e = TTFT + decode phase (daemon/alerting/explain.py
        # splits a drift's change of the mean into them).
        prefill = [(t.ttft_ns - t.frontend_ns - t.queue_ns) * 1e-9 for t in traces]
        decode = [(t.e2e_ns - t.ttft_ns) * 1e-9 for t in traces]
        assert all(p > 0 for p in prefill) and all(d >= 0 for d in decode)
        for spec, values in ((m.INFERENCE_LATENCY, [t.ttft_ns * 1e-9 for t in traces]),
                             (m.E2E_LATENCY, [t.e2e_ns * 1e-9 for t in traces]),
                             (m.REQUEST_PREFILL, prefill), (m.REQUEST_DECODE, decode)):
            assert _value(final, f"{spec.family}_count", stream=lane) == len(values)
            assert _value(final, f"{spec.family}_sum", stream=lane) == pytest.approx(
                sum(values), abs=1e-9)
            for bound, count in _buckets(spec, values).items():
                assert _value(final, f"{spec.family}_bucket", stream=lane,
                              le=_le(bound)) == count, (spec.name, lane, bound)
        # Front-end time: once per request that entered the queue (R and D included).
        frontend = len(names) + 1  # R (throughput, aborted) and D (low_latency, failed)
        assert _value(final, "ac_frontend_seconds_count", stream=lane) == frontend
        # First visible text: once per request whose text is not empty, at the time its
        # trace says.
        texts = [outs[k].trace.first_text_ns for k in names if outs[k].new_text]
        assert all(t > 0 for t in texts)
        assert _value(final, "ac_time_to_first_text_seconds_count", stream=lane) == len(texts)
        assert _value(final, "ac_time_to_first_text_seconds_sum", stream=lane) == \
            pytest.approx(sum(texts) * 1e-9, abs=1e-9)
        assert all(outs[k].trace.first_text_ns == 0 for k in names if not outs[k].new_text)
        # Queue time: once per first admission, D included (it was admitted, then failed).
        queue_count = len(names) + (lane == LOW)
        assert _value(final, "ac_queue_time_seconds_count", stream=lane) == queue_count
        itl = sum(tokens[k] - 1 for k in names)
        assert _value(final, "ac_inter_token_latency_seconds_count", stream=lane) == itl
        assert 0 < _value(final, "ac_inter_token_latency_seconds_sum", stream=lane) <= sum(
            (t.e2e_ns - t.ttft_ns) * 1e-9 for t in traces)
    # Steps. throughput: A 1 prefill + 7 decodes, C 1 + 3, G and H one prefill together,
    # then decodes until G's 40th token (39), H's recompute prefill (its 26th token) and
    # its last 14 decodes. low_latency: B 1 + 3, D's failed prefill (not timed), E+F one prefill.
    prefills = {THROUGHPUT: 1 + 1 + 1 + 1, LOW: 1 + 1}
    decodes = {THROUGHPUT: 7 + 3 + 39 + 14, LOW: 3}
    for lane in m.LANES:
        busy, num_steps = lanes[lane]
        assert _value(final, "ac_prefill_gpu_seconds_count", stream=lane) == prefills[lane]
        assert _value(final, "ac_decode_step_gpu_seconds_count", stream=lane) == decodes[lane]
        assert prefills[lane] + decodes[lane] == num_steps
        step_sum = _value(final, "ac_prefill_gpu_seconds_sum", stream=lane) + \
            _value(final, "ac_decode_step_gpu_seconds_sum", stream=lane)
        assert step_sum == pytest.approx(busy, rel=1e-9)
        assert _value(final, "ac_cuda_stream_busy_seconds_total", stream=lane) == \
            pytest.approx(busy, rel=1e-9)
        for phase, count in ((m.PHASE_PREFILL, prefills[lane]), (m.PHASE_DECODE, decodes[lane])):
            assert _value(final, "ac_engine_steps_total", stream=lane, phase=phase) == count
    # Sequences in each step, one observation a step. throughput's prefills: A, C, G+H
    # together, H's recompute; its decodes: A's 7 and C's 3 alone, G+H's 24 together (H
    # is preempted at its 25th token: its prefill's 1 + 24), then G's last 15 alone and
    # H's last 14. low_latency: B alone, E+F together (D's failed step is none); B's 3
    # decodes. Counting per sequence (87 decode observations) or prefill tokens (hundreds)
    # answers otherwise.
    batches = {(THROUGHPUT, m.PHASE_PREFILL): [1, 1, 2, 1],
               (THROUGHPUT, m.PHASE_DECODE): [1] * (7 + 3) + [2] * 24 + [1] * (15 + 14),
               (LOW, m.PHASE_PREFILL): [1, 2], (LOW, m.PHASE_DECODE): [1] * 3}
    for (lane, phase), sizes in batches.items():
        assert _value(final, "ac_engine_batch_sequences_count", stream=lane,
                      phase=phase) == len(sizes) == (prefills if phase == m.PHASE_PREFILL
                                                     else decodes)[lane], (lane, phase)
        assert _value(final, "ac_engine_batch_sequences_sum", stream=lane,
                      phase=phase) == sum(sizes), (lane, phase)
        for bound, count in _buckets(m.BATCH_SEQUENCES, sizes).items():
            assert _value(final, "ac_engine_batch_sequences_bucket", stream=lane, phase=phase,
                          le=_le(bound)) == count, (lane, phase, bound)
    # Kernel sampling every 5th step of a lane and phase (no budget limit): throughput's
    # 63 decode steps give 12 samples; its 4 prefills and low_latency's 3 prefill attempts
    # (D's failed) and 3 decodes none. Every sampled decode step ran each of these classes.
    sampled = {(THROUGHPUT, m.PHASE_DECODE): 12}
    for lane in m.LANES:
        for phase in m.PHASES:
            count = sampled.get((lane, phase), 0)
            assert _value(final, "ac_kernel_sampled_steps_total", stream=lane,
                          phase=phase) == count, (lane, phase)
    classes = ("attention", "gemm", "norm", "rope", "activation", "sampling", "other")
    for cls in classes:
        assert _value(final, "ac_kernel_seconds_count", stream=THROUGHPUT,
                      phase=m.PHASE_DECODE, **{"class": cls}) == 12, cls
    kernel_sum = sum(_value(final, "ac_kernel_seconds_sum", stream=THROUGHPUT,
                            phase=m.PHASE_DECODE, **{"class": cls}) for cls in classes)
    assert 0 < kernel_sum < _value(final, "ac_decode_step_gpu_seconds_sum", stream=THROUGHPUT)

    # Skeletons: D, E, F are one skeleton; its id earns a label at its third sighting (F).
    skeleton = skeleton_of_text(TAG_PROMPT)
    assert skeleton.depth == 3
    assert _value(final, "ac_skeleton_complexity_count") == 3
    assert _value(final, "ac_skeleton_complexity_sum") == 3 * 3
    assert _value(final, "ac_skeleton_complexity_bucket", le="2.0") == 0
    assert _value(final, "ac_skeleton_complexity_bucket", le="3.0") == 3
    assert _value(final, "ac_skeleton_requests_total", skeleton="other") == 2
    assert _value(final, "ac_skeleton_requests_total", skeleton=skeleton.skeleton_id) == 1

    # Nothing else was exported: every family above is a family of the contract.
    assert _value(final, "ac_engine_restarts_total", engine="e1") == 0
    assert _value(final, "ac_engine_up", engine="e1") == 1  # the daemon's, from the heartbeat
    exported = {name for name, _ in final} - {"ac_engine_restarts_total", "ac_engine_up"}
    contract = set()
    for spec in m.BUNDLED_ENGINE_METRICS:
        contract |= ({f"{spec.family}_{s}" for s in ("bucket", "sum", "count")}
                     if spec.type == m.HISTOGRAM else {spec.name})
    assert exported == contract


def _le(bound: float) -> str:
    from prometheus_client.utils import floatToGoString
    return floatToGoString(bound)
