"""``kvstore engine`` prepacks the weights for oneDNN by default; ``--no-prepack-weights`` keeps
torch's plain products. It decodes through the CPU kernel that reads the pool in place;
``--no-cpu-decode-kernel`` keeps torch's attention. The flags reach the engine the server builds."""

from __future__ import annotations

import pytest

from kvstore.cli import build_parser
from kvstore.engine import LLMEngine
from kvstore.kernels import cpu_rows
from kvstore.services.engine_server.cli import serve_config
from tests.factories import require

TINY = '{"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}'


@pytest.mark.parametrize(("flags", "prepacked", "kernel"), [([], True, True), (["--no-prepack-weights"], False, True),
                                                         (["--no-cpu-decode-kernel"], True, False)])
def test_the_flags_reach_the_engine(flags: list[str], prepacked: bool, kernel: bool) -> None:
    require(not kernel or cpu_rows.load(), "the CPU decode kernel did not build")
    args = build_parser().parse_args(["engine", "--random-model", "--random-config", TINY, "--host-mem", "1MiB",
                                      *flags])
    kwargs = serve_config(args).engine_kwargs()
    assert kwargs["prepack_weights"] is prepacked and kwargs["cpu_decode_kernel"] is kernel
    llm = LLMEngine(None, **kwargs)
    try:
        assert llm.model.prepacked is prepacked
        assert (llm.model.layers[0].qkv.packed is not None) is prepacked
        assert llm.runner.row_kernel is kernel
        assert len(llm.generate([[1, 2, 3], [4, 5, 6]])[0].token_ids) > 0
    finally:
        llm.close()
