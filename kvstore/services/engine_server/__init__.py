"""``kvstore engine``: the engine behind an OpenAI-compatible HTTP API (docs/serving.md)."""
