"""Response bodies and Server-Sent Events in OpenAI's shapes (completions and chat, whole or
streamed), with the usage block and kvstore's per-tier split of the cached prompt tokens."""

from __future__ import annotations

import json
from typing import Any

from kvstore.services.engine_server.generation import TIERS, Delta, Generation

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    """One SSE event: ``data: {json}`` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(gens: list[Generation]) -> dict[str, Any]:
    """OpenAI's usage plus ``kvstore``: cached prompt tokens by tier, prompt tokens computed (the
    two sum to ``prompt_tokens``), and tokens recomputed after preemptions."""
    prompt = sum(g.num_prompt_tokens for g in gens)
    completion = sum(g.num_completion_tokens for g in gens)
    by_tier = {tier: sum(g.cached_tokens.get(tier, 0) for g in gens) for tier in TIERS}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(by_tier.values())},
            "kvstore": {"cached_tokens": by_tier, "computed_tokens": sum(g.num_computed_tokens for g in gens),
                        "recomputed_tokens": sum(g.num_recomputed_tokens for g in gens)}}


class Shapes:
    """Builds one API request's bodies and chunks (``kind``: "completion" or "chat")."""

    def __init__(self, kind: str, request_id: str, created: int, model: str, include_usage: bool) -> None:
        self.kind = kind
        self.id = request_id
        self.created = created
        self.model = model
        self.include_usage = include_usage

    def _head(self, obj: str) -> dict[str, Any]:
        head: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        return head

    def body(self, gens: list[Generation]) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        samples = sorted((s for g in gens for s in g.samples), key=lambda s: s.index)
        choices: list[dict[str, Any]]
        if self.kind == "completion":
            choices = [{"index": s.index, "text": s.emitted, "logprobs": None, "finish_reason": s.finish_reason}
                       for s in samples]
            out = self._head("text_completion")
        else:
            choices = [{"index": s.index, "message": {"role": "assistant", "content": s.emitted},
                        "logprobs": None, "finish_reason": s.finish_reason} for s in samples]
            out = self._head("chat.completion")
        out.update(choices=choices, usage=usage(gens))
        return out

    def first_chunks(self, gens: list[Generation]) -> list[bytes]:
        """Chat streams open each choice with the assistant role; completions send nothing."""
        if self.kind != "chat":
            return []
        return [self._chat_chunk(s.index, {"role": "assistant", "content": ""}, None)
                for g in gens for s in g.samples]

    def chunks(self, delta: Delta) -> list[bytes]:
        if self.kind == "completion":
            out = self._head("text_completion")
            out["choices"] = [{"index": delta.index, "text": delta.text, "logprobs": None,
                               "finish_reason": delta.finish_reason}]
            if self.include_usage:
                out["usage"] = None
            return [sse(out)]
        events = []
        if delta.text:
            events.append(self._chat_chunk(delta.index, {"content": delta.text}, None))
        if delta.finish_reason is not None:
            events.append(self._chat_chunk(delta.index, {}, delta.finish_reason))
        return events

    def _chat_chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None) -> bytes:
        out = self._head("chat.completion.chunk")
        out["choices"] = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def usage_chunk(self, gens: list[Generation]) -> bytes:
        out = self._head("text_completion" if self.kind == "completion" else "chat.completion.chunk")
        out.update(choices=[], usage=usage(gens))
        return sse(out)
