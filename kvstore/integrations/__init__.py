"""kvstore inside other engines: the vLLM KV connector (``kvstore.integrations.vllm``)."""
