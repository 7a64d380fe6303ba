"""KeyTable: an open-addressing hash table from 64-bit block ids to one byte per replica.

The router's index must hold millions of blocks for many replicas in little memory and answer
a prompt's 100-odd keys in microseconds. A Python dict of bytes keys costs ~150 bytes an
entry; this table costs 8 bytes (the id) + one byte per replica column per slot, at a load
factor of at most 0.7, and every query is a handful of numpy calls over the whole batch.

Ids are the first 8 bytes of a block key (``key_ids``). Two keys sharing them (odds ~n^2/2^65)
would only make the router misjudge one replica's prefix, never serve wrong KV: a replica
checks full keys. Slots come from a multiplicative hash with a random odd multiplier chosen per
table, so prompts crafted to share low bits cannot cluster the probes. Linear probing,
WINDOW slots at a time; deleted slots become tombstones, reused by inserts and dropped by the next rebuild.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np

EMPTY = np.uint64(0)
TOMB = np.uint64(1)
MAX_LOAD = 0.7  # live + tombstones, as a fraction of the slots, before a rebuild
MIN_CAPACITY = 1024
WINDOW = 16  # slots probed per id per vectorised round
CHUNK = 1 << 16  # ids per round at most (bounds the [ids, WINDOW] temporaries)
_WINDOW = np.arange(WINDOW, dtype=np.int64)


def key_ids(keys: Sequence[bytes]) -> np.ndarray:
    """Block keys (equal length, at least 8 bytes) -> their uint64 ids (first 8 bytes, LE).

    Ids 0 and 1 are the table's empty and tombstone markers, so they are moved to 2 and 3.
    """
    if not keys:
        return np.empty(0, dtype=np.uint64)
    width = len(keys[0])
    if width < 8 or width % 8:
        raise ValueError(f"block keys must be a multiple of 8 bytes long (>= 8), got {width}")
    try:
        flat = np.frombuffer(b"".join(keys), dtype="<u8")
    except TypeError:
        raise TypeError("block keys must be bytes") from None
    if flat.size * 8 != width * len(keys):
        raise ValueError(f"block keys must all be {width} bytes long")
    ids = flat[:: width // 8].astype(np.uint64)
    ids[ids < 2] += np.uint64(2)
    return ids


class KeyTable:
    """uint64 id -> a row of ``num_columns`` uint8 bit masks (one column per replica).

    A row that becomes all zero frees its slot. Not thread-safe: the owner serialises calls.
    """

    def __init__(self, num_columns: int, capacity: int = MIN_CAPACITY) -> None:
        if num_columns < 1:
            raise ValueError(f"num_columns must be >= 1, got {num_columns}")
        self._alloc(max(MIN_CAPACITY, 1 << (max(capacity, 1) - 1).bit_length()), num_columns)
        self._multiplier = np.uint64(secrets.randbits(64) | 1)

    def _alloc(self, capacity: int, num_columns: int) -> None:
        self._ids = np.zeros(capacity, dtype=np.uint64)
        # One extra all-zero row: position -1 (absent) reads it, so lookups need no masking.
        self._masks = np.zeros((capacity + 1, num_columns), dtype=np.uint8)
        self._shift = np.uint64(64 - (capacity.bit_length() - 1))
        self._slot_mask = capacity - 1
        self.num_live = 0
        self._num_tombs = 0

    @property
    def capacity(self) -> int:
        return self._ids.size

    @property
    def num_columns(self) -> int:
        return int(self._masks.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the table's arrays."""
        return int(self._ids.nbytes + self._masks.nbytes)

    def __len__(self) -> int:
        return self.num_live

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return ((ids * self._multiplier) >> self._shift).astype(np.int64)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, or -1 where absent (``rows(-1)`` is the all-zero row)."""
        if ids.size > CHUNK:
            return np.concatenate([self.find(ids[i:i + CHUNK]) for i in range(0, ids.size, CHUNK)])
        table, slot_mask = self._ids, self._slot_mask
        pos = self._home(ids)
        out = np.full(ids.size, -1, dtype=np.int64)
        todo = np.arange(ids.size)
        while todo.size:  # one window of WINDOW slots per id per round: rounds ~ probe run / WINDOW
            slots = (pos[todo, None] + _WINDOW) & slot_mask
            window = table[slots]
            hit = window == ids[todo, None]
            stop = hit | (window == EMPTY)
            first = stop.argmax(axis=1)
            rows = np.arange(todo.size)
            done = stop[rows, first]
            found = done & hit[rows, first]
            out[todo[found]] = slots[rows[found], first[found]]
            todo = todo[~done]
            pos[todo] += WINDOW
        return out

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """The mask rows at ``positions`` (from ``find``); a copy, shape [n, num_columns]."""
        return self._masks[positions]

    def set_bits(self, ids: np.ndarray, column: int, bits: int) -> np.ndarray:
        """OR ``bits`` into ``column`` of each id's row, inserting absent ids.

        Returns the rows' column values before the update (0 for inserted ids), so the caller
        can count transitions; duplicate ids count once.
        """
        ids = np.unique(ids)
        pos = self.find(ids)
        new = pos < 0
        if new.any():
            if self._reserve(int(new.sum())):
                pos = self.find(ids)  # a rebuild moved every slot
            pos[new] = self._place(ids[new])
        before = self._masks[pos, column].copy()
        self._masks[pos, column] = before | np.uint8(bits)
        return before

    def clear_bits(self, ids: np.ndarray, column: int, bits: int) -> np.ndarray:
        """Clear ``bits`` in ``column`` of each present id's row; empty rows free their slots.

        Returns the column values before the update for the ids that were present.
        """
        pos = self.find(np.unique(ids))
        pos = pos[pos >= 0]
        before = self._masks[pos, column].copy()
        self._masks[pos, column] = before & np.uint8(~bits & 0xFF)
        self._free_empty(pos)
        return before

    def clear_column(self, column: int, bits: int = 0xFF) -> None:
        """Clear ``bits`` of ``column`` in every row (a replica cleared or gone)."""
        live = np.flatnonzero(self._masks[:-1, column] & np.uint8(bits))
        self._masks[live, column] &= np.uint8(~bits & 0xFF)
        self._free_empty(live)

    def rotate_column(self, column: int, new_bit: int, old_bit: int) -> int:
        """In ``column``: ``old_bit`` := ``new_bit``, ``new_bit`` := 0 (one generation passes);
        empty rows free their slots. Returns how many rows had ``new_bit`` (now ``old_bit``)."""
        col = self._masks[:-1, column]
        rows = np.flatnonzero(col & np.uint8(new_bit | old_bit))
        values = col[rows]
        moved = (values & np.uint8(new_bit)) != 0
        values = (values & np.uint8(~(new_bit | old_bit) & 0xFF)) | np.where(moved, np.uint8(old_bit), np.uint8(0))
        self._masks[rows, column] = values
        self._free_empty(rows)
        return int(np.count_nonzero(moved))

    def column_counts(self, column: int, bit: int) -> int:
        """How many rows have ``bit`` set in ``column`` (a full scan; for checks and tests)."""
        return int(np.count_nonzero(self._masks[:-1, column] & np.uint8(bit)))

    def ids_with(self, column: int, bit: int) -> np.ndarray:
        """Every id whose row has ``bit`` set in ``column`` (a full scan)."""
        return self._ids[np.flatnonzero(self._masks[:-1, column] & np.uint8(bit))]

    def add_column(self) -> int:
        """Append an all-zero column; returns its index."""
        self._masks = np.concatenate([self._masks, np.zeros((self._masks.shape[0], 1), np.uint8)], axis=1)
        return self.num_columns - 1

    def _free_empty(self, positions: np.ndarray) -> None:
        if not positions.size:
            return
        empty = positions[~self._masks[positions].any(axis=1)]
        if empty.size:
            self._ids[empty] = TOMB
            self.num_live -= int(empty.size)
            self._num_tombs += int(empty.size)

    def _reserve(self, count: int) -> bool:
        """Rebuild (bigger when needed) so that ``count`` more ids keep the load under MAX_LOAD;
        True when it rebuilt (every slot moved)."""
        if self.num_live + self._num_tombs + count <= MAX_LOAD * self.capacity:
            return False
        need = max(MIN_CAPACITY, 2 * (self.num_live + count))  # load 0.25-0.5 after
        capacity = 1 << (need - 1).bit_length()
        live = np.flatnonzero(self._ids >= 2)
        ids, masks = self._ids[live], self._masks[live]
        self._alloc(capacity, self.num_columns)
        pos = self._place(ids)
        self._masks[pos] = masks
        return True

    def _place(self, ids: np.ndarray) -> np.ndarray:
        """Put absent, distinct ``ids`` into free slots (room reserved); returns their slots."""
        if ids.size > CHUNK:
            return np.concatenate([self._place(ids[i:i + CHUNK]) for i in range(0, ids.size, CHUNK)])
        table, slot_mask = self._ids, self._slot_mask
        pos = self._home(ids)
        out = np.empty(ids.size, dtype=np.int64)
        todo = np.arange(ids.size)
        while todo.size:
            slots = (pos[todo, None] + _WINDOW) & slot_mask
            window = table[slots]
            free = (window == EMPTY) | (window == TOMB)
            first = free.argmax(axis=1)
            rows = np.arange(todo.size)
            has_free = free[rows, first]
            wanted = slots[rows[has_free], first[has_free]]
            taken, winner = np.unique(wanted, return_index=True)  # one winner per free slot
            winners = np.flatnonzero(has_free)[winner]
            self._num_tombs -= int(np.count_nonzero(table[taken] == TOMB))
            table[taken] = ids[todo[winners]]
            out[todo[winners]] = taken
            pos[todo[~has_free]] += WINDOW  # a full window: look further; losers retry it
            placed = np.zeros(todo.size, dtype=bool)
            placed[winners] = True
            todo = todo[~placed]
        self.num_live += int(ids.size)
        return out

    def check_integrity(self) -> None:
        """Assert the counts match the arrays and every live id is found at its slot."""
        live = np.flatnonzero(self._ids >= 2)
        assert live.size == self.num_live, f"{live.size} live slots, counted {self.num_live}"
        tombs = int(np.count_nonzero(self._ids == TOMB))
        assert tombs == self._num_tombs, f"{tombs} tombstones, counted {self._num_tombs}"
        assert not self._masks[-1].any(), "the absent row is not zero"
        assert self._masks[live].any(axis=1).all(), "a live slot has an empty row"
        free = np.flatnonzero(self._ids < 2)
        assert not self._masks[free].any(), "a free slot has mask bits"
        assert (self.find(self._ids[live]) == live).all(), "a live id is not found at its slot"
