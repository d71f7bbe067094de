"""Paged KV behaviour a user depends on: exact hit accounting, no leaks, bounded queue."""
from __future__ import annotations

import random

import pytest

from ac_observe.engine.config import EngineConfig
from ac_observe.engine.llm_engine import Engine, FinishReason, QueueFullError, SamplingParams
from ac_observe.engine.scheduler import NeverFitsError

BLOCK = 16


def _tiny(**kw) -> Engine:
    return Engine(EngineConfig(**kw), start=False)


def _run(engine, prompts, max_tokens=4, lane="throughput"):
    handles = [engine.add_request(p, params=SamplingParams(max_tokens=max_tokens,
                                                           ignore_eos=True), lane=lane)
               for p in prompts]
    engine.run_until_idle()
    return [h.result() for h in handles]


def test_shared_system_prompt_hit_rate_is_exact():
    rng = random.Random(0)
    system = [rng.randrange(0, 256) for _ in range(256)]
    suffix_lens = [rng.randint(1, 70) for _ in range(12)]
    # Every suffix starts with a distinct token, so nothing past the system prompt is shared.
    prompts = [system + [i] + [rng.randrange(0, 256) for _ in range(n - 1)]
               for i, n in enumerate(suffix_lens)]
    with _tiny() as engine:
        first = _run(engine, prompts[:1])
        rest = _run(engine, prompts[1:])
        stats = engine.block_manager.stats
    query_blocks = sum((len(p) - 1) // BLOCK for p in prompts)
    hit_blocks = 16 * (len(prompts) - 1)  # the first request finds nothing
    assert (stats.query_blocks, stats.hit_blocks) == (query_blocks, hit_blocks)
    assert stats.query_tokens == sum(len(p) for p in prompts)
    assert stats.hit_tokens == hit_blocks * BLOCK
    assert first[0].trace.kv_hit_blocks == 0
    assert all(out.trace.kv_hit_blocks == 16 for out in rest)
    assert all(out.num_cached_tokens == 256 for out in rest)


def test_last_prompt_token_is_never_a_hit():
    prompt = list(range(2 * BLOCK))  # exactly two full blocks
    with _tiny() as engine:
        _run(engine, [prompt])
        again = _run(engine, [prompt])[0]
    # Only the first block can hit: the second holds the last token, whose logits are needed.
    assert (again.trace.kv_query_blocks, again.trace.kv_hit_blocks) == (1, 1)


def test_no_shared_prefix_means_zero_hits():
    rng = random.Random(1)
    prompts = [[i] + [rng.randrange(0, 256) for _ in range(rng.randint(20, 120))]
               for i in range(20)]
    with _tiny() as engine:
        _run(engine, prompts)
        stats = engine.block_manager.stats
    assert stats.hit_blocks == 0 and stats.hit_tokens == 0
    assert stats.query_blocks == sum((len(p) - 1) // BLOCK for p in prompts)


@pytest.mark.slow
def test_preemption_recompute_adds_no_hits():
    rng = random.Random(2)
    prompts = [[i] + [rng.randrange(0, 256) for _ in range(60)] for i in range(8)]
    with _tiny(num_kv_blocks=24) as engine:
        _run(engine, prompts, max_tokens=60)
        stats = engine.block_manager.stats
        assert engine.scheduler.num_preemptions > 0
    assert stats.recompute_tokens > 0
    assert stats.hit_blocks == 0
    assert stats.query_blocks == sum((len(p) - 1) // BLOCK for p in prompts)


def test_evicted_prefix_is_no_longer_a_hit():
    with _tiny(num_kv_blocks=8) as engine:
        a = list(range(100, 100 + 3 * BLOCK + 1))
        _run(engine, [a], max_tokens=1)
        # Other content takes 7 of 8 blocks: a's tail blocks go first, its head survives.
        _run(engine, [[7] * (7 * BLOCK)], max_tokens=1)
        assert engine.block_manager.stats.evictions == 2
        assert _run(engine, [a], max_tokens=1)[0].trace.kv_hit_blocks == 1
        # Content needing the whole pool evicts the rest of a.
        _run(engine, [[9] * (8 * BLOCK - 1)], max_tokens=1)
        again = _run(engine, [a], max_tokens=1)[0]
    assert again.trace.kv_hit_blocks == 0


@pytest.mark.slow
def test_random_aborts_leave_every_block_free():
    rng = random.Random(3)
    with _tiny(num_kv_blocks=64, max_waiting=256) as engine:
        handles = []
        for i in range(200):
            prompt = [rng.randrange(0, 256) for _ in range(rng.randint(1, 100))]
            if rng.random() < 0.3:  # some share a prefix, so aborted blocks are shared too
                prompt = [1] * 40 + prompt
            lane = "low_latency" if i % 5 == 0 else "throughput"
            handles.append(engine.add_request(
                prompt, params=SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True),
                lane=lane))
            if i % 3 == 0:
                engine.step()
                engine.check_invariants()
            if rng.random() < 0.35:
                rng.choice(handles).abort()
        while engine.step():
            engine.check_invariants()
            if rng.random() < 0.1 and engine.num_unfinished:
                rng.choice(handles).abort()
        engine.check_invariants()
        assert engine.num_unfinished == 0
        assert engine.block_manager.num_free_blocks == 64
        reasons = [h.result().finish_reason.value for h in handles]
    assert "aborted" in reasons and "length" in reasons


def test_double_free_is_refused():
    with _tiny() as engine:
        from ac_observe.engine.sequence import Sequence
        seq = Sequence("x", list(range(40)), SamplingParams())
        assert engine.block_manager.try_allocate(seq)
        table = list(seq.block_table)
        engine.block_manager.free(seq)
        seq.block_table = table
        with pytest.raises(RuntimeError, match="double free"):
            engine.block_manager.free(seq)


def test_full_waiting_queue_rejects_instead_of_dropping():
    with _tiny(max_waiting=3) as engine:
        for _ in range(3):
            engine.add_request([1, 2, 3], params=SamplingParams(max_tokens=2))
        with pytest.raises(QueueFullError):
            engine.add_request([1, 2, 3])
        assert engine.num_unfinished == 3
        engine.run_until_idle()
        engine.add_request([1, 2, 3])  # room again once the queue drains


def test_request_larger_than_the_pool_is_refused():
    with _tiny(num_kv_blocks=4) as engine:
        with pytest.raises(NeverFitsError):
            engine.add_request(list(range(100)), params=SamplingParams(max_tokens=1))


def test_prompt_longer_than_context_is_refused():
    with _tiny(max_model_len=64) as engine:
        with pytest.raises(ValueError, match="context"):
            engine.add_request([1] * 64)


def test_low_latency_lane_is_served_first_without_starving_throughput():
    with _tiny(throughput_share=4) as engine:
        bulk = [engine.add_request([5] * 30, params=SamplingParams(max_tokens=30,
                                                                  ignore_eos=True))
                for _ in range(4)]
        urgent = engine.add_request([6] * 30, params=SamplingParams(max_tokens=10,
                                                                   ignore_eos=True),
                                    lane="low_latency")
        engine.run_until_idle()
        urgent_out = urgent.result()
        bulk_out = [h.result() for h in bulk]
    assert urgent_out.trace.e2e_ns < min(out.trace.e2e_ns for out in bulk_out)
    assert urgent_out.trace.queue_ns <= min(out.trace.queue_ns for out in bulk_out) + 10**9
    assert engine.stats.lanes["throughput"].num_steps > 0


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=3, temperature=1e-300),
    SamplingParams(max_tokens=3, temperature=1.0, top_p=5e-324),
    SamplingParams(max_tokens=3, temperature=2.0, top_k=1, top_p=1e-9, seed=3),
    SamplingParams(max_tokens=3, temperature=1e30),
])
def test_extreme_sampling_settings_never_fail_a_batch(params):
    with _tiny() as engine:
        neighbour = engine.add_request([1, 2, 3], params=SamplingParams(max_tokens=3,
                                                                        ignore_eos=True))
        odd = engine.add_request([4, 5, 6], params=params)
        engine.run_until_idle()
        assert neighbour.result().finish_reason.value == "length"
        assert odd.result().finish_reason.value in ("length", "stop")


