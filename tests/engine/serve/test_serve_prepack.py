"""``kvstore engine`` prepacks the weights for oneDNN by default; ``--no-prepack-weights`` keeps
torch's plain products. The flag reaches the engine the server builds."""

from __future__ import annotations

import pytest

from kvstore.cli import build_parser
from kvstore.engine import LLMEngine
from kvstore.services.engine_server.cli import serve_config

TINY = '{"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}'


@pytest.mark.parametrize(("flags", "prepacked"), [([], True), (["--no-prepack-weights"], False)])
def test_the_flag_reaches_the_engine(flags: list[str], prepacked: bool) -> None:
    args = build_parser().parse_args(["engine", "--random-model", "--random-config", TINY, "--host-mem", "1MiB",
                                      *flags])
    kwargs = serve_config(args).engine_kwargs()
    assert kwargs["prepack_weights"] is prepacked
    llm = LLMEngine(None, **kwargs)
    try:
        assert llm.model.prepacked is prepacked
        assert (llm.model.layers[0].qkv.packed is not None) is prepacked
        assert len(llm.generate([[1, 2, 3]])[0].token_ids) > 0
    finally:
        llm.close()
