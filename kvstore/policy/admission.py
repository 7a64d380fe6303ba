"""Admission policies: strategy objects that decide which blocks a lower tier takes.

Eviction (kvstore/policy/eviction.py) decides what leaves a tier; admission decides what enters the
tier below it: host's victims demoted to disk (``disk_admission``), and blocks offered to the
shared remote tier (``remote_admission``). Like the eviction policies they hold no bytes and
no slots; ``TieredStore`` and ``kvstore replay`` drive the very same classes.

| name | admits |
|---|---|
| ``all`` | every block |
| ``seen_twice`` | blocks used at least twice (put, then read or put again; a put after the block was dropped counts as the second use) |
| ``tinylfu`` | blocks whose estimated recent access count (a count-min sketch with aging, kvstore/policy/sketch.py) beats the count of the block the tier would evict for them; into a tier with room, every block; into a tier whose victim is unknown (the remote: Redis evicts on its own), blocks estimated at two accesses or more |

The measured comparison on the traces, and why the defaults are what they are, is in
docs/eviction.md ("Admission").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import ClassVar

from kvstore.policy.sketch import FrequencySketch

Key = Hashable


class AdmissionPolicy(ABC):
    """Decides which candidate blocks a tier takes."""

    name: ClassVar[str]
    uses_sketch: ClassVar[bool] = False  # reads the access sketch (accesses must be recorded)

    @abstractmethod
    def admit(self, keys: Sequence[Key], uses: Sequence[int], victim: Key | None, full: bool) -> list[bool]:
        """Per candidate, whether the tier takes it.

        Args:
            keys: the candidates, in chain order.
            uses: each candidate's use count (puts and reads while the store held it; a put
                after it was dropped counts as its second use).
            victim: the block the tier would evict next to take them; None when it cannot
                say (a shared tier evicts on its own) or when it has room.
            full: whether the tier must evict to take them (unknown: True).
        """


class AdmitAll(AdmissionPolicy):
    name = "all"

    def admit(self, keys: Sequence[Key], uses: Sequence[int], victim: Key | None, full: bool) -> list[bool]:
        return [True] * len(keys)


class SeenTwice(AdmissionPolicy):
    """Only blocks used twice (Dynamo KVBM's rule for its disk tier)."""

    name = "seen_twice"

    def admit(self, keys: Sequence[Key], uses: Sequence[int], victim: Key | None, full: bool) -> list[bool]:
        return [n >= 2 for n in uses]


class TinyLFU(AdmissionPolicy):
    """TinyLFU's admission test against the tier's next victim, on a shared access sketch."""

    name = "tinylfu"
    uses_sketch = True

    def __init__(self, sketch: FrequencySketch) -> None:
        self.sketch = sketch

    def admit(self, keys: Sequence[Key], uses: Sequence[int], victim: Key | None, full: bool) -> list[bool]:
        if not full:
            return [True] * len(keys)
        found = self.sketch.estimate(keys)
        if victim is None:  # the victim is the medium's own choice: a block met at least twice
            return [n >= 2 for n in found]
        bar = self.sketch.estimate([victim])[0]
        return [n > bar for n in found]


ADMISSIONS = ("all", "seen_twice", "tinylfu")
GHOST_KEYS = 1 << 16  # keys remembered as seen once (SeenOnce's default bound)


class SeenOnce:
    """The ghost list behind ``seen_twice``: keys of blocks that left the store, so that one
    put again counts as its second use. Bounded: past ``capacity`` keys the oldest is forgotten."""

    def __init__(self, capacity: int = GHOST_KEYS) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, key: Key) -> None:
        """Remember ``key`` as seen once (the newest)."""
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def any_of(self, keys: Iterable[Key]) -> bool:
        """Whether some of ``keys`` is remembered."""
        return bool(self._keys) and not self._keys.keys().isdisjoint(keys)


def make_admission(name: str, sketch: FrequencySketch | None = None) -> AdmissionPolicy:
    """Build an admission policy by name (``tinylfu`` needs the store's ``sketch``).

    Raises:
        ValueError: an unknown name (listing the known ones), or tinylfu without a sketch.
    """
    if name == AdmitAll.name:
        return AdmitAll()
    if name == SeenTwice.name:
        return SeenTwice()
    if name == TinyLFU.name:
        if sketch is None:
            raise ValueError("tinylfu admission needs an access sketch (FrequencySketch)")
        return TinyLFU(sketch)
    raise ValueError(f"unknown admission policy {name!r}; known: {list(ADMISSIONS)}")
