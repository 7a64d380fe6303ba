"""PrefixIndex: block key -> {replica: tiers holding it}, and the per-replica prefix query.

Fed by the replicas' KV events (``stored``/``removed``/``cleared``, one call per event) and by
the router's own routing history (the ``ROUTED`` bit, see history.py). One ``KeyTable``
column per replica, one bit per tier in it. Not thread-safe: the Router serialises calls.

A hybrid model's KV groups (kvstore/layout.py) store their blocks under keys of their own, so
the index holds every group's keys like any others; ``match`` with ``windows`` reconciles a
prompt's groups into one hit per replica (kvstore/events/groups.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.events.groups import needed, reconciled_hits
from kvstore.services.router.policy.keytable import KeyTable, key_ids
from kvstore.services.router.policy.tiers import (
    BITS,
    GPU,
    MEDIA,
    REMOTE,
    ROUTED,
    ROUTED_BITS,
    ROUTED_OLD_BIT,
    TIERS,
    TierWeights,
    medium_bit,
)

NO_TIER = len(TIERS)  # a tier index meaning "none": the block is not held (or not in the hit)


@dataclass(frozen=True)
class PrefixMatches:
    """What each replica holds of one prompt's block chain (arrays in ``replicas`` order).

    Attributes:
        replicas: the replicas asked about.
        num_blocks: per replica, the leading run of the chain it holds in any tier (or guess).
        saved_blocks: per replica, that run weighted by each block's best tier.
        by_tier: per replica, the run's blocks counted by best tier, columns in TIERS order.
    """

    replicas: tuple[str, ...]
    num_blocks: np.ndarray
    saved_blocks: np.ndarray
    by_tier: np.ndarray

    def tiers_of(self, i: int) -> dict[str, int]:
        """Replica ``i``'s run split by best tier (only tiers with blocks)."""
        return {t: int(n) for t, n in zip(TIERS, self.by_tier[i], strict=True) if n}


