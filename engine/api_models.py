"""Request bodies of the Anthropic Messages and OpenAI Chat Completions APIs (pydantic).

Strict types: a wrong type is a 400 naming the field, never a silent coercion. A field
the engine does not honour is a 400 naming it, never accepted and ignored: what a request
says is what runs. Accepted without effect, because they only label a request:
Anthropic `metadata.user_id`, OpenAI `user`, and `cache_control` on a text block (prefix
caching is automatic). vLLM's sampling extensions, which serving benchmarks send, are
honoured on both routes: `ignore_eos`, `min_tokens`, `stop_token_ids`, `top_k`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_STRICT = ConfigDict(strict=True, extra="forbid")


class ContentBlock(BaseModel):
    # Extra keys are judged in check_text_blocks, which can say "image not supported"
    # rather than complain about an image's `source`.
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None
    cache_control: dict | None = None  # a caching hint: the prefix cache is automatic


class SamplingExtensions(BaseModel):
    """vLLM's extensions to both APIs, as benchmark clients (guidellm, vLLM's benchmark,
    aiperf) send them to get fixed-length outputs."""
    model_config = _STRICT
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, value):
        if value and any(t < 0 for t in value):
            raise ValueError("token ids are not negative")
        return value


def check_text_blocks(blocks: list[ContentBlock]) -> list[ContentBlock]:
    for block in blocks:
        if block.type == "text" and block.text is None:
            raise ValueError("a text block needs a 'text' string")
        if block.type in ("image", "document", "image_url", "input_audio"):
            raise ValueError(f"{block.type} content is not supported by this text-only model")
        if block.type != "text":
            raise ValueError(f"{block.type[:40]!r} content is not supported by this engine")
        if block.model_extra:
            raise ValueError(f"{sorted(block.model_extra)[0][:40]!r} in a text block is not "
                             "supported by this engine")
    return blocks


class AnthropicMessage(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content")
    @classmethod
    def _content(cls, value):
        return value if isinstance(value, str) else check_text_blocks(value)


class Metadata(BaseModel):
    model_config = _STRICT
    user_id: str | None = None


class MessagesRequest(SamplingExtensions):
    model_config = _STRICT
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value):
        if value < 1:
            raise ValueError("max_tokens must be at least 1")
        return value

    @field_validator("system")
    @classmethod
    def _system(cls, value):
        return value if value is None or isinstance(value, str) else check_text_blocks(value)

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value):
        if value and any(not s for s in value):
            raise ValueError("stop sequences must be non-empty strings")
        return value


class CountTokensRequest(BaseModel):
    model_config = _STRICT
    model: str = Field(min_length=1, max_length=256)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentBlock] | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value):
        return value if value is None or isinstance(value, str) else check_text_blocks(value)

    @model_validator(mode="after")
    def _has_content(self):
        """Only an assistant message may come without content (OpenAI's rule)."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs its content")
        return self


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    # vLLM's extension (guidellm sends it): usage so far on every chunk, with include_usage.
    continuous_usage_stats: bool = False



def neutral_only(value, field: str):
    """A field this engine takes only at its neutral value (NEUTRAL_ONLY): benchmark
    clients send it so; anything else would change sampling."""
    neutral = NEUTRAL_ONLY[field]
    if value is not None and value != neutral:
        raise ValueError(f"only {neutral} is supported by this engine")
    return value


class OpenAISampling(SamplingExtensions):
    """The fields both OpenAI routes share."""
    model_config = _STRICT
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 63 - 1)  # int64, as vLLM
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)  # an identifier, no effect
    # Sent at their neutral values by benchmark clients (NEUTRAL_ONLY); anything else
    # would change sampling.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None

    @field_validator("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p")
    @classmethod
    def _neutral_only(cls, value, info):
        return neutral_only(value, info.field_name)

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value):
        if value is not None and value < 1:
            raise ValueError("must be at least 1")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop takes up to 16 non-empty strings")
        return value


# Fields accepted only at the value that changes nothing.
NEUTRAL_ONLY = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                "min_p": 0.0, "logprobs": None, "echo": False, "best_of": 1, "suffix": None}
# Who is known to send a field this engine refuses (or accepts only at its neutral value),
# for the refusal to name: docs/engine.md, "What benchmark clients send".
FIELD_SENDERS = {
    "repetition_penalty": "vLLM's `vllm bench serve` --repetition-penalty",
    "min_p": "vLLM's `vllm bench serve` --min-p",
    "logprobs": "vLLM's `vllm bench serve` --logprobs",
    "top_logprobs": "vLLM's `vllm bench serve` --logprobs",
    "tools": "guidellm (tool-call turns)",
    "tool_choice": "guidellm (tool-call turns)",
    "echo": "OpenAI's legacy completions clients",
    "best_of": "OpenAI's legacy completions clients",
}


class ChatCompletionRequest(OpenAISampling):
    model_config = _STRICT
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value):
        if value:
            raise ValueError("only False is supported by this engine")
        return value

    @field_validator("max_completion_tokens")
    @classmethod
    def _positive_completion(cls, value):
        if value is not None and value < 1:
            raise ValueError("must be at least 1")
        return value


class CompletionRequest(OpenAISampling):
    """The legacy Completions API (`POST /v1/completions`), as `vllm bench serve`,
    genai-perf and guidellm's completions mode send it: one prompt, as text or token ids
    (a list of one, as genai-perf sends it, too)."""
    model_config = _STRICT
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # the API's default
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("logprobs", "echo", "best_of", "suffix")
    @classmethod
    def _legacy_neutral_only(cls, value, info):
        return neutral_only(value, info.field_name)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("one prompt per request is supported by this engine "
                                 f"(got {len(value)})")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and any(t < 0 for t in value):
            raise ValueError("token ids are not negative")
        return value
