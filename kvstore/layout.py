"""KVLayout: the geometry of one model's KV cache, and so of one block in every tier.

A model whose layers all attend fully keeps every layer in one block: ``[num_layers, 2,
block_size, kv_heads, head_dim]``. A hybrid model (Gemma 3: five sliding-window layers to one
full) splits its layers into **KV groups** (``KVGroup``), each of one kind: full attention, or
a sliding window of W tokens. Every group has the same number of layer slots, ``num_layers``,
so every group's block has one shape and the tiers keep fixed-size slots; a block of group g
holds only group g's layers, under a key of its own (kvstore/keys.py, ``group_keys``). A hit
needs, per group, what its kind reads: full attention every block before the boundary, a
sliding window only the blocks covering the last W - 1 tokens (``KVGroup.window_blocks``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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

FULL = "full"  # full attention: a token attends to every token before it
SLIDING = "sliding"  # sliding window: a token attends to itself and the window - 1 tokens before it
GROUP_KINDS = (FULL, SLIDING)


@dataclass(frozen=True)
class KVGroup:
    """One KV group: model layers of one attention kind whose blocks are stored together.

    Attributes:
        kind: ``"full"`` or ``"sliding"``.
        layers: the model's layer indices in the group's layer slots, in slot order (fewer
            than ``KVLayout.num_layers`` where the group is padded: its last slots hold nothing).
        window: for ``"sliding"``, W: a token at position p attends to positions p - W + 1 ... p.
    """

    kind: str
    layers: tuple[int, ...]
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ConfigError(f"KVGroup.kind must be one of {list(GROUP_KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in self.layers):
            raise ConfigError(f"KVGroup.layers must be layer indices >= 0, at least one, got {self.layers!r}")
        if self.kind == SLIDING:
            if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
                raise ConfigError(f"a sliding KVGroup needs a window of at least 1 token, got {self.window!r}")
        elif self.window is not None:
            raise ConfigError(f"a {self.kind} KVGroup has no window, got {self.window!r}")

    def window_blocks(self, block_size: int) -> int | None:
        """Blocks a hit at a block boundary needs of this group, ending at the boundary: a
        sliding window's ``cdiv(W - 1, block_size)`` (the W - 1 tokens before the next one);
        None for full attention (every block before the boundary)."""
        if self.window is None:
            return None
        return -(-(self.window - 1) // block_size)

    def tag(self) -> str:
        """The group in a layout's fingerprint: ``f`` or ``s<W>``, then its layers."""
        kind = "f" if self.kind == FULL else f"s{self.window}"
        return f"{kind}:{','.join(map(str, self.layers))}"


@dataclass(frozen=True)
class KVLayout:
    """One block is ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``, contiguous.

    ``tp_rank``/``tp_size`` name this worker's shard under tensor parallelism: each rank stores
    its own heads, so they enter the namespace and never share keys. ``dtype`` is a torch
    dtype or its name (``"float16"``, as ``dtype_name`` gives it).

    ``groups`` (empty: one full-attention group of ``num_layers`` layers, today's layout): the
    model's KV groups, each at most ``num_layers`` layers (``num_layers`` is then the layer
    slots of one group's block, not the model's layer count). Groups name distinct layers.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.float16
    tp_rank: int = 0
    tp_size: int = 1
    groups: tuple[KVGroup, ...] = field(default=())

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
        groups = tuple(self.groups)
        object.__setattr__(self, "groups", groups)
        if any(not isinstance(g, KVGroup) for g in groups):
            raise ConfigError("KVLayout.groups must be KVGroups")
        layers = [i for g in groups for i in g.layers]
        if len(set(layers)) != len(layers):
            raise ConfigError(f"KVLayout.groups name a layer twice: {sorted(layers)}")
        too_big = [g.tag() for g in groups if len(g.layers) > self.num_layers]
        if too_big:
            raise ConfigError(f"KVLayout.groups {too_big} have more layers than a block's {self.num_layers} slots")

    @property
    def num_groups(self) -> int:
        """How many KV groups: 1 for a layout without ``groups`` (every layer in one)."""
        return max(1, len(self.groups))

    @property
    def is_hybrid(self) -> bool:
        """Whether blocks are per group (more than one group, or a sliding-window one)."""
        return len(self.groups) > 1 or any(g.kind != FULL for g in self.groups)

    def group(self, index: int) -> KVGroup:
        """KV group ``index``; for a layout without ``groups``, one full group of every layer."""
        if not self.groups:
            if index != 0:
                raise IndexError(f"group {index} of a layout with one group")
            return KVGroup(FULL, tuple(range(self.num_layers)))
        return self.groups[index]

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """Every KV group (one full group of every layer for a layout without ``groups``)."""
        return self.groups or (self.group(0),)
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
        """A stable text naming everything that makes two layouts' bytes incompatible (a layout
        without ``groups`` keeps the text it had before groups existed)."""
        text = (
            f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-B{self.block_size}"
            f"-{self.dtype_name}-tp{self.tp_rank}of{self.tp_size}"
        )
        if self.groups:
            text += "-G" + "/".join(g.tag() for g in self.groups)
        return text

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


def group_layers(kinds: Sequence[tuple[str, int | None]]) -> tuple[int, tuple[KVGroup, ...]]:
    """The KV groups of a model whose layer i has attention ``kinds[i] = (kind, window)``:
    ``(layer slots per group, groups)``, or ``(num_layers, ())`` when every layer attends fully.

    Layers of one (kind, window) form groups of equal size: the smallest such count, or the
    largest where it is under 1.5x the smallest (less padding); a count that does not divide
    leaves its last group padded. Within a kind, layers are dealt to its groups in turn
    (Gemma 3's sliding layers 0-4, 6-10, 12-16 make groups (0, 6, 12), (1, 7, 13), ...).
    """
    if not kinds:
        raise ConfigError("a model has at least one layer")
    by_kind: dict[tuple[str, int | None], list[int]] = {}
    for i, spec in enumerate(kinds):
        by_kind.setdefault(spec, []).append(i)
    if list(by_kind) == [(FULL, None)]:
        return len(kinds), ()
    counts = [len(v) for v in by_kind.values()]
    size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    groups: list[KVGroup] = []
    for (kind, window), members in by_kind.items():
        num = -(-len(members) // size)
        for g in range(num):
            groups.append(KVGroup(kind, tuple(members[g::num]), window))
    return max(len(g.layers) for g in groups), tuple(groups)