class PrefixIndex:
    """Which replica holds which block in which tier; memory ~(8 + replicas) bytes / 0.35-0.7."""

    def __init__(self, weights: TierWeights | None = None) -> None:
        self._table = KeyTable(num_columns=1)
        self._columns: dict[str, int] = {}
        self._spare_columns: list[int] = [0]
        self._counts: dict[str, np.ndarray] = {}  # replica -> blocks per medium (MEDIA order)
        self.set_weights(weights or TierWeights())

    def set_weights(self, weights: TierWeights) -> None:
        self.weights = weights
        self._weight_of, self._tier_of = weights.tables()
        by_medium = weights.by_medium()
        self._tier_weight = np.array([by_medium[t] for t in TIERS] + [0.0])  # tier index -> weight
        # tier index -> how slow it is (lower weight = slower; between equal weights, the later
        # tier: a guess (ROUTED) is slower than a device block); NO_TIER is never needed
        order = sorted(range(len(TIERS)), key=lambda t: (-self._tier_weight[t], t))
        self._slowness = np.zeros(len(TIERS) + 1, dtype=np.int64)
        self._slowness[order] = np.arange(len(TIERS))
        self._slowness[NO_TIER] = -1
        self._tier_by_slowness = np.array(order, dtype=np.int64)

    # -- replicas --------------------------------------------------------------------------
    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(self._columns)

    def add_replica(self, replica: str) -> None:
        """Start tracking ``replica`` (idempotent)."""
        if replica in self._columns:
            return
        column = self._spare_columns.pop() if self._spare_columns else self._table.add_column()
        self._columns[replica] = column
        self._counts[replica] = np.zeros(len(MEDIA), dtype=np.int64)

    def remove_replica(self, replica: str) -> None:
        """Forget ``replica`` and everything it held; unknown names are ignored."""
        column = self._columns.pop(replica, None)
        if column is None:
            return
        self._table.clear_column(column)
        del self._counts[replica]
        self._spare_columns.append(column)

    def _column(self, replica: str) -> int:
        try:
            return self._columns[replica]
        except KeyError:
            raise KeyError(f"replica {replica!r} is not in the index; known: {sorted(self._columns)}") from None

    # -- updates (events) ------------------------------------------------------------------
    def stored(self, replica: str, keys: Sequence[bytes], medium: str) -> int:
        """``keys`` now live in ``medium`` on ``replica``; returns how many were new there."""
        return self._set(replica, key_ids(keys), medium_bit(medium))

    def removed(self, replica: str, keys: Sequence[bytes], medium: str) -> int:
        """``keys`` left ``medium`` on ``replica`` (unknown keys ignored); returns how many."""
        return self._clear(replica, key_ids(keys), medium_bit(medium))

    def cleared(self, replica: str, medium: str | None = None) -> None:
        """``replica`` holds nothing (in ``medium``, or in any tier); its guesses stay."""
        bits = medium_bit(medium) if medium is not None else sum(BITS[m] for m in MEDIA)
        self._table.clear_column(self._column(replica), bits)
        for i, medium in enumerate(MEDIA):
            if BITS[medium] & bits:
                self._counts[replica][i] = 0

    # -- the router's guesses (history.py owns their lifetime) -----------------------------
    def routed(self, replica: str, ids: np.ndarray) -> int:
        """Guess that ``replica`` holds ``ids`` (current generation); returns how many are new."""
        before = self._table.set_bits(ids, self._column(replica), BITS[ROUTED])
        return int(np.count_nonzero((before & ROUTED_BITS) == 0))

    def age_routed(self, replica: str) -> int:
        """One generation passes: the previous one's guesses go, the current one's become old."""
        return self._table.rotate_column(self._column(replica), BITS[ROUTED], ROUTED_OLD_BIT)

    def clear_routed(self, replica: str) -> None:
        self._table.clear_column(self._column(replica), ROUTED_BITS)

    def _set(self, replica: str, ids: np.ndarray, bit: int) -> int:
        before = self._table.set_bits(ids, self._column(replica), bit)
        added = int(np.count_nonzero((before & bit) == 0))
        self._counts[replica][MEDIA.index(_tier(bit))] += added
        return added

    def _clear(self, replica: str, ids: np.ndarray, bit: int) -> int:
        before = self._table.clear_bits(ids, self._column(replica), bit)
        gone = int(np.count_nonzero(before & bit))
        self._counts[replica][MEDIA.index(_tier(bit))] -= gone
        return gone

    # -- queries ---------------------------------------------------------------------------
    def match(self, ids: np.ndarray, replicas: Sequence[str] | None = None,
              shared_remote: bool = False, windows: Sequence[int | None] | None = None) -> PrefixMatches:
        """Per replica, the leading run of ``ids`` (a chain, root first) it holds. Pure query.

        With ``shared_remote`` the replicas share one remote tier: a block any replica
        published in ``REMOTE`` counts as in ``REMOTE`` for all of them.

        With ``windows`` (a hybrid model's KV groups: per group ``window_blocks``, None for full
        attention), ``ids`` is ``[groups, blocks]``, each group's keys of the chain, and the run
        is the reconciled hit: the longest boundary at which every group holds what it needs
        (full groups every block before it, sliding groups the window ending at it). Each block
        of the hit counts in the slowest tier among the group blocks the hit reads at its
        position (a position is served once all of them arrived); a position no group reads
        (below every window of a model without a full group) costs no fetch and counts as a
        device block.
        """
        names = tuple(self._columns) if replicas is None else tuple(replicas)
        columns = [self._column(r) for r in names]
        every = self._table.rows(self._table.find(ids.ravel()))
        rows = every[:, columns]  # [blocks (of every group), replicas]
        if shared_remote:
            remote = np.uint8(BITS[REMOTE])
            rows |= np.where((every & remote).any(axis=1), remote, np.uint8(0))[:, None]
        if windows is not None:
            return self._reconciled(names, rows.reshape(*ids.shape, len(names)), windows)
        run = np.logical_and.accumulate(rows != 0, axis=0)
        tiers = np.where(run, self._tier_of[rows], len(TIERS))
        by_tier = (tiers[:, :, None] == np.arange(len(TIERS))).sum(axis=0)
        return PrefixMatches(names, run.sum(axis=0), (self._weight_of[rows] * run).sum(axis=0), by_tier)

    def _reconciled(self, names: tuple[str, ...], rows: np.ndarray, windows: Sequence[int | None]) -> PrefixMatches:
        """``match`` over a hybrid model's groups: ``rows`` is ``[groups, blocks, replicas]``."""
        num_blocks = rows.shape[1]
        hits = reconciled_hits(rows != 0, windows)  # [replicas]
        reads = needed(num_blocks, hits, windows)  # [groups, blocks, replicas]
        slowness = np.where(reads, self._slowness[self._tier_of[rows]], -1).max(axis=0)  # [blocks, replicas]
        in_hit = np.arange(num_blocks)[:, None] < hits[None, :]
        tiers = np.where(slowness >= 0, self._tier_by_slowness[np.maximum(slowness, 0)], TIERS.index(GPU))
        tiers = np.where(in_hit, tiers, NO_TIER)
        by_tier = (tiers[:, :, None] == np.arange(len(TIERS))).sum(axis=0)
        return PrefixMatches(names, hits, self._tier_weight[tiers].sum(axis=0), by_tier)

    def num_blocks(self, replica: str) -> dict[str, int]:
        """Blocks indexed for ``replica``, per medium, and ``ROUTED``: the router's live guesses
        (a scan of the replica's column, ~1 ms per million blocks)."""
        column = self._column(replica)
        counts = {m: int(n) for m, n in zip(MEDIA, self._counts[replica], strict=True)}
        return counts | {ROUTED: self._table.column_counts(column, ROUTED_BITS)}

    def held_ids(self, replica: str, medium: str) -> np.ndarray:
        """The ids (``key_ids``) indexed for ``replica`` in ``medium``: a full scan, for checks."""
        return self._table.ids_with(self._column(replica), BITS[medium])

    def __len__(self) -> int:
        """Distinct blocks indexed (in any tier of any replica, guesses included)."""
        return len(self._table)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes

    def check_integrity(self) -> None:
        """Assert the per-tier counts equal a full scan, and the table's own invariants."""
        self._table.check_integrity()
        for replica, column in self._columns.items():
            for i, medium in enumerate(MEDIA):
                scanned = self._table.column_counts(column, BITS[medium])
                assert scanned == self._counts[replica][i], (
                    f"{replica} {medium}: counted {self._counts[replica][i]}, scan finds {scanned}")


def _tier(bit: int) -> str:
    return TIERS[bit.bit_length() - 1]
