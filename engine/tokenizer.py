"""Tokenizers: byte-level for the tiny preset, `tokenizers` for Hugging Face folders.

Both render chat messages to token ids and detokenize incrementally for streaming.
"""
from __future__ import annotations

import json
from pathlib import Path

from ac_observe.engine.config import RANDOM_1B_PRESET, TINY_PRESET, ModelConfig

REPLACEMENT = "\ufffd"


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus BOS=256, EOS=257, PAD=258."""

    vocab_size = 259
    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], system: str | None = None) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n"
                       for m in _with_system(messages, system))
        return [self.bos_token_id] + self.encode(text + "<|assistant|>\n")


class HFTokenizer:
    def __init__(self, folder: Path, config: ModelConfig):
        from tokenizers import Tokenizer
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.vocab_size = config.vocab_size
        self.bos_token_id = config.bos_token_id
        self.eos_token_id = config.eos_token_ids[0] if config.eos_token_ids else None
        tok_cfg_path = folder / "tokenizer_config.json"
        tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
        self._chat_template = tok_cfg.get("chat_template")
        self._bos_text = _token_text(tok_cfg.get("bos_token"))
        self._eos_text = _token_text(tok_cfg.get("eos_token"))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], system: str | None = None) -> list[int]:
        msgs = list(_with_system(messages, system))
        if self._chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            text = env.from_string(self._chat_template).render(
                messages=msgs, add_generation_prompt=True,
                bos_token=self._bos_text, eos_token=self._eos_text)
            return self.encode(text)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
        prefix = [self.bos_token_id] if self.bos_token_id is not None else []
        return prefix + self.encode(text)


def _token_text(token) -> str:
    if isinstance(token, dict):
        return token.get("content", "")
    return token or ""


def _with_system(messages: list[dict], system: str | None):
    if system:
        yield {"role": "system", "content": system}
    yield from messages


def load_tokenizer(model: str, config: ModelConfig):
    if model in (TINY_PRESET, RANDOM_1B_PRESET):
        return ByteTokenizer()
    return HFTokenizer(Path(model), config)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back split characters.

    Decodes only a short window (vLLM's prefix/read offsets), so cost per token is constant.
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            delta = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a request: whatever is held back, replacement characters included."""
        full = self._tok.decode(self._ids[self._prefix_offset:])
        prefix = self._tok.decode(self._ids[self._prefix_offset:self._read_offset])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
