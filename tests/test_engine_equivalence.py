"""The engine computes what Hugging Face `transformers` computes on the same weights."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from ac_observe.engine.config import EngineConfig, ModelConfig
from ac_observe.engine.llm_engine import Engine, SamplingParams
from ac_observe.engine.model import CausalLM, rope_row_order, rotate_
from ac_observe.engine.model_runner import ModelRunner
from support.checkpoints import write_hf_checkpoint

MAX_NEW = 24


def _hf(folder, dtype, architecture="LlamaForCausalLM"):
    return getattr(transformers, architecture).from_pretrained(folder, dtype=dtype).eval()


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                             max_new_tokens=max_new, min_new_tokens=0, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _prompts(rng, count, vocab, shared_prefix=()):
    return [list(shared_prefix) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 90))]
            for _ in range(count)]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM",
                                          "MistralForCausalLM"])
def test_logits_match_transformers_float32(tmp_path, architecture):
    extra = {"tie_word_embeddings": True} if architecture == "Qwen2ForCausalLM" else {}
    folder = write_hf_checkpoint(tmp_path, architecture, seed=3, **extra)
    reference = _hf(folder, torch.float32, architecture)
    with Engine(EngineConfig(model=str(folder), dtype="float32"), start=False) as engine:
        rng = random.Random(1)  # distinct tokens: attention, RoPE and masks all matter
        prompt = [rng.randrange(3, 384) for _ in range(200)]
        ours = engine.prompt_logits(prompt)
    with torch.no_grad():
        ref = reference(torch.tensor([prompt])).logits[0]
    assert ours.shape == ref.shape
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rope_in_interleaved_rows_equals_transformers(dtype):
    """The engine rotates q/k rows stored in interleaved order (one complex multiply, or
    real arithmetic for dtypes without complex kernels); undoing the order must give
    transformers' rotate-half RoPE, in the same dtype."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    config = ModelConfig.tiny()
    model = CausalLM(config)
    T, heads, E = 7, 3, config.head_dim
    positions = torch.tensor([0, 1, 5, 17, 300, 301, 4000])
    hf_rows = torch.randn(T, heads, E, dtype=torch.float64).to(dtype)
    freqs = positions.to(torch.float32)[:, None] * model.inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[None], emb.sin().to(dtype)[None]  # [1, T, E]
    q = hf_rows.transpose(0, 1)[None]  # transformers' [batch, heads, T, E]
    expected = apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=1)[0][0].transpose(0, 1)
    ours = hf_rows[:, :, rope_row_order(E)].reshape(T, heads * E).clone()
    rotation = model.rotations(positions, int(positions.max()) + 1, dtype)
    assert rotation.is_complex() == (dtype != torch.bfloat16)
    rotate_(ours, rotation, heads)
    back = torch.empty_like(expected)
    back[:, :, rope_row_order(E)] = ours.view(T, heads, E)
    tol = {torch.float32: 1e-6, torch.float64: 1e-6, torch.bfloat16: 1e-2}[dtype]
    assert torch.allclose(back.float(), expected.float(), atol=tol, rtol=tol)


