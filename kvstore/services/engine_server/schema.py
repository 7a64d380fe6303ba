"""Request bodies of the OpenAI-compatible API (pydantic), checked before anything is queued.

Fields the engine does not use (``user``, ``logprobs`` off, ...) are accepted and ignored, as
OpenAI clients send them; a field of the wrong type or out of range is a 400 naming the field.
``null`` is every optional field's default, as in OpenAI's API (``"temperature": null`` is 1.0).
kvstore extensions (vLLM's names): ``ignore_eos``, ``top_k``; and ``kvstore`` (an object):
``{"store": false}`` is "do not store" (the request's blocks are neither stored nor cached
for later requests; the ``X-KVStore-No-Store`` header says the same).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from kvstore.engine.sampling import SEED_MAX, SEED_MIN

UNSUPPORTED = ("echo", "suffix", "logprobs", "top_logprobs", "tools", "response_format", "logit_bias")
TokenIds = list[StrictInt]
Prompt = StrictStr | TokenIds | list[StrictStr] | list[TokenIds]


class Body(BaseModel):
    """A JSON object of the API: unknown fields are ignored, and ``null`` means the default."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}
        return data


class StreamOptions(Body):
    include_usage: StrictBool = False


class KVStoreOptions(Body):
    """The ``kvstore`` extension object of a request body."""

    model_config = ConfigDict(extra="forbid")  # a misspelt option is a 400, not a silent store

    store: StrictBool = True  # False: "do not store" (SamplingParams.skip_writing_prefix_cache)


class SamplingFields(Body):
    """What completions and chat share."""

    model: StrictStr | None = None
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=-1)
    n: StrictInt = Field(1, ge=1, le=64)
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    kvstore: KVStoreOptions | None = None
    # refused unless off (null, false, 0, empty), each a 400 naming itself
    echo: Any = None
    suffix: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    tools: Any = None
    response_format: Any = None
    logit_bias: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value:
            raise ValueError("not supported by kvstore engine")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt = Field(16, gt=0)

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (a string, a token list, or a list of those)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], list | str):
            return list(p)
        return [p]  # type: ignore[list-item]


class ContentPart(Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(Body):
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

    def as_dict(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, gt=0)
    max_completion_tokens: StrictInt | None = Field(None, gt=0)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Body):
    """``/v1/kvstore/tokenize``: exactly one of ``prompt`` (one prompt) or ``messages``."""

    prompt: StrictStr | TokenIds | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self
