"""Why prefix-cache lookups missed: evicted, cold or diverged, per block, and hit rates
per prompt skeleton, from the engine's files through the daemon's query engine.

The engine runs on the test's thread over a pool of 12 blocks of 16 byte-tokens, so
what is cached, hit and evicted follows from the request sequence alone; every expected
figure is worked out in the comments.
"""
from __future__ import annotations

import time

import pytest

from ac_observe import metrics as m
from ac_observe.daemon.config import DaemonConfig
from ac_observe.daemon.service import Daemon
from ac_observe.engine.block_manager import BlockManager, chain_hash
from ac_observe.engine.config import EngineConfig
from ac_observe.engine.evicted_hashes import EvictedHashes
from ac_observe.engine.llm_engine import Engine, SamplingParams
from ac_observe.engine.sequence import Sequence
from ac_observe.engine.skeleton import skeleton_of_text
from support.telemetry import read_as_daemon, sample_value

BLOCK = 16
SYSTEM = "<sys>You answer questions about the GPU fleet.".ljust(3 * BLOCK)  # 3 blocks


def _t1(question: str, blocks: int = 5) -> str:
    """Template 1: the shared system blocks, then the question. 5 looked-up blocks by
    default (81 bytes; the last token is never looked up), the last two the question's."""
    text = f"{SYSTEM}</sys><q>{question}</q>"
    assert len(text) == blocks * BLOCK + 1, len(text)
    return text


def _t1b(question: str) -> str:
    """Template 1 changed: the same system text, then a context section (a new skeleton)."""
    text = f"{SYSTEM}</sys><ctx>{question}</ctx>"
    assert len(text) == 5 * BLOCK + 1, len(text)
    return text


Q1, Q2 = "which GPU runs hot??", "how full is the pool"
Q3 = "what failed at noon, and on which of the GPUs?".ljust(20 + 2 * BLOCK)
Q4 = "where is gpu 7??"
T2_TEXT = ("new traffic " * 15)[:11 * BLOCK] + "."  # 11 looked-up blocks, 12 needed


_read, _value = read_as_daemon, sample_value