def test_seeded_sampling_is_reproducible():
    with _tiny() as engine:
        runs = []
        for _ in range(2):
            handle = engine.add_request([9, 8, 7], params=SamplingParams(
                max_tokens=12, temperature=1.0, seed=42, ignore_eos=True))
            engine.run_until_idle()
            runs.append(handle.result().new_token_ids)
    assert runs[0] == runs[1]


def test_step_failing_mid_forward_fails_only_its_batch():
    """A decode step that dies halfway through the layers (the CPU decode workspace then
    holds half a step) fails its requests, frees their blocks, and leaves nothing behind:
    the same prompts afterwards generate exactly what a fresh engine generates."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(20, 60))] for _ in range(4)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def generate(engine):
        handles = [engine.add_request(p, params=params) for p in prompts]
        engine.run_until_idle()
        return [h.result() for h in handles]

    with Engine(EngineConfig(), start=False) as fresh:
        expected = [out.new_token_ids for out in generate(fresh)]
    with Engine(EngineConfig(), start=False) as engine:
        layer = engine.runner.model.model.layers[2]
        real_forward, calls = layer.forward, []

        def dies_on_the_fourth_decode_step(*args):
            calls.append(1)
            if len(calls) == 5:  # call 1 is the prefill
                raise RuntimeError("injected failure")
            return real_forward(*args)

        layer.forward = dies_on_the_fourth_decode_step
        failed = generate(engine)
        assert all(out.finish_reason is FinishReason.ERROR for out in failed)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert [out.new_token_ids for out in generate(engine)] == expected


def test_a_colliding_hash_never_shares_kv_across_different_prefixes(monkeypatch):
    """With every block hashing alike, a block whose tokens match but whose prefix does not
    (here: a prompt's second block equals another's first) must not be served from the
    cache: outputs equal an engine's with prefix caching off."""
    from ac_observe.engine import block_manager

    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: b"weak")
    rng = random.Random(5)
    head = [rng.randrange(3, 256) for _ in range(BLOCK)]
    prompts = [head + [rng.randrange(3, 256) for _ in range(20)],
               head + head + [rng.randrange(3, 256) for _ in range(20)],   # 2nd block = 1st
               head * 3 + [9],
               [rng.randrange(3, 256) for _ in range(BLOCK)] + head + [4, 5]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def outputs(**config):
        with Engine(EngineConfig(dtype="float64", **config), start=False) as engine:
            results = []
            for prompt in prompts:  # one by one: each finds what the earlier ones cached
                handle = engine.add_request(prompt, params=params)
                engine.run_until_idle()
                results.append(handle.result())
            return results, engine.block_manager.stats

    cached, stats = outputs()
    plain, plain_stats = outputs(enable_prefix_caching=False)
    assert [o.new_token_ids for o in cached] == [o.new_token_ids for o in plain]
    assert stats.hit_blocks == 2  # only the true repeats of `head` as a first block
    assert plain_stats.hit_blocks == 0


def _one_block_each(num_blocks: int):
    """A scheduler over `num_blocks` blocks holding one low_latency and two throughput
    requests, each prefilled into one block and now needing a second one."""
    from ac_observe.engine.block_manager import BlockManager
    from ac_observe.engine.scheduler import Scheduler
    from ac_observe.engine.sequence import Sequence

    scheduler = Scheduler(EngineConfig(), BlockManager(num_blocks, BLOCK), max_model_len=1024)
    low = Sequence("low", list(range(3, 3 + BLOCK)), SamplingParams(max_tokens=8),
                   lane="low_latency")
    bulk = [Sequence(f"t{i}", list(range(40 + i, 40 + i + BLOCK)),
                     SamplingParams(max_tokens=8)) for i in range(2)]
    for seq in [low, *bulk]:
        scheduler.add(seq)
        batch = scheduler._schedule_prefill(scheduler.lanes[seq.lane])
        for prefilled in batch.seqs:
            prefilled.num_computed_tokens = len(prefilled)
            prefilled.token_ids.append(5)
    return scheduler, low, bulk


def test_overlapping_lanes_never_preempt_a_sequence_already_in_the_round():
    """With both lanes scheduled in one round, the throughput lane's need for a block
    preempts its own newest request, never the low_latency one already batched."""
    from ac_observe.engine.sequence import SequenceStatus

    scheduler, low, bulk = _one_block_each(num_blocks=4)  # 3 want a block, 1 is free
    batches = scheduler.schedule_lanes()
    batched = [seq for batch in batches for seq in batch.seqs]
    assert low in batched and low.status is SequenceStatus.RUNNING
    for seq in batched:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * BLOCK >= len(seq)
    assert scheduler.num_preemptions == 1 and bulk[1].status is SequenceStatus.WAITING


def test_throughput_never_preempts_low_latency_and_low_latency_preempts_throughput_first():
    from ac_observe.engine.sequence import SequenceStatus

    scheduler, low, bulk = _one_block_each(num_blocks=3)  # 3 want a block, none is free
    throughput = scheduler._schedule_decode(scheduler.lanes["throughput"])
    assert low.status is SequenceStatus.RUNNING  # not the victim of throughput's need
    assert throughput.seqs == [bulk[0]] and bulk[1].status is SequenceStatus.WAITING
    urgent = scheduler._schedule_decode(scheduler.lanes["low_latency"])
    assert urgent.seqs == [low] and bulk[0].status is SequenceStatus.WAITING


def _timeshare_scheduler():
    """A scheduler with room for everything, and `steps(n)`: n scheduled steps run as the
    engine runs them (one more token each), low_latency's taking 1 ms, throughput's 8."""
    from ac_observe.engine.block_manager import BlockManager
    from ac_observe.engine.scheduler import Scheduler
    from ac_observe.engine.sequence import Sequence

    scheduler = Scheduler(EngineConfig(throughput_share=4), BlockManager(4096, BLOCK),
                          max_model_len=4096)
    cost = {"low_latency": 0.001, "throughput": 0.008}

    def add(name, lane):
        scheduler.add(Sequence(name, list(range(1, 1 + BLOCK)),
                               SamplingParams(max_tokens=1000), lane=lane))

    def steps(n):
        lanes = []
        for _ in range(n):
            batch = scheduler.schedule()
            for seq in batch.seqs:
                seq.num_computed_tokens = len(seq)
                seq.token_ids.append(5)
            scheduler.step_done(batch.lane, cost[batch.lane])
            lanes.append(batch.lane)
        return lanes
    return scheduler, cost, add, steps


def test_throughput_gets_its_share_of_the_engines_time_not_of_its_steps():
    """While both lanes have work, throughput gets 1/throughput_share of the time: with
    its steps 8x as long as low_latency's, one step in four would hand it 73 % of the
    engine. A lane alone takes every step and earns nothing by it: when low_latency comes
    back it is served at once. A debt throughput ran up stands across a pause of
    low_latency's (no more than its share by contending in bursts), not once throughput's
    own work is done."""
    from ac_observe.engine.sequence import FinishReason

    scheduler, cost, add, steps = _timeshare_scheduler()
    add("t0", "throughput")
    assert set(steps(20)) == {"throughput"}  # alone: every step
    add("l0", "low_latency")
    assert steps(2) == ["low_latency", "throughput"]  # nothing owed from running alone
    lanes = steps(400)
    time = {lane: lanes.count(lane) * cost[lane] for lane in cost}
    assert 0.22 < time["throughput"] / sum(time.values()) < 0.28
    while lanes[-1] != "throughput":  # end the contention in debt: it just ran 8 ms
        lanes += steps(1)
    (low,) = scheduler.lanes["low_latency"].running
    scheduler.finish(low, FinishReason.LENGTH)
    assert set(steps(5)) == {"throughput"}
    add("l1", "low_latency")
    back = steps(40)
    turn = back.index("throughput")
    # The 8 ms it owes is earned back at 1/3 ms a low_latency step: 23-24 steps first.
    assert back[:turn] == ["low_latency"] * turn and 22 <= turn <= 25
    # Once throughput's own work is done it owes nothing: a new request of its, after
    # it ran up a debt, gets its turn after one low_latency step.
    while back[-1] != "throughput":
        back += steps(1)
    for seq in list(scheduler.lanes["throughput"].running):
        scheduler.finish(seq, FinishReason.LENGTH)
    assert set(steps(3)) == {"low_latency"}
    add("t1", "throughput")
    assert steps(2) == ["low_latency", "throughput"]


def test_a_lane_that_cannot_run_earns_no_turns_to_spend_later():
    """Throughput with work it cannot start (its request waits for KV blocks) is passed
    over without earning credit: once it can run it takes one turn, not the dozens a
    credit run up while it waited would buy (low_latency would wait behind them)."""
    scheduler, cost, add, steps = _timeshare_scheduler()
    pool = scheduler.block_manager
    real, blocked = pool.try_allocate, [True]
    pool.try_allocate = lambda seq, caching: (not (blocked[0] and seq.lane == "throughput")
                                              and real(seq, caching))
    add("l0", "low_latency")
    add("t0", "throughput")
    assert set(steps(100)) == {"low_latency"}
    blocked[0] = False
    lanes = steps(40)
    runs = "".join("T" if lane == "throughput" else "l" for lane in lanes).split("l")
    assert max(len(run) for run in runs) == 1
    assert lanes[0] == "throughput" and lanes.count("throughput") >= 2  # its share again

