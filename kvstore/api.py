"""BlockStore: the one store contract, and what every store implements exactly.

Three stores implement it: ``TieredStore`` (embedded, in this process), ``StoreClient`` (a
connection to ``kvstore serve``) and the vLLM connector's ``GuardedStore`` (either of those
behind a guard that turns failures into misses). The engine, the connector and the router are
typed against this Protocol, so any of them runs on any store.

What differs between them is said here once:

- **Tenants.** ``block_keys(tokens, tenant)`` salts the chain with ``tenant``. On a daemon
  connection the empty tenant is the token's tenant (the daemon files every key under it as
  well, so two tokens share nothing whatever keys they send); embedded, it is ``""``.
- **Lossy copies.** A tier with a lossy codec returns decoded values. ``TieredStore`` adds
  ``exact=`` to lookup, get and fetch to refuse those; the daemon protocol does not carry it,
  so the contract does not either.
- **Failures.** ``GuardedStore`` never raises a store failure: a lookup is a miss, a fetch
  delivers nothing, a put is dropped and counted. The other two raise.
- **Management.** ``pin`` takes ``ttl_s`` (the pin ends by itself), ``prefetch`` warms host RAM
  and returns at once, ``inspect`` says where blocks are, ``delete`` takes ``descendants``.
  A daemon connection's pins also end when it closes. Forgetting a whole tenant
  (``forget_tenant``) is an operator's act, not an engine's: ``TieredStore`` and
  ``StoreClient`` have it, the contract does not.

``KeyChain`` is the part a router needs: the keys alone (``kvstore.keys.BlockHasher`` has it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from kvstore.keys import ExtraKey, Namespace
from kvstore.layout import KVLayout
from kvstore.results import BlockInfo, FetchHandle, PrefetchHandle, PrefixMatch

TokenIds = Sequence[int] | np.ndarray
ExtraKeys = Sequence[Sequence[ExtraKey] | None] | None

# The limits of one call, the same on every store (each a ValueError naming it, before any work).
MAX_KEYS = 1 << 16  # keys one prefetch or inspect may name (a daemon request's max_keys too)
MAX_PIN_TTL_S = 86400.0  # a pin's TTL is at most a day: pin again to hold longer


def check_count(what: str, n: int) -> None:
    """Refuse a ``what`` (a prefetch, an inspect) naming more than ``MAX_KEYS`` keys."""
    if n > MAX_KEYS:
        raise ValueError(f"a {what} names at most {MAX_KEYS} keys, got {n}; split it")


def check_ttl(ttl_s: object) -> float | None:
    """``ttl_s`` as seconds, or None (no deadline); ValueError naming the bounds otherwise."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not math.isfinite(ttl_s) \
            or not 0 < ttl_s <= MAX_PIN_TTL_S:
        raise ValueError(f"ttl_s must be a number of seconds > 0 and at most {MAX_PIN_TTL_S:.0f} (a day), "
                         f"got {ttl_s!r}")
    return float(ttl_s)


@runtime_checkable
class KeyChain(Protocol):
    """Computes the hash-chained block keys of a token sequence (docs/key-format.md)."""

    @property
    def namespace(self) -> Namespace:
        """What the keys hash in: model id, layout (its block size), hash, format."""
        ...

    def block_keys(self, token_ids: TokenIds, tenant: str = "", extra_keys: ExtraKeys = None,
                   parent: bytes | None = None) -> list[bytes]:
        """One key per full block of ``token_ids``, each chaining the one before it (``parent``:
        the key of the block before the first; None: the chain starts at the tenant's root).
        ``extra_keys[i]``: what else block i depends on (a LoRA, an image hash)."""
        ...

    def group_keys(self, keys: Sequence[bytes], group: int) -> list[bytes]:
        """The keys under which KV group ``group`` (kvstore/layout.py) stores its blocks of the
        prefixes ``keys`` name: ``keys`` themselves for a layout of one group. IndexError for a
        group the layout does not have."""
        ...


@runtime_checkable
class BlockStore(KeyChain, Protocol):
    """A KV block store: one namespace (model and layout), blocks named by their chain keys.

    Keys passed to one call are one chain in prefix order. Equal keys mean equal bytes: a put
    of a key already held only refreshes it.
    """

    @property
    def layout(self) -> KVLayout:
        """The KV geometry of every block."""
        ...

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor, *, tenant: str = "", group: int | None = None) -> None:
        """Store ``blocks[i]`` (``layout.block_shape``, ``layout.dtype``) under ``keys[i]``.
        ``tenant``: the one whose chain the keys are (it salted them). ``group``: the KV group
        the blocks are of (a hybrid model's; the keys are that group's, ``group_keys``): the
        tiers' KV events name it; None (any model of one group): not said."""
        ...

    def lookup(self, keys: Sequence[bytes]) -> PrefixMatch:
        """The leading run of ``keys`` held, and the fastest tier of each."""
        ...

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks under ``keys`` (into ``out`` when given); KeyError naming the first missing."""
        ...

    def fetch(self, keys: Sequence[bytes], into: torch.Tensor) -> FetchHandle:
        """Copy the leading run of held blocks into ``into`` (any device) in the background."""
        ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """For each key, whether some tier holds it (no promotion, no counters)."""
        ...

    def delete(self, keys: Sequence[bytes], *, descendants: bool = False) -> int:
        """Drop the blocks under ``keys`` from every tier; how many were held (CapacityError,
        nothing dropped, when one is pinned or being read). With ``descendants``, also every
        block the store knows to chain below one of them (a prefix's whole subtree); the
        remote tier is asked to drop those it was named. A block whose parent is gone is
        unreachable by any lookup from its chain's start either way."""
        ...

    def cool(self, keys: Sequence[bytes]) -> int:
        """Make the blocks of ``keys`` (one chain's, in prefix order) the next victims of every
        tier they are in, tails first: blocks that serve only rarer hits than the rest, such
        as a sliding-window group's blocks below the window of every boundary their chain was
        used at. A later read or put of one makes it a block like any other. Under the
        store's ``cold_blocks="drop"`` a cooled block is never written down the tiers. Returns
        how many of ``keys`` were held; unknown keys are skipped."""
        ...

    def pin(self, keys: Sequence[bytes], *, ttl_s: float | None = None) -> None:
        """Keep the blocks from being evicted until ``unpin`` (KeyError for one not held), and
        with ``ttl_s`` (seconds, in (0, 86400]) no longer than that: the pin ends by itself.
        Over a daemon connection every pin also ends when the connection does."""
        ...

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo the most recent ``pin`` of each key (ValueError for one not pinned)."""
        ...

    def prefetch(self, keys: Sequence[bytes]) -> PrefetchHandle:
        """Bring the blocks held in lower tiers up to host RAM ahead of a read; returns at once.
        ``result()`` is how many of ``keys`` host RAM holds once it is done. ValueError for
        more than 65,536 keys, before any work."""
        ...

    def inspect(self, keys: Sequence[bytes]) -> list[BlockInfo | None]:
        """Per key: which tiers hold its block, each copy's codec and stored size, its pins
        (None for a block no tier holds). At most 65,536 keys."""
        ...

    def stats(self) -> dict[str, dict[str, Any]]:
        """Counters per tier, by tier name."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the puts made so far are visible to every user of the store; True when done."""
        ...

    def close(self) -> None:
        """Release the store (an embedded one writes its host tier back to disk first)."""
        ...