def test_misses_by_reason_and_hit_rates_by_skeleton(tmp_path):
    root = tmp_path / "telemetry"
    config = EngineConfig(telemetry_dir=str(root / "e1"), engine_name="e1", model_name="m1",
                          num_kv_blocks=12, skeleton_min_count=1)
    daemon = Daemon(DaemonConfig(telemetry_root=root, window_seconds=600,
                                 collectors=("engine",)))
    t0 = time.time()
    cycle = iter(range(1000))
    traces = {}
    with Engine(config, start=False) as engine:
        def run(name: str, prompt: str) -> None:
            handle = engine.add_request(prompt, params=SamplingParams(max_tokens=1))
            engine.run_until_idle()
            traces[name] = handle.result().trace
            daemon.run_cycle(now=t0 + next(cycle))

        daemon.run_cycle(now=t0 + next(cycle))
        # R1 template 1: nothing cached, 5 cold. Cached after: its 5 full blocks.
        run("R1", _t1(Q1))
        # R2 template 1, another question: the 3 system blocks hit, then 2 blocks never
        # seen after a hit: diverged. It takes R1's unfilled tail block and 2 fresh ones.
        run("R2", _t1(Q2))
        # R3 new traffic (another skeleton) takes all 12 blocks: 11 cold, and every
        # cached block (R1's 5, R2's 2) is evicted.
        run("R3", T2_TEXT)
        evictions_after_r3 = engine.block_manager.stats.evictions
        # R4 is R1 again: all 5 blocks were cached and evicted.
        run("R4", _t1(Q1))
        # R5 template 1, a longer question (7 blocks): 3 hits (R4 recomputed the system
        # blocks), 4 diverged.
        run("R5", _t1(Q3, blocks=7))
        # R6 the changed template: its own skeleton; the system blocks hit, the 2 blocks
        # of the new section diverge.
        run("R6", _t1b(Q4))
        final = _read(root)
        now = t0 + next(cycle)
        daemon.run_cycle(now=now)

    assert evictions_after_r3 == 7
    per_request = {name: (t.kv_hit_blocks, t.kv_query_blocks, t.kv_miss_blocks)
                   for name, t in traces.items()}
    assert per_request == {
        "R1": (0, 5, {"evicted": 0, "cold": 5, "diverged": 0}),
        "R2": (3, 5, {"evicted": 0, "cold": 0, "diverged": 2}),
        "R3": (0, 11, {"evicted": 0, "cold": 11, "diverged": 0}),
        "R4": (0, 5, {"evicted": 5, "cold": 0, "diverged": 0}),
        "R5": (3, 7, {"evicted": 0, "cold": 0, "diverged": 4}),
        "R6": (3, 5, {"evicted": 0, "cold": 0, "diverged": 2}),
    }
    misses = {m.MISS_EVICTED: 5, m.MISS_COLD: 5 + 11, m.MISS_DIVERGED: 2 + 4 + 2}
    for reason, count in misses.items():
        assert _value(final, "ac_kv_cache_miss_blocks_total", reason=reason) == count
        assert _value(final, "ac_kv_cache_miss_tokens_total", reason=reason) == count * BLOCK

    t1 = skeleton_of_text(_t1(Q1)).skeleton_id
    t1b = skeleton_of_text(_t1b(Q4)).skeleton_id
    t2 = skeleton_of_text(T2_TEXT).skeleton_id
    assert len({t1, t1b, t2}) == 3
    assert skeleton_of_text(_t1(Q2)).skeleton_id == skeleton_of_text(_t1(Q3, 7)).skeleton_id \
        == t1
    per_skeleton = {t1: (22, 6, 3 * 81 + 113), t2: (11, 0, 177), t1b: (5, 3, 81)}
    for skeleton, (query, hit, tokens) in per_skeleton.items():
        assert _value(final, "ac_kv_cache_query_blocks_total", skeleton=skeleton) == query
        assert _value(final, "ac_kv_cache_hit_blocks_total", skeleton=skeleton) == hit
        assert _value(final, "ac_kv_cache_query_tokens_total", skeleton=skeleton) == tokens
        assert _value(final, "ac_kv_cache_hit_tokens_total", skeleton=skeleton) == hit * BLOCK

    # The daemon's answers: the hit rate per skeleton as the ratio of sums over the window
    # (T1's four requests hit 0/5, 3/5, 0/5 and 3/7: 6/22 = 27.3 %, where the mean of the
    # per-request ratios would be 25.7 %; T1b 60 %), the engine's overall rate summed
    # over skeletons (9/38), and each reason's share of all lookups (over 38).
    def answer(metric, **labels):
        return {tuple(sorted(s["labels"].items())): s["mean"]
                for s in daemon.query(metric, 600, labels, now=now)["series"]}

    # (the daemon's node, first on every series it answers, sorts among them here)
    base = (("engine", "e1"), ("kind", "ac-observe"), ("model", "m1"),
            ("node", daemon.config.node_name))
    for skeleton, rate in ((t1, 100 * 6 / 22), (t2, 0.0), (t1b, 60.0)):
        got = answer("kv_cache_hit_rate", skeleton=skeleton)
        assert got == {base + (("skeleton", skeleton),): pytest.approx(rate)}, skeleton
    assert answer("kv_cache_hit_rate") == {base: pytest.approx(100 * 9 / 38)}
    shares = answer("kv_cache_miss_reasons")
    assert shares == {tuple(sorted(base + (("reason", reason),))): pytest.approx(100 * n / 38)
                      for reason, n in misses.items()}
    # Eviction ages: one per eviction.
    assert _value(final, "ac_kv_cache_eviction_age_seconds_count") == \
        engine.block_manager.stats.evictions


class _Clock:
    def __init__(self):
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def _seq(tokens) -> Sequence:
    return Sequence("s", list(tokens), SamplingParams())


def _cache(manager: BlockManager, tokens) -> Sequence:
    """Run a prompt through the pool: allocate, compute it all, release its blocks."""
    seq = _seq(tokens)
    assert manager.try_allocate(seq)
    seq.num_computed_tokens = len(seq.token_ids)
    manager.commit(seq)
    manager.free(seq)
    return seq


