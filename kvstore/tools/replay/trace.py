"""Mooncake-format traces: one JSON object a line, each request's prompt as ``hash_ids``.

A trace block id names a whole prefix (equal id = same content and same prefix), so each
request becomes one chain of kvstore block keys: the ids are fed to the real ``BlockHasher``
as the "tokens" of a layout with one token per block, so key ``i`` chains ids ``0..i``.

Tenants: a line may name its ``tenant`` (a string). The shared Mooncake traces do not, so
``load_trace(..., tenants=N)`` derives N tenants deterministically: a request's
*conversation* is its first block id that at most half of the trace's requests share (the
conversation trace opens every prompt with one shared id, a system prompt), and the tenant is
``t<k>``, k = splitmix64(conversation) mod N; every turn of a conversation is one tenant's.
As in a real store, a tenant salts its chain: two tenants' blocks never meet, even where
their ids are equal.
"""

from __future__ import annotations

import json
from collections import Counter
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
    tenants: list[str] = field(default_factory=list, repr=False)  # per request ("" for all: none)
    owners: dict[bytes, str] = field(default_factory=dict, repr=False)  # key -> its tenant
    input_lengths: list[int | None] = field(default_factory=list, repr=False)  # per request, where given

    @property
    def tenant_names(self) -> list[str]:
        """The trace's tenants, sorted (``[""]`` when it has none)."""
        return sorted(set(self.tenants)) or [""]

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
    ids, length, _ = parse_line(line, where)
    return ids, length


def parse_line(line: str, where: str) -> tuple[list[int], int | None, str | None]:
    """One trace line -> (hash_ids, input_length or None, tenant or None); ReplayError naming
    ``where``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _field_error(where, f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise _field_error(where, "invalid JSON (nested too deeply)") from None
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
    tenant = obj.get("tenant")
    if tenant is not None:
        try:
            named = isinstance(tenant, str) and len(tenant.encode()) <= 255
        except UnicodeEncodeError:  # a lone surrogate: JSON's "\ud800"
            named = False
        if not named:
            raise _field_error(where, f"'tenant' must be a string of at most 255 UTF-8 bytes, got {tenant!r:.60}")
    return ids, length, tenant


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def derive_tenants(requests: list[list[int]], n: int) -> list[str]:
    """``t<k>`` per request: k = splitmix64(its conversation) mod ``n``, the conversation being
    its first id that at most half of the requests share (its last id if every one is
    shared more)."""
    shared = Counter(i for ids in requests for i in set(ids))
    half = len(requests) / 2
    out = []
    for ids in requests:
        conversation = next((i for i in ids if shared[i] <= half), ids[-1] if ids else 0)
        out.append(f"t{_splitmix64(conversation) % n}")
    return out


def load_trace(path: str | Path, hasher: BlockHasher | None = None, tenants: int | None = None) -> Trace:
    """Read and validate a trace, then compute every request's key chain (salted with its
    tenant). Blank lines are skipped. ``tenants``: derive that many tenants where the trace's
    lines name none (``derive_tenants``).

    Raises:
        ReplayError: the file cannot be read, a line is not valid JSON, a field is missing or
            has the wrong type, the trace holds no request, or ``tenants`` is given for a
            trace whose lines name tenants, or is below 1.
    """
    hasher = hasher or BlockHasher(TRACE_NAMESPACE)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReplayError(f"trace file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReplayError(f"cannot read trace {path}: {exc}") from None
    requests: list[list[int]] = []
    lengths: list[int | None] = []
    named: list[str | None] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        ids, length, tenant = parse_line(line, f"{path} line {lineno}")
        requests.append(ids)
        lengths.append(length)
        named.append(tenant)
    if not requests:
        raise ReplayError(f"trace {path} holds no requests")
    if tenants is not None:
        if tenants < 1:
            raise ReplayError(f"--tenants must be at least 1, got {tenants}")
        if any(t is not None for t in named):
            raise ReplayError(f"trace {path} names its tenants: leave --tenants out")
        owners_of = derive_tenants(requests, tenants)
    else:
        owners_of = [t or "" for t in named]
    chains: list[list[bytes]] = []
    parents: dict[bytes, bytes | None] = {}
    owners: dict[bytes, str] = {}
    canonical: dict[bytes, bytes] = {}  # one bytes object per key: dict lookups hit identity
    for ids, tenant in zip(requests, owners_of, strict=True):
        chain = [canonical.setdefault(k, k) for k in hasher.block_keys(ids, tenant)]
        for parent, key in zip([None, *chain], chain, strict=False):
            parents.setdefault(key, parent)
        if tenant:
            owners.update(dict.fromkeys(chain, tenant))
        chains.append(chain)
    return Trace(str(path), chains, parents, owners_of if any(owners_of) else [], owners, lengths)
