"""Mooncake-format traces: one JSON object a line, each request's prompt as ``hash_ids``.

A trace block id names a whole prefix (equal id = same content and same prefix), so each
request becomes one chain of kvstore block keys: the ids are fed to the real ``BlockHasher``
as the "tokens" of a layout with one token per block, so key ``i`` chains ids ``0..i``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstore.keys import BlockHasher, Namespace
from kvstore.layout import KVLayout

# The namespace only has to be fixed and distinct from real models: one trace block is one
# "token" (its hash id), the rest of the geometry is Llama-3-8B's and enters no computation.
TRACE_NAMESPACE = Namespace(
    "mooncake-trace/block-ids",
    KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=1, dtype=torch.float16),
)


class ReplayError(Exception):
    """Bad replay input (missing file, malformed line, bad option); the message says where."""


@dataclass
class Trace:
    """A loaded trace: per request, its chain of block keys, plus each key's parent."""

    path: str
    chains: list[list[bytes]]
    parents: dict[bytes, bytes | None] = field(repr=False)

    @property
    def num_requests(self) -> int:
        return len(self.chains)

    @property
    def num_blocks(self) -> int:
        """Prompt blocks over all requests: the denominator of every hit ratio."""
        return sum(len(chain) for chain in self.chains)


def _field_error(where: str, message: str) -> ReplayError:
    return ReplayError(f"{where}: {message}")


def parse_request(line: str, where: str) -> tuple[list[int], int | None]:
    """One trace line -> (hash_ids, input_length or None); ReplayError naming ``where``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _field_error(where, f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise _field_error(where, f"expected a JSON object, got {type(obj).__name__}")
    if "hash_ids" not in obj:
        raise _field_error(where, "missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < 1 << 32 for i in ids):
        raise _field_error(where, "'hash_ids' must be a list of integers in [0, 2**32)")
    length = obj.get("input_length")
    if length is not None and (type(length) is not int or length < 0):
        raise _field_error(where, f"'input_length' must be a non-negative integer, got {length!r}")
    return ids, length


def load_trace(path: str | Path, hasher: BlockHasher | None = None) -> Trace:
    """Read and validate a trace, then compute every request's key chain. Blank lines are skipped.

    Raises:
        ReplayError: the file cannot be read, a line is not valid JSON, a field is missing or
            has the wrong type, or the trace holds no request.
    """
    hasher = hasher or BlockHasher(TRACE_NAMESPACE)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReplayError(f"trace file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayError(f"cannot read trace {path}: {exc}") from None
    chains: list[list[bytes]] = []
    parents: dict[bytes, bytes | None] = {}
    canonical: dict[bytes, bytes] = {}  # one bytes object per key: dict lookups hit identity
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        ids, _ = parse_request(line, f"{path} line {lineno}")
        chain = [canonical.setdefault(k, k) for k in hasher.block_keys(ids)]
        for parent, key in zip([None, *chain], chain, strict=False):
            parents.setdefault(key, parent)
        chains.append(chain)
    if not chains:
        raise ReplayError(f"trace {path} holds no requests")
    return Trace(str(path), chains, parents)
