"""LevelCodec: how a level with a codec stores the raw blocks the cascade hands it.

The cascade moves *raw* blocks between levels: uint8 rows of the layout's ``bytes_per_block``
(the bytes a get returns). A level whose codec is not ``none`` encodes rows on write and
decodes them on read, so its medium holds ``stored_bytes`` per block: the encoded size,
rounded up to the medium's alignment. Codecs whose sizes round alike then share a slab, and
each block's own header says which one wrote it (docs/storage-format.md, "Codecs").

Rows are grouped into runs that sit at equal distances in memory (adjacent slots of a pool,
rows of one tensor), and each run is one codec call, so a prefix costs a few vectorised calls,
not one per block.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from kvstore.codecs import CODECS, Codec, codec_for_header, get_codec, stored_bytes
from kvstore.codecs.header import HEADER_BYTES, BlockHeader
from kvstore.errors import CodecFormatError, LayoutMismatchError
from kvstore.kernels.pages import SCALE_BYTES, pack_rows, unpack_rows
from kvstore.layout import KVLayout


class LevelCodec:
    """A lossy codec bound to one layout and one medium's alignment.

    Attributes:
        codec: the codec new blocks are written with.
        raw_bytes: bytes of a raw block (what the cascade hands over and gets back).
        stored_bytes: bytes the medium stores per block.
        num_refused: blocks whose header no codec here reads (counted misses).
    """

    def __init__(self, codec: Codec, layout: KVLayout, align: int = 1, pages: torch.dtype | None = None) -> None:
        """``layout`` is the store's; with ``pages`` (the code dtype of quantized device pages,
        kvstore/kernels/pages.py) its blocks are such pages, and this codec stores the values
        they decode to: converted once on the way in, and quantized into pages again on the
        way out."""
        assert codec.lossy, "a raw level needs no LevelCodec"
        codec.prepare()
        self.codec = codec
        self.pages = pages
        self.page_layout = layout
        # what the codec encodes: the blocks themselves, or the pages' values (float32)
        self.layout = layout if pages is None else replace(
            layout, head_dim=layout.head_dim - SCALE_BYTES, dtype=torch.float32)
        self.raw_bytes = layout.bytes_per_block
        self.encoded_bytes = codec.encoded_bytes(self.layout)
        self.stored_bytes = stored_bytes(codec, self.layout, align)
        self.num_refused = 0
        self._lock = threading.Lock()

    @staticmethod
    def sibling_sizes(layout: KVLayout, align: int) -> set[int]:
        """The stored sizes of every codec for ``layout``: a medium found holding one of them
        holds this layout's blocks under another codec. (Codecs that cannot encode the layout,
        such as the 8-bit ones for a pool's quantized pages, have no size for it.)"""
        sizes = set()
        for name in CODECS:
            try:
                sizes.add(stored_bytes(get_codec(name), layout, align))
            except LayoutMismatchError:
                continue
        return sizes

    def describe(self) -> dict[str, Any]:
        info = {**self.codec.describe(), "block_bytes": self.stored_bytes}
        if self.pages is not None:
            info["converts_pages"] = str(self.pages).removeprefix("torch.")
        return info

    def check_encodable(self, blocks: torch.Tensor) -> None:
        """Raise CodecError for blocks this codec could not store (see Codec.check_encodable)."""
        self.codec.check_encodable(self._values(blocks) if self.pages is not None else blocks)

    def encode(self, payloads: torch.Tensor | Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
        """Encode raw rows ``payloads[i]`` into ``dst[i]`` (uint8, at least ``stored_bytes``),
        zeroing the padding up to ``stored_bytes``.

        Raises:
            CodecError: a block the codec cannot encode (NaN/Inf, scale out of range).
        """
        sources = _rows(payloads, self.raw_bytes)
        targets = _rows(dst, self.stored_bytes)
        for start, count, target in _runs(targets, self.stored_bytes):
            for offset, length, source in _runs(sources[start : start + count], self.raw_bytes):
                rows = target[offset : offset + length]
                self.codec.encode(self._encodable(source), out=rows[:, : self.encoded_bytes])
                rows[:, self.encoded_bytes :].zero_()

    def decode(self, src: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Decode stored rows ``src[i]`` into raw rows ``outs[i]`` (at least ``raw_bytes``).

        A row is decoded by the codec its header names (so blocks an earlier configuration
        wrote still read), provided its geometry and dtype are this layout's and it fits the
        stored size.

        Returns:
            Per row, True when ``outs[i]`` holds the decoded block; False when its header is
            refused (counted in ``num_refused``; ``outs[i]`` is then unspecified).
        """
        sources = _rows(src, self.stored_bytes)
        flags = [False] * len(sources)
        for start, _count, rows in _runs(sources, self.stored_bytes):
            encoded = rows[:, : self.encoded_bytes]
            ok = self.codec.readable(encoded, self.layout).tolist()
            good = [i for i, flag in enumerate(ok) if flag]
            for first, length in _spans(good):
                targets = outs[start + first : start + first + length]
                for offset, n, out in _runs(_rows(targets, self.raw_bytes), self.raw_bytes):
                    lo = first + offset
                    self._decode_into(self.codec, encoded[lo : lo + n], out)
                for i in range(first, first + length):
                    flags[start + i] = True
            for i, flag in enumerate(ok):
                if not flag:
                    flags[start + i] = self._decode_foreign(rows[i], outs[start + i])
        if not all(flags):
            with self._lock:  # reader threads decode at once
                self.num_refused += flags.count(False)
        return flags

    def _decode_foreign(self, row: torch.Tensor, out: torch.Tensor) -> bool:
        """Decode a row another codec wrote, if its header names one that reads it here."""
        try:
            header = BlockHeader.unpack(bytes(row[:HEADER_BYTES].numpy()))
            codec = codec_for_header(header)
            size = codec.encoded_bytes(self.layout)
            if size > row.shape[0]:
                return False
            self._decode_into(codec, row[:size].unsqueeze(0), out[: self.raw_bytes].unsqueeze(0))
        except CodecFormatError:
            return False
        return True

    def _blocks(self, rows: torch.Tensor) -> torch.Tensor:
        """Raw uint8 rows ``[n, >= raw_bytes]`` viewed as ``[n, *block_shape]`` blocks of the store."""
        layout = self.page_layout
        return rows[:, : self.raw_bytes].view(layout.dtype).view(rows.shape[0], *layout.block_shape)

    def _values(self, pages: torch.Tensor) -> torch.Tensor:
        """Page blocks ``[n, *page block_shape]`` decoded: float32 ``[n, *self.layout.block_shape]``."""
        assert self.pages is not None
        n = pages.shape[0]
        rows = pages.reshape(-1, self.page_layout.num_kv_heads, self.page_layout.head_dim)
        return unpack_rows(rows, self.pages).view(n, *self.layout.block_shape)

    def _encodable(self, rows: torch.Tensor) -> torch.Tensor:
        """What the codec encodes of raw rows: the blocks, or the values of pages (a conversion)."""
        blocks = self._blocks(rows)
        return blocks if self.pages is None else self._values(blocks)

    def _decode_into(self, codec: Codec, encoded: torch.Tensor, out_rows: torch.Tensor) -> None:
        """Decode ``encoded`` rows into raw rows ``out_rows``: the blocks, or values quantized
        into pages again."""
        if self.pages is None:
            codec.decode(encoded, self._blocks(out_rows))
            return
        values = torch.empty((encoded.shape[0], *self.layout.block_shape), dtype=torch.float32)
        codec.decode(encoded, values)
        heads, head_dim = self.layout.num_kv_heads, self.layout.head_dim
        packed = pack_rows(values.view(-1, heads, head_dim), self.pages)
        self._blocks(out_rows).copy_(packed.view(out_rows.shape[0], *self.page_layout.block_shape))


def aligned_rows(n: int, width: int, align: int = 4096) -> torch.Tensor:
    """A new uint8 ``[n, width]`` whose rows start on ``align``-byte addresses (``width`` a
    multiple of it): staging a medium reads and writes in place with O_DIRECT."""
    assert width % align == 0, f"row width {width} is not a multiple of {align}"
    buf = torch.empty(n * width + align, dtype=torch.uint8)
    start = -buf.data_ptr() % align
    return buf[start : start + n * width].view(n, width)


def _rows(rows: torch.Tensor | Sequence[torch.Tensor], width: int) -> list[torch.Tensor]:
    """1-D uint8 rows of at least ``width`` bytes, each cut to ``width``."""
    out = list(rows)
    for row in out:
        if row.dtype != torch.uint8 or row.dim() != 1 or row.shape[0] < width or row.device.type != "cpu":
            raise ValueError(f"rows must be CPU uint8 vectors of at least {width} bytes, got "
                             f"{row.dtype} {tuple(row.shape)} on {row.device}")
    return [row if row.shape[0] == width else row[:width] for row in out]


def _runs(rows: list[torch.Tensor], width: int) -> list[tuple[int, int, torch.Tensor]]:
    """Split ``rows`` into runs at one stride in memory: ``(start, count, view [count, width])``."""
    runs: list[tuple[int, int, torch.Tensor]] = []
    ptrs = [row.data_ptr() for row in rows]
    bases = [row.untyped_storage().data_ptr() for row in rows]
    i = 0
    while i < len(rows):
        j, stride = i + 1, width
        if j < len(rows) and bases[j] == bases[i] and ptrs[j] - ptrs[i] >= width:
            stride = ptrs[j] - ptrs[i]
            while j < len(rows) and bases[j] == bases[i] and ptrs[j] - ptrs[j - 1] == stride:
                j += 1
        runs.append((i, j - i, rows[i].as_strided((j - i, width), (stride, 1))))
        i = j
    return runs


def _spans(indices: list[int]) -> list[tuple[int, int]]:
    """Consecutive stretches of sorted ``indices``: ``(first, length)``."""
    spans: list[tuple[int, int]] = []
    for i in indices:
        if spans and spans[-1][0] + spans[-1][1] == i:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((i, 1))
    return spans
