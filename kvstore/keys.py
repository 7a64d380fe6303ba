"""Hash-chained block keys: one key names a whole prefix.

``key_i = H(BLOCK_TAG || key_{i-1} || tokens of block i || extra keys of block i)``; the chain's
root is derived from the namespace (model id, KV layout, hash algorithm, format version) and the
tenant salt, so different models, layouts or tenants never share a key. The byte-exact recipe
and test vectors are in docs/key-format.md; change nothing here without bumping FORMAT_VERSION.

A layout with several KV groups (kvstore/layout.py) stores each group's block of a prefix
under a key of its own: ``H(GROUP_TAG || key_i || u32 group)`` (``group_keys``). With one group
the chain's keys are the group's: every layout without groups keeps its keys.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvstore.errors import ConfigError
from kvstore.layout import KVLayout

FORMAT_VERSION = 1
NAMESPACE_TAG = b"kvstore/namespace/v1\x00"
ROOT_TAG = b"kvstore/root/v1\x00"
BLOCK_TAG = b"kvstore/block/v1\x00"
GROUP_TAG = b"kvstore/group/v1\x00"

ExtraKey = bytes | str | int
BlockKey = bytes


_SHA256_BASE = hashlib.sha256()


def _sha256(data: bytes) -> bytes:
    # Copying an initialised context skips OpenSSL's per-call algorithm fetch (~2x per block).
    h = _SHA256_BASE.copy()
    h.update(data)
    return h.digest()


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


# name -> (digest function, digest length). xxh3_128 is NOT collision resistant against an
# adversary: use it only where every prompt comes from one trusted tenant.
HASHES = {"sha256": (_sha256, 32), "xxh3_128": (_xxh3_128, 16)}
_SHA256_BLOCK_BASE = hashlib.sha256(BLOCK_TAG)
_NO_EXTRAS = struct.pack("<I", 0)


def _lp(data: bytes) -> bytes:
    """Length-prefixed bytes: u32 little-endian length, then the bytes."""
    return struct.pack("<I", len(data)) + data


def encode_extra(item: ExtraKey) -> bytes:
    """One typed extra key: a tag byte (b for bytes, s for UTF-8 text, i for int64) + lp(body)."""
    if isinstance(item, bool):
        raise TypeError("extra keys must be bytes, str or int, not bool")
    if isinstance(item, bytes):
        return b"b" + _lp(item)
    if isinstance(item, str):
        return b"s" + _lp(item.encode("utf-8"))
    if isinstance(item, int):
        if not -(1 << 63) <= item < 1 << 63:
            raise ValueError(f"int extra keys must fit in int64, got {item}")
        return b"i" + _lp(struct.pack("<q", item))
    raise TypeError(f"extra keys must be bytes, str or int, got {type(item).__name__}")


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes; ValueError for ids outside [0, 2**32)."""
    if isinstance(token_ids, list | tuple):
        # array.array converts a Python list ~4x faster than numpy and range-checks each id.
        try:
            packed = array.array("I", token_ids)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
        if packed.itemsize != 4:  # pragma: no cover - platforms where C unsigned int is not 32-bit
            return token_bytes(np.asarray(token_ids))
        if sys.byteorder != "little":  # pragma: no cover
            packed.byteswap()
        return packed.tobytes()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise ValueError(f"token ids must lie in [0, 2**32), got min {arr.min()} max {arr.max()}")
    return arr.astype("<u4", copy=False).tobytes()


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two caches' blocks incompatible: model, KV layout, hash, format."""

    model_id: str
    layout: KVLayout
    hash_algo: str = "sha256"
    format_version: int = FORMAT_VERSION
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError(f"model_id must be a non-empty string, got {self.model_id!r}")
        if not isinstance(self.format_version, int) or isinstance(self.format_version, bool) or not (
            0 <= self.format_version < 1 << 32
        ):
            raise ConfigError(f"format_version must be an int in [0, 2**32), got {self.format_version!r}")
        if self.hash_algo not in HASHES:
            raise ConfigError(f"hash_algo must be one of {sorted(HASHES)}, got {self.hash_algo!r}")
        body = (
            NAMESPACE_TAG
            + _lp(self.model_id.encode("utf-8"))
            + _lp(self.layout.fingerprint().encode("ascii"))
            + _lp(self.hash_algo.encode("ascii"))
            + struct.pack("<I", self.format_version)
        )
        # The namespace digest is always SHA-256, whatever the block hash.
        object.__setattr__(self, "digest", _sha256(body))

    @property
    def id(self) -> str:
        """Short printable id of the namespace (first 16 hex digits of its digest)."""
        return self.digest.hex()[:16]


