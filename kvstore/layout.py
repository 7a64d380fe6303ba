"""KVLayout: the geometry of one model's KV cache, and so of one block in every tier."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError, LayoutMismatchError

# dtype <-> stable name; the name (not torch's repr) enters key namespaces and disk catalogs.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class KVLayout:
    """One block is ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``, contiguous.

    ``tp_rank``/``tp_size`` name this worker's shard under tensor parallelism: each rank stores
    its own heads, so they enter the namespace and never share keys. ``dtype`` is a torch
    dtype or its name (``"float16"``, as ``dtype_name`` gives it).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float16
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive int, got {value!r}")
        # bool is an int, but True would fingerprint as "tpTrue" while comparing equal to 1.
        if not isinstance(self.tp_rank, int) or isinstance(self.tp_rank, bool) or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"KVLayout.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        if isinstance(self.dtype, str) and self.dtype in DTYPES_BY_NAME:
            object.__setattr__(self, "dtype", DTYPES_BY_NAME[self.dtype])
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"KVLayout.dtype must be one of {sorted(DTYPE_NAMES.values())} (a torch dtype or "
                              f"its name), got {self.dtype!r}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES[self.dtype]

    @property
    def elements_per_block(self) -> int:
        return math.prod(self.block_shape)

    @property
    def bytes_per_block(self) -> int:
        return self.elements_per_block * self.dtype.itemsize

    def fingerprint(self) -> str:
        """A stable text naming everything that makes two layouts' bytes incompatible."""
        return (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-B{self.block_size}"
            f"-{self.dtype_name}-tp{self.tp_rank}of{self.tp_size}"
        )

    def check_blocks(self, blocks: torch.Tensor, num_blocks: int | None = None) -> None:
        """Raise LayoutMismatchError unless ``blocks`` is ``[n, *block_shape]`` of this dtype."""
        if not isinstance(blocks, torch.Tensor):
            raise LayoutMismatchError(f"blocks must be a torch.Tensor, got {type(blocks).__name__}")
        if blocks.dtype != self.dtype:
            raise LayoutMismatchError(f"blocks have dtype {blocks.dtype}, layout wants {self.dtype}")
        if tuple(blocks.shape[1:]) != self.block_shape or blocks.dim() != 1 + len(self.block_shape):
            raise LayoutMismatchError(
                f"blocks have shape {tuple(blocks.shape)}, layout wants [n, {', '.join(map(str, self.block_shape))}]"
            )
        if num_blocks is not None and blocks.shape[0] != num_blocks:
            raise LayoutMismatchError(f"got {blocks.shape[0]} blocks for {num_blocks} keys")

    def _plain(self, blocks: object, num_blocks: int) -> bool:
        """Whether ``blocks`` is a contiguous CPU ``torch.Tensor`` (no subclass) of
        ``num_blocks`` of this layout's blocks: the common case, told in a few attribute reads
        (the full checks cost more than a get's index lookups); anything else takes them."""
        return type(blocks) is torch.Tensor and blocks.dtype is self.dtype and blocks.is_cpu \
            and blocks.is_contiguous() and blocks.shape == (num_blocks, *self.block_shape)

    def input_blocks(self, blocks: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """``blocks`` checked (``[num_blocks, *block_shape]`` of this dtype, on any device) as
        the blocks a put stores: contiguous, on the CPU, with no autograd history; ``blocks``
        itself when it is that already, else a copy."""
        if self._plain(blocks, num_blocks) and not blocks.requires_grad:
            return blocks
        self.check_blocks(blocks, num_blocks)
        return blocks.detach().to("cpu").contiguous()

    def output_blocks(self, num_blocks: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The CPU tensor a ``get`` fills: ``out`` checked (this layout, contiguous, CPU), or a
        new ``[num_blocks, *block_shape]`` tensor."""
        if out is None:
            return torch.empty((num_blocks, *self.block_shape), dtype=self.dtype)
        if self._plain(out, num_blocks):
            return out
        self.check_blocks(out, num_blocks)
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("get(out=...) needs a contiguous CPU tensor; use fetch() for devices")
        return out


def raw_rows(blocks: torch.Tensor) -> torch.Tensor:
    """Contiguous blocks ``[n, ...]`` of any dtype viewed as ``[n, bytes per block]`` uint8 rows
    (no copy; uint8 rows come back as they are)."""
    return blocks if blocks.dtype == torch.uint8 and blocks.dim() == 2 else blocks.view(torch.uint8).flatten(1)
