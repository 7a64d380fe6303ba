"""Which implementation the public functions run, per KVSTORE_KERNELS and device."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvstore import kernels
from kvstore.kernels import block_copy, cache_write, decode_attention, dequant, prefill_attention, reference

from kernel_testing import DEVICE, assert_close, cu_seqlens, make_paged_kv, random_queries

REPO = Path(__file__).resolve().parents[2]


def _calls() -> dict[str, tuple[ModuleType, tuple[Any, ...]]]:
    """Each public function's Triton module and one small set of arguments for it."""
    kv = make_paged_kv([3, 18], 2, 32, 16, torch.float32)
    q = random_queries(2, 4, 32, torch.float32)
    rows = random_queries(4, 4, 32, torch.float32)
    new_kv = random_queries(4, 2, 32, torch.float32, seed=3)
    slots = torch.tensor([40, -1, 41, 3], device=DEVICE)
    paged = (kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens)
    ids = torch.tensor([1, 0])
    data = torch.randint(-127, 128, (2, 3, 32), dtype=torch.int8, device=DEVICE)
    scales = torch.rand((2, 3), device=DEVICE)
    return {
        "dequantize_int8": (dequant, (data, scales, torch.empty(data.shape, device=DEVICE))),
        "dequantize_fp8": (dequant, (data.view(torch.uint8), scales, torch.empty(data.shape, device=DEVICE))),
        "paged_decode_attention": (decode_attention, (q, *paged, 0.1)),
        "paged_prefill_attention": (prefill_attention, (rows, *paged, cu_seqlens([1, 3]), 0.1)),
        "store_kv": (cache_write, (new_kv, new_kv, kv.k_cache, kv.v_cache, slots)),
        "gather_blocks": (block_copy, (kv.pool, ids)),
        "scatter_blocks": (block_copy, (kv.pool, ids, kv.pool[:2].clone())),
    }


def _spy(log: list[str], label: str, real: Callable[..., object]) -> Callable[..., object]:
    def spy(*args: object, **kwargs: object) -> object:
        log.append(label)
        return real(*args, **kwargs)

    return spy


@pytest.mark.parametrize("name", kernels.KERNELS)
@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
def test_backend_choice(name: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module, args = _calls()[name]
    log: list[str] = []
    monkeypatch.setattr(reference, name, _spy(log, "reference", getattr(reference, name)))
    monkeypatch.setattr(module, name, _spy(log, "triton", getattr(module, name)))
    monkeypatch.setenv("KVSTORE_KERNELS", backend)
    getattr(kernels, name)(*args)
    expected = backend if backend != "auto" else ("triton" if DEVICE.type == "cuda" else "reference")
    assert log == [expected]


def test_both_backends_agree_through_the_public_api(monkeypatch: pytest.MonkeyPatch) -> None:
    results = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("KVSTORE_KERNELS", backend)
        _, decode_args = _calls()["paged_decode_attention"]
        _, prefill_args = _calls()["paged_prefill_attention"]
        results[backend] = (kernels.paged_decode_attention(*decode_args), kernels.paged_prefill_attention(*prefill_args))
    for i, label in enumerate(("decode", "prefill")):
        assert_close(results["triton"][i], results["reference"][i], label)


def test_forcing_triton_without_triton_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_has_triton", lambda: False)
    _, args = _calls()["gather_blocks"]
    monkeypatch.setenv("KVSTORE_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="Triton is not installed"):
        kernels.gather_blocks(*args)
    if DEVICE.type == "cpu":
        monkeypatch.setenv("KVSTORE_KERNELS", "auto")
        kernels.gather_blocks(*args)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="compiled kernels run on CUDA tensors there")
def test_forcing_triton_on_cpu_without_the_interpreter_is_a_clear_error() -> None:
    script = (
        "import torch\nfrom kvstore import kernels\n"
        "pool = torch.zeros((4, 8))\n"
        "kernels.gather_blocks(pool, torch.tensor([1]))\n"
    )
    env = {**os.environ, "KVSTORE_KERNELS": "triton", "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "set TRITON_INTERPRET=1" in result.stderr, result.stderr[-2000:]