def test_eviction_ages():
    clock = _Clock()
    manager = BlockManager(num_blocks=4, block_size=4, clock=clock)
    clock.ns = 1_000_000_000
    _cache(manager, range(9))  # released at t = 1 s: 2 full blocks cached, 1 tail
    clock.ns = 2_000_000_000
    _cache(manager, range(50, 54))  # takes the tail and a fresh block; 1 cached
    # A prompt needing all 4 blocks at t = 3.5 s evicts the 3 cached blocks: 2.5 s and
    # 1.5 s unused.
    clock.ns = 3_500_000_000
    assert manager.try_allocate(_seq(range(100, 116)))
    assert manager.stats.evictions == 3
    assert sorted(manager.eviction_ages) == [1.5, 2.5, 2.5]


def test_blocks_behind_an_evicted_ancestor_count_as_evicted():
    manager = BlockManager(num_blocks=6, block_size=4)
    _cache(manager, range(13))  # 3 looked-up blocks, all cached
    hashes = [chain_hash(None, (0, 1, 2, 3))]
    for start in (4, 8):
        hashes.append(chain_hash(hashes[-1], tuple(range(start, start + 4))))
    manager.free_queue.move_to_end(manager.hash_to_block[hashes[0]], last=False)
    _cache(manager, [7, 7, 7])  # takes (evicts) only the first block of the prefix
    assert hashes[0] not in manager.hash_to_block
    assert all(h in manager.hash_to_block for h in hashes[1:])
    again = _seq(range(13))
    assert manager.try_allocate(again)
    # No hit: the later blocks are cached but unreachable without the first one.
    assert again.kv_hit_blocks == 0 and again.kv_miss_blocks == (3, 0, 0)


def test_a_flushed_prefix_cache_misses_as_evicted_and_keeps_held_blocks_private():
    """The fault route's flush (`prefix_flush_ms`): every cached block forgotten and counted
    as evicted; a block a running sequence holds stays its own, and no later prompt
    shares it; what was cached before misses as evicted, new prompts as cold."""
    manager = BlockManager(num_blocks=16, block_size=4)
    _cache(manager, range(9))  # 2 full blocks cached, released
    held = _seq(range(100, 109))
    assert manager.try_allocate(held)
    held.num_computed_tokens = 9
    manager.commit(held)  # 2 more cached, still held
    assert manager.flush_prefix_cache() == 4
    assert manager.hash_to_block == {} and manager.stats.evictions == 4
    manager.check_invariants([held])
    again, twin = _seq(range(9)), _seq(range(100, 109))
    assert manager.try_allocate(again) and manager.try_allocate(twin)
    assert again.kv_hit_blocks == twin.kv_hit_blocks == 0
    assert again.kv_miss_blocks == twin.kv_miss_blocks == (2, 0, 0)  # evicted
    assert not set(twin.block_table) & set(held.block_table)
    fresh = _seq(range(200, 209))
    assert manager.try_allocate(fresh) and fresh.kv_miss_blocks == (0, 2, 0)  # cold
    manager.check_invariants([held, again, twin, fresh])


def test_forgotten_evictions_count_as_never_seen():
    """A memory of 16 remembers at least the last 8 evictions and at most 16."""
    manager = BlockManager(num_blocks=2, block_size=1, evicted_memory=16)
    for i in range(40):  # each prompt caches 2 blocks, evicting the previous prompt's 2
        _cache(manager, [i, 0])
    assert manager.stats.evictions == 2 * 39
    for i in range(35, 39):  # the last 8 evicted hashes: prompts 35..38
        assert manager._cached_prefix(_seq([i, 5]), attribute=True)[2] == (1, 0, 0), i
    assert manager._cached_prefix(_seq([0, 5]), attribute=True)[2] == (0, 1, 0)


def test_evicted_hash_memory_stays_bounded_under_a_million_blocks():
    import hashlib
    capacity = 1 << 14
    memory = EvictedHashes(capacity)
    size = memory.nbytes
    assert size <= 32 * capacity
    hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(1_000_000)]
    for h in hashes:
        memory.add(h)
    assert memory.nbytes == size
    assert capacity // 2 <= len(memory) <= capacity
    # The most recent capacity // 2 are always there; the oldest are gone.
    assert all(h in memory for h in hashes[-capacity // 2:])
    assert not any(h in memory for h in hashes[:1000])
    # Never-inserted hashes: a false "evicted" has probability <= capacity / 2^63 each.
    unseen = (hashlib.sha256(b"u" + i.to_bytes(8, "little")).digest() for i in range(200_000))
    assert not any(h in memory for h in unseen)