class BlockHasher:
    """Computes chained keys for one namespace. Thread-safe; caches one root per tenant."""

    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.block_size = namespace.layout.block_size
        self._hash, self.key_bytes = HASHES[namespace.hash_algo]
        self._roots: dict[str, bytes] = {}

    def root(self, tenant: str = "") -> bytes:
        """The parent of a chain's first block: H(ROOT_TAG || namespace digest || lp(tenant))."""
        if not isinstance(tenant, str):  # before the dict lookup: a list would fail as "unhashable"
            raise TypeError(f"tenant must be a str, got {type(tenant).__name__}")
        root = self._roots.get(tenant)
        if root is None:
            root = self._hash(ROOT_TAG + self.namespace.digest + _lp(tenant.encode("utf-8")))
            self._roots[tenant] = root
        return root

    def block_keys(
        self,
        token_ids: Sequence[int] | np.ndarray,
        tenant: str = "",
        extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
        parent: bytes | None = None,
    ) -> list[BlockKey]:
        """One key per full block of ``token_ids``; a trailing partial block gets none.

        Args:
            token_ids: the prompt (or continuation) token ids.
            tenant: the tenant salt, set by whoever authenticated the caller.
            extra_keys: per full block, a sequence of extra keys (LoRA name, multimodal
                digests) or None; shorter lists mean no extras for the remaining blocks.
            parent: continue an existing chain after this key instead of the tenant root.
        """
        if parent is not None and (not isinstance(parent, bytes) or len(parent) != self.key_bytes):
            size = len(parent) if isinstance(parent, bytes | bytearray | str) else "?"
            raise ValueError(
                f"parent must be {self.key_bytes} bytes (a key of this namespace), "
                f"got {type(parent).__name__} of length {size}"
            )
        raw = token_bytes(token_ids)
        num_blocks = len(raw) // (4 * self.block_size)
        if extra_keys is not None and len(extra_keys) > num_blocks:
            raise ValueError(f"{len(extra_keys)} extra-key lists for {num_blocks} full blocks")
        stride = 4 * self.block_size
        count = struct.pack("<I", self.block_size)
        tails = [_NO_EXTRAS] * num_blocks
        for i, extras in enumerate(extra_keys or ()):
            if isinstance(extras, str | bytes):  # would silently mean one extra key per character
                raise TypeError(f"extra_keys[{i}] must be a sequence of extra keys, got {type(extras).__name__}")
            if extras:
                tails[i] = struct.pack("<I", len(extras)) + b"".join(encode_extra(e) for e in extras)
        key = self.root(tenant) if parent is None else parent
        keys: list[BlockKey] = []
        append = keys.append
        if self.namespace.hash_algo == "sha256" and all(t is _NO_EXTRAS for t in tails):
            # Hot path: every block's body (u32 count, tokens, u32 0) is built by one numpy
            # copy, so the loop does a context copy, one update and a digest: ~1 us a block.
            width = self.block_size + 2
            bodies = np.empty((num_blocks, width), dtype="<u4")
            bodies[:, 0] = self.block_size
            bodies[:, 1:-1] = np.frombuffer(raw, dtype="<u4", count=num_blocks * self.block_size).reshape(
                num_blocks, self.block_size
            )
            bodies[:, -1] = 0
            flat = bodies.tobytes()
            size = 4 * width
            chunks = [flat[start : start + size] for start in range(0, num_blocks * size, size)]
            new_context = _SHA256_BLOCK_BASE.copy  # already holds BLOCK_TAG
            for body in chunks:
                h = new_context()
                h.update(key + body)
                key = h.digest()
                append(key)
        else:
            digest = self._hash
            for i in range(num_blocks):
                key = digest(BLOCK_TAG + key + count + raw[i * stride : (i + 1) * stride] + tails[i])
                append(key)
        return keys

    def group_keys(self, keys: Sequence[bytes], group: int) -> list[BlockKey]:
        """The keys of KV group ``group``'s blocks of the prefixes ``keys`` name (chain keys of
        this namespace): ``keys`` themselves for a layout of one group, else one
        ``H(GROUP_TAG || key || u32 group)`` each.

        Raises:
            IndexError: ``group`` is not one of the layout's groups.
        """
        num_groups = self.namespace.layout.num_groups
        if not isinstance(group, int) or isinstance(group, bool) or not 0 <= group < num_groups:
            raise IndexError(f"group {group!r} is not one of the layout's {num_groups} KV groups")
        if num_groups == 1:
            return list(keys)
        digest, tail = self._hash, struct.pack("<I", group)
        return [digest(GROUP_TAG + key + tail) for key in keys]
