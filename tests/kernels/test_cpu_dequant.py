"""The C++ CPU decode kernels (csrc/dequantize.cpp, built by kvstore/kernels/cpu_ext.py): the
8-bit dequantize bit for bit against the torch reference (every scale and out dtype, bfloat16
included, odd shapes, strided views of encoded rows, every fp8 byte), the int4 decode against
the torch path (bit for bit without the rotation; with it, both against a float64 product),
the shapes it leaves to torch, its input checks, and the torch path where it is not built."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstore import kernels
from kvstore.codecs import get_codec
from kvstore.codecs.int4 import Int4Codec
from kvstore.codecs.rotation import rotation
from kvstore.kernels import cpu_ext, reference
from kvstore.layout import KVLayout
from tests.factories import require

from kernel_testing import assert_same_bits, poisoned_like

SHAPES = [(3, 37, 24), (1, 1, 1), (2, 130, 64), (4, 5, 7), (2, 9, 128)]
OUT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def module() -> object:
    built = cpu_ext.load()
    require(built, "kvstore's CPU kernels did not build (a C++ compiler and ninja on the PATH)")
    return built


def _int8(shape: tuple[int, int, int], scale_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen)
    scales = (torch.rand(shape[:2], generator=gen) * 40).to(scale_dtype)
    scales[0, 0] = 0  # a zero row
    return data, scales


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_8bit_matches_reference(module: object, fp8: bool, shape: tuple[int, int, int], scale_dtype: torch.dtype,
                                out_dtype: torch.dtype) -> None:
    data, scales = _int8(shape, scale_dtype, seed=sum(shape))
    if fp8:
        data = data.view(torch.uint8)
        data[0, 0, 0] = 0x7F  # e4m3fn's NaN pattern: decoded by the same bit move as every byte
    ref, run = (reference.dequantize_fp8, kernels.dequantize_fp8) if fp8 else (reference.dequantize_int8,
                                                                             kernels.dequantize_int8)
    expected = ref(data, scales, torch.empty(shape, dtype=out_dtype))
    out = poisoned_like(expected)
    assert run(data, scales, out) is out
    assert_same_bits(out, expected, f"{'fp8' if fp8 else 'int8'} {shape} {scale_dtype} -> {out_dtype}")


def test_every_fp8_byte(module: object) -> None:
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 32, 8)
    scales = torch.linspace(0.5, 3.0, 32).view(1, 32)
    for out_dtype in OUT_DTYPES:
        expected = reference.dequantize_fp8(data, scales, torch.empty(data.shape, dtype=out_dtype))
        assert_same_bits(kernels.dequantize_fp8(data, scales, poisoned_like(expected)), expected, str(out_dtype))


def test_strided_views_of_encoded_rows(module: object) -> None:
    # rows laid out like encoded blocks in 4 KiB slots, written into the middle of a larger pool
    n, rows, head_dim, slot = 3, 10, 16, 4096
    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (n, slot), dtype=torch.uint8, generator=gen)
    scales = raw[:, 32 : 32 + 2 * rows].view(torch.float16).view(n, rows)
    scales.copy_(torch.rand((n, rows), generator=gen))
    data = raw[:, 128 : 128 + rows * head_dim].view(torch.int8).view(n, rows, head_dim)
    pool = torch.full((n + 2, rows, head_dim), float("nan"), dtype=torch.bfloat16)
    out = pool[1 : 1 + n]
    kernels.dequantize_int8(data, scales, out)
    expected = reference.dequantize_int8(data.contiguous(), scales.contiguous(), torch.empty_like(out))
    assert_same_bits(out, expected, "strided")
    assert bool(pool[0].isnan().all()) and bool(pool[-1].isnan().all()), "wrote outside out"


def _decode_both(name: str, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, torch.Tensor]:
    codec = get_codec(name)
    encoded = codec.encode(x)
    fast = codec.decode(encoded, poisoned_like(x))
    monkeypatch.setenv("KVSTORE_KERNELS", "reference")
    slow = codec.decode(encoded, poisoned_like(x))
    monkeypatch.delenv("KVSTORE_KERNELS")
    return fast, slow


@pytest.mark.parametrize("head_dim", [64, 128, 16, 32, 256])
@pytest.mark.parametrize("dtype", OUT_DTYPES)
def test_int4_norot_matches_torch_path(module: object, monkeypatch: pytest.MonkeyPatch, head_dim: int,
                                       dtype: torch.dtype) -> None:
    x = (torch.randn((3, 2, 2, 5, 3, head_dim), generator=torch.Generator().manual_seed(head_dim)) * 4).to(dtype)
    fast, slow = _decode_both("int4-norot", x, monkeypatch)
    assert_same_bits(fast, slow, f"int4-norot head_dim {head_dim} {dtype}")


@pytest.mark.parametrize("head_dim", [64, 128, 16, 8, 2, 256])
def test_int4_rot_undoes_the_hadamard_rotation(module: object, monkeypatch: pytest.MonkeyPatch,
                                               head_dim: int) -> None:
    # float32 blocks: the decode's own rounding, not the output dtype's, is what differs
    x = torch.randn((3, 2, 2, 5, 3, head_dim), generator=torch.Generator().manual_seed(head_dim)) * 4
    codec = get_codec("int4-rot")
    assert isinstance(codec, Int4Codec)
    encoded = codec.encode(x)
    fast, slow = _decode_both("int4-rot", x, monkeypatch)
    # the exact decode: the stored values (what int4-norot's decode makes of the same codes) times M^T in float64
    monkeypatch.setenv("KVSTORE_KERNELS", "reference")
    scales, packed = codec._views(encoded, _layout(x))
    values = torch.empty_like(x)
    Int4Codec()._dequantize(scales, packed, values)
    exact = (values.double().reshape(-1, head_dim) @ rotation(head_dim).double().T).view(x.shape)
    for got, path in ((fast, "C++"), (slow, "torch")):
        err = (got.double() - exact).abs().max().item()
        assert err <= 1e-6 * exact.abs().max().item(), f"{path} decode of int4-rot off by {err} at head_dim {head_dim}"


@pytest.mark.parametrize("head_dim", [80, 5, 1])
@pytest.mark.parametrize("name", ["int4-rot", "int4-norot"])
def test_int4_shapes_left_to_torch(module: object, monkeypatch: pytest.MonkeyPatch, name: str, head_dim: int) -> None:
    # a random orthogonal rotation (80) or an odd head_dim: the kernel declines and torch decodes
    x = torch.randn((2, 1, 2, 3, 2, head_dim), generator=torch.Generator().manual_seed(head_dim)).half()
    fast, slow = _decode_both(name, x, monkeypatch)
    assert_same_bits(fast, slow, f"{name} head_dim {head_dim}")


def test_decodes_run_the_kernel(module: object, monkeypatch: pytest.MonkeyPatch) -> None:
    # on CPU tensors under KVSTORE_KERNELS=auto every 8-bit and int4 decode goes through the module
    calls: list[str] = []

    def spy(name: str) -> Callable[..., None]:
        original = getattr(module, name)

        def call(*args: object) -> None:
            calls.append(name)
            original(*args)
        return call

    for name in ("dequantize", "dequantize_int4"):
        monkeypatch.setattr(module, name, spy(name))
    x = torch.randn((2, 2, 2, 4, 2, 64), generator=torch.Generator().manual_seed(5)).bfloat16()
    for name in ("int8", "fp8", "int4-rot", "int4-norot"):
        codec = get_codec(name)
        codec.decode(codec.encode(x), torch.empty_like(x))
    assert calls == ["dequantize", "dequantize", "dequantize_int4", "dequantize_int4"]
    monkeypatch.setenv("KVSTORE_KERNELS", "reference")  # the torch reference, by request
    codec = get_codec("int8")
    codec.decode(codec.encode(x), torch.empty_like(x))
    assert len(calls) == 4


def test_input_checks(module: object) -> None:
    data, scales = _int8((2, 4, 8), torch.float16, seed=1)
    with pytest.raises(ValueError, match="scales"):
        kernels.dequantize_int8(data, scales[:, :3], torch.empty((2, 4, 8)))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.dequantize_int8(data, scales, torch.empty((2, 4, 16))[..., ::2])
    packed = torch.zeros((2, 64), dtype=torch.uint8)
    int4_scales = torch.zeros((2, 4, 1), dtype=torch.float16)
    with pytest.raises(RuntimeError, match="power-of-two"):
        module.dequantize_int4(packed, int4_scales, torch.empty((2, 4, 24)), True)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="packed must be"):
        module.dequantize_int4(packed[:, :10], int4_scales, torch.empty((2, 4, 16)), False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="scales must be"):
        module.dequantize_int4(packed, int4_scales.float(), torch.empty((2, 4, 16)), False)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="even head_dim"):
        module.dequantize_int4(packed, int4_scales, torch.empty((2, 4, 15)), False)  # type: ignore[attr-defined]


def test_torch_path_where_not_built(module: object, monkeypatch: pytest.MonkeyPatch) -> None:
    # a machine without a compiler: loaded() is None, and every decode runs on torch, to the same values
    x = torch.randn((2, 2, 2, 4, 2, 64), generator=torch.Generator().manual_seed(3)).half()
    encoded = {name: get_codec(name).encode(x) for name in ("int8", "fp8", "int4-rot", "int4-norot")}
    fast = {name: get_codec(name).decode(rows, poisoned_like(x)) for name, rows in encoded.items()}
    monkeypatch.setattr(cpu_ext, "loaded", lambda: None)
    for name, rows in encoded.items():
        slow = get_codec(name).decode(rows, poisoned_like(x))
        if name == "int4-rot":  # the fast transform rounds differently: within a float16 step
            torch.testing.assert_close(slow, fast[name], rtol=2**-10, atol=1e-3)
        else:
            assert_same_bits(slow, fast[name], name)


def _layout(x: torch.Tensor) -> KVLayout:
    layers, _kv, block_size, heads, head_dim = x.shape[1:]
    return KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype=x.dtype)