def test_bfloat16_logits_as_close_to_float32_as_transformers_bfloat16(llama_checkpoint):
    """bfloat16 (the CUDA default) takes the real-arithmetic RoPE path. Its rounding differs
    from transformers' own bfloat16 run, so both are judged against the float32 logits:
    ours may not stray further (RMS) than 1.1x theirs. A bf16-rounded RoPE frequency
    table, for one, strays 1.16-1.28x."""
    rng = random.Random(2)
    prompt = [rng.randrange(3, 384) for _ in range(200)]
    with torch.no_grad():
        exact = _hf(llama_checkpoint, torch.float32)(torch.tensor([prompt])).logits[0]
        theirs = _hf(llama_checkpoint, torch.bfloat16)(torch.tensor([prompt])).logits[0]
    with Engine(EngineConfig(model=str(llama_checkpoint), dtype="bfloat16"),
                start=False) as engine:
        ours = engine.prompt_logits(prompt)
    assert ours.dtype == torch.bfloat16

    def rms_error(logits):
        return ((logits.float() - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()

    assert rms_error(ours) <= 1.1 * rms_error(theirs), (rms_error(ours), rms_error(theirs))


def test_logits_through_cached_prefix_match(llama_checkpoint):
    """Logits of a suffix computed on top of cached prefix blocks equal a full recompute."""
    reference = _hf(llama_checkpoint, torch.float32)
    with Engine(EngineConfig(model=str(llama_checkpoint), dtype="float32"), start=False) as engine:
        prefix = list(range(3, 3 + 64))
        engine.add_request(prefix + [100], params=SamplingParams(max_tokens=1))
        engine.run_until_idle()
        out = engine.add_request(prefix + [101, 102], params=SamplingParams(max_tokens=4))
        engine.run_until_idle()
        result = out.result()
    assert result.num_cached_tokens == 64
    expected = _hf_greedy(reference, prefix + [101, 102], 4)
    assert result.new_token_ids == expected


@pytest.fixture(scope="module")
def float64_pair(llama_checkpoint):
    return llama_checkpoint, _hf(llama_checkpoint, torch.float64)


def _spy(monkeypatch, owner, name: str, note) -> None:
    """Wrap owner.name so that note(positional args, result) sees every call."""
    real = getattr(owner, name)

    def spied(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        note(args, result)
        return result
    monkeypatch.setattr(owner, name, spied)


def _engine64(folder, start=True, **kw):
    return Engine(EngineConfig(model=str(folder), dtype="float64", **kw), start=start)


def test_greedy_single_request_matches(float64_pair):
    folder, reference = float64_pair
    prompt = _prompts(random.Random(7), 1, 384)[0]
    with _engine64(folder) as engine:
        got = engine.generate(prompt, params=SamplingParams(max_tokens=MAX_NEW)).new_token_ids
    assert got == _hf_greedy(reference, prompt, MAX_NEW)


@pytest.mark.parametrize("decode", ["workspace", "gather", "graphs"])
def test_greedy_16_concurrent_requests_match(float64_pair, decode, monkeypatch):
    """On CPU "workspace" decodes over the contiguous workspace (the CPU default);
    "gather" gathers the paged blocks every step, and "graphs" runs the CUDA-graph steps
    (padded static buffers, a trash block for padding rows; here without the capture):
    the GPU's paths."""
    from ac_observe.engine.cuda_graphs import DecodeGraphs
    folder, reference = float64_pair
    prompts = _prompts(random.Random(11), 16, 384)
    assert len({len(p) for p in prompts}) > 8
    # Different lengths finish at different steps, so the decode batch shrinks as it runs
    # (and the CPU decode workspace is rebuilt for each new membership); with graphs every
    # batch size between 16 and 1 runs padded to its bucket, and contexts beyond the
    # graphs' 96 tokens run eagerly.
    budgets = [8 + (i * 5) % 17 for i in range(len(prompts))]
    replayed, eager = [], []
    _spy(monkeypatch, DecodeGraphs, "replay", lambda args, _: replayed.append(args))
    _spy(monkeypatch, ModelRunner, "prepare_decode",
         lambda args, _: eager.append(len(args[1])))
    options = {"workspace": {}, "gather": {"decode_workspace": "off"},
               "graphs": {"cuda_graphs": "on", "cuda_graph_max_len": 96}}[decode]
    with _engine64(folder, **options) as engine:
        assert bool(engine.runner.workspaces) == (decode == "workspace")
        assert bool(engine.runner.graphs) == (decode == "graphs")
        handles = [engine.add_request(p, params=SamplingParams(max_tokens=n))
                   for p, n in zip(prompts, budgets, strict=False)]
        outs = [h.result() for h in handles]
    for prompt, out, budget in zip(prompts, outs, budgets, strict=False):
        assert out.new_token_ids == _hf_greedy(reference, prompt, budget)
    if decode == "graphs":  # padded buckets ran, and so did eager steps past the graphs
        assert {size for _, size in replayed} >= {16, 9, 5, 3}  # in buckets 16, 16, 8, 4
        assert all(size <= bs for (bs, _), size in replayed)
        assert {M for (_, M), _ in replayed} >= {4, 6} and eager  # 6 blocks: the limit
    else:
        assert not replayed and eager


def test_greedy_with_prefix_cache_hits_matches(float64_pair):
    folder, reference = float64_pair
    rng = random.Random(5)
    system = [rng.randrange(3, 384) for _ in range(100)]
    prompts = _prompts(rng, 6, 384, shared_prefix=system)
    with _engine64(folder) as engine:
        first = engine.generate(prompts[0], params=SamplingParams(max_tokens=MAX_NEW))
        rest = engine.generate_batch(prompts[1:], SamplingParams(max_tokens=MAX_NEW))
    assert first.num_cached_tokens == 0
    assert all(out.num_cached_tokens == 96 for out in rest)  # 6 full blocks of 16
    for prompt, out in zip(prompts, [first] + rest, strict=False):
        assert out.new_token_ids == _hf_greedy(reference, prompt, MAX_NEW)


def test_greedy_after_preemption_matches(float64_pair):
    folder, reference = float64_pair
    prompts = _prompts(random.Random(13), 8, 384)
    # 40 blocks of 16 tokens cannot hold eight requests growing to ~110 tokens each.
    with _engine64(folder, num_kv_blocks=40) as engine:
        outs = engine.generate_batch(prompts, SamplingParams(max_tokens=MAX_NEW))
        assert engine.scheduler.num_preemptions > 0
        assert any(out.trace.num_preemptions for out in outs)
        assert engine.block_manager.num_free_blocks == 40
    for prompt, out in zip(prompts, outs, strict=False):
        assert out.new_token_ids == _hf_greedy(reference, prompt, MAX_NEW)


def test_greedy_with_overlapping_lanes_matches(float64_pair):
    """Every step runs both lanes' batches (the CUDA default, here on CPU): requests on
    both lanes, sharing a prefix across lanes, and a pool small enough to preempt, still
    generate exactly what transformers does."""
    folder, reference = float64_pair
    rng = random.Random(17)
    system = [rng.randrange(3, 384) for _ in range(40)]
    prompts = _prompts(rng, 12, 384, shared_prefix=system)
    budgets = [6 + (i * 7) % 23 for i in range(len(prompts))]
    lanes = ["low_latency" if i % 3 == 0 else "throughput" for i in range(len(prompts))]
    with _engine64(folder, overlap_lanes="on", num_kv_blocks=48) as engine:
        assert engine.overlap_lanes
        first = engine.generate(prompts[0], params=SamplingParams(max_tokens=budgets[0]),
                                lane="low_latency")
        handles = [engine.add_request(p, params=SamplingParams(max_tokens=n), lane=lane)
                   for p, n, lane in zip(prompts[1:], budgets[1:], lanes[1:], strict=False)]
        outs = [first] + [h.result() for h in handles]
        lane_steps = {name: t.num_steps for name, t in engine.stats.lanes.items()}
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == 48
    assert min(lane_steps.values()) > 0
    assert sum(out.trace.kv_hit_blocks for out in outs[1:]) > 0  # hits across lanes
    for prompt, out, budget in zip(prompts, outs, budgets, strict=False):
        assert out.new_token_ids == _hf_greedy(reference, prompt, budget)


def test_graph_padding_rows_write_only_the_trash_block(float64_pair):
    """A decode step of 3 sequences replays the 4-row graph: the padding row writes its
    keys and values into the trash block and nowhere else, and the real rows into exactly
    their new tokens' slots; the sequences still generate what transformers does."""
    folder, reference = float64_pair
    prompts = _prompts(random.Random(23), 3, 384)
    with _engine64(folder, cuda_graphs="on", cuda_graph_max_len=256, start=False) as engine:
        runner = engine.runner
        trash = runner.num_blocks
        assert runner.kv_pool.shape[3] == trash + 1  # one block the manager never sees
        # Start-up ran every bucket once (the warm-ups a capture needs): over the trash
        # block alone.
        assert runner.kv_pool[:, :, :, trash].abs().sum() > 0
        assert not runner.kv_pool[:, :, :, :trash].any()
        handles = [engine.add_request(p, params=SamplingParams(max_tokens=MAX_NEW))
                   for p in prompts]
        engine.step()  # the prefill
        bs = engine.config.block_size
        for _ in range(4):  # decode steps, 3 sequences in the 4-row bucket
            seqs = engine.scheduler.live_sequences()
            assert len(seqs) == 3
            runner.kv_pool[:, :, :, trash] = 0  # so the padding row's write shows each time
            before = runner.kv_pool.clone()
            engine.step()
            written = {(s.block_table[p // bs], p % bs) for s in seqs for p in [len(s) - 2]}
            changed = (before != runner.kv_pool).any(dim=(0, 1, 2, 5)).nonzero().tolist()
            assert {tuple(c) for c in changed if c[0] != trash} == written
            assert any(c[0] == trash for c in changed)
        engine.run_until_idle()
        outs = [h.result() for h in handles]
    for prompt, out in zip(prompts, outs, strict=False):
        assert out.new_token_ids == _hf_greedy(reference, prompt, MAX_NEW)


def test_a_sampled_decode_step_runs_eagerly_and_is_classed(float64_pair, monkeypatch):
    """Kernel sampling classes a decode step's kernels by the model's scopes; a replayed
    graph has none, so a sampled step runs eagerly and its attention time is counted,
    while the steps between samples replay their graphs."""
    from ac_observe.engine.cuda_graphs import DecodeGraphs
    from ac_observe.engine.kernel_sampler import KernelSampler
    folder, _ = float64_pair
    replayed, found = [], []
    _spy(monkeypatch, DecodeGraphs, "replay", lambda args, _: replayed.append(args[0]))
    _spy(monkeypatch, KernelSampler, "end", lambda args, result: found.append(result))
    with _engine64(folder, cuda_graphs="on", cuda_graph_max_len=256, kernel_sample_steps=2,
                   kernel_sample_budget=1.0, start=False) as engine:
        engine.add_request(_prompts(random.Random(3), 1, 384)[0],
                           params=SamplingParams(max_tokens=8))
        engine.step()  # prefill
        steps = []
        for _ in range(6):
            before = len(replayed)
            engine.step()
            steps.append((len(replayed) > before, found[-1]))
    sampled = [classes for replay, classes in steps if classes]
    assert sampled and all(not replay for replay, classes in steps if classes)
    assert all(replay for replay, classes in steps if not classes)
    assert all(classes[("throughput", "decode")]["attention"] > 0 for classes in sampled)


def test_packed_weights_compute_what_mkl_computes_and_run_from_four_tokens():
    """CPU float32 projections run on oneDNN with weights packed at load (the default):
    the same products as MKL's, in the same layouts, at every token count; a decode batch
    of 4 or more runs them packed and one of 1-3 does not (oneDNN's per-call cost loses
    there); off, or a dtype they do not serve, leaves MKL."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: the engine keeps MKL")
    with Engine(EngineConfig(seed=5), start=False) as packed, \
            Engine(EngineConfig(seed=5, cpu_packed_weights="off"), start=False) as plain:
        _check_packed_against_plain(packed, plain)
    with pytest.raises(RuntimeError, match="cpu_packed_weights on"):
        Engine(EngineConfig(dtype="float64", cpu_packed_weights="on"), start=False)
    with Engine(EngineConfig(dtype="float64"), start=False) as wide:
        assert not wide.runner.packed_weights
    model = CausalLM(ModelConfig.tiny())  # moved or cast, its packed copies go
    assert model.pack_weights() and model.packed_bytes() > 0
    model.double()
    assert model.packed_bytes() == 0 and model.model.layers[0].mlp.down_proj.packed is None


def _check_packed_against_plain(packed: Engine, plain: Engine) -> None:
    from torch.profiler import ProfilerActivity, profile

    from ac_observe.engine.model import PACKED, gemm_form, linear, linear_add, row_major_form
    assert packed.runner.packed_weights and not plain.runner.packed_weights
    layer = packed.runner.model.model.layers[0]
    reference = plain.runner.model.model.layers[0]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for tokens in (1, 2, 4, 16, 600):
            h = torch.randn(tokens, 256, generator=gen)
            act = torch.randn(tokens, 688, generator=gen)
            form = gemm_form(h, True)
            assert (form is PACKED) == (tokens >= 4)
            got = linear(h, layer.mlp.gate_up_proj, form)
            want = torch.nn.functional.linear(h, reference.mlp.gate_up_proj.weight)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), tokens
            got = linear_add(h, act, layer.mlp.down_proj, form)
            want = h + torch.nn.functional.linear(act, reference.mlp.down_proj.weight)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), tokens
            qkv_proj = layer.self_attn.qkv_proj
            qkv = linear(h, qkv_proj, row_major_form(h, qkv_proj))
            assert qkv.is_contiguous()  # RoPE and the cache writes view its rows
        prompt = list(range(3, 60))
        assert torch.allclose(packed.prompt_logits(prompt), plain.prompt_logits(prompt),
                              rtol=1e-4, atol=1e-4)

    def ops_of_a_decode_step(engine, batch):
        for i in range(batch):
            engine.add_request([5 + i] * 10, params=SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()  # the prefill
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        engine.run_until_idle()
        return {event.name for event in prof.events()}
    assert "mkldnn::_linear_pointwise" in ops_of_a_decode_step(packed, 8)
    assert "mkldnn::_linear_pointwise" in ops_of_a_decode_step(packed, 4)
    for batch in (1, 2, 3):  # below 4 tokens every projection stays on MKL
        assert "mkldnn::_linear_pointwise" not in ops_of_a_decode_step(packed, batch), batch
    assert "mkldnn::_linear_pointwise" not in ops_of_a_decode_step(plain, 8)
