"""Write small randomly initialised Hugging Face checkpoints (for tests and benchmarks).

Needs `transformers` (the test extra). Nothing is downloaded: the weights are random and
the BPE tokenizer is trained on a few built-in sentences.
"""
from __future__ import annotations

import json


def write_hf_checkpoint(folder, architecture="LlamaForCausalLM", vocab_size=384, seed=0,
                        eos_token_id=None, query_key_std=0.3, dtype=None, **overrides):
    """A randomly initialised checkpoint saved with `save_pretrained`, plus a BPE tokenizer.

    Query and key projections get a larger scale (`query_key_std`) than the rest, so
    attention is sharp and logits depend on positions: a wrong RoPE, mask or cache slot
    changes them well beyond float tolerance.
    """
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    config_cls = {"LlamaForCausalLM": transformers.LlamaConfig,
                  "Qwen2ForCausalLM": transformers.Qwen2Config,
                  "MistralForCausalLM": transformers.MistralConfig}[architecture]
    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
                 eos_token_id=eos_token_id, tie_word_embeddings=False)
    shape.update(overrides)
    config = config_cls(**shape)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # larger than the default init, so logits are far from uniform
        for name, param in model.named_parameters():
            if "norm" not in name:
                qk = ".q_proj." in name or ".k_proj." in name
                param.normal_(0.0, query_key_std if qk else 0.08)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder, safe_serialization=True)

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The quick brown fox jumps over the lazy dog.",
              "Observability for GPU inference: latency, cache hits, streams.",
              "<instructions>Answer briefly.</instructions> {\"key\": [1, 2, 3]}"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
                         "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
                         "<|assistant|>{% endif %}"}))
    return folder
