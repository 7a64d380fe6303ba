"""The tier's read side: a lookup and a read of blocks, one round trip each at most.

``RemoteReads`` answers ``RemoteTier.lookup``, ``get`` and ``contains`` over the tier's
``ask`` (one pipeline per primary, all at once; tiers.remote.topology). It owns what the tier
learned lately (tiers.remote.hints): fresh hints answer a lookup without a request, a read
GETs nothing a fresh hint says is missing, and the values a lookup of a short run fetched
wait for the read that follows. Every value is checked where it was received
(tiers.remote.codec: header, key, checksum); a bad one is counted, deleted and a miss; a good
one's payload is copied once, into the caller's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvstore.tiers.buffers import byte_view
from kvstore.tiers.remote import codec
from kvstore.tiers.remote.counters import RemoteCounters
from kvstore.tiers.remote.hints import KEPT_TTL_S, Hints, KeptValues
from kvstore.tiers.remote.replies import Odd

# A lookup GETs an unknown run of up to this many value bytes instead of asking EXISTS: up to
# there the GET's extra transfer costs about the round trip the read after it then saves
# (docs/remote.md). A longer run would move its transfer onto the looking-up thread (an
# engine's scheduler, vLLM's) and waste it whenever no read follows.
LOOKUP_GET_BYTES = 1 << 20
NOT_ASKED = object()  # a read's value slot for a block it did not ask for

Ask = Callable[..., list[Any]]  # (names, command, value_bytes=None) -> per name: its reply or exception
Names = Callable[[Sequence[bytes], Sequence[bytes] | None], list[bytes]]


class RemoteReads:
    """Lookups and reads of one tier; thread-safe (hints and kept values lock themselves).

    Attributes:
        hints, kept: what the remote said lately (tiers.remote.hints).
        lookup_get_bytes: the longest run, in value bytes, that a lookup GETs rather than
            asks EXISTS of.
    """

    def __init__(self, ask: Ask, names: Names, counters: RemoteCounters, layout: bytes, payload_bytes: int,
                 hint_ttl_s: float, lookup_get_bytes: int = LOOKUP_GET_BYTES) -> None:
        self._ask, self._names, self.counters = ask, names, counters
        self._layout, self.payload_bytes = layout, payload_bytes
        self.hints = Hints(hint_ttl_s)
        self.kept = KeptValues(min(hint_ttl_s, KEPT_TTL_S))
        self.lookup_get_bytes = lookup_get_bytes

    def contains(self, keys: Sequence[bytes], tags: Sequence[bytes] | None = None) -> list[bool]:
        """Per block: does the remote hold it now? Asked (EXISTS), never hinted; a failure: False."""
        found = [r is True or r == 1 for r in self._ask(self._names(keys, tags), "EXISTS")]
        self._note(keys, found)
        return found

    def lookup(self, keys: Sequence[bytes], tags: Sequence[bytes] | None = None) -> int:
        """How many leading blocks of ``keys`` the remote holds, as far as it is worth asking.

        Fresh hints answer first: blocks held lately count without a request, and a block
        missing lately ends the run without one. Where the hints end, the remote is asked
        about the blocks up to the next fresh miss: a run of at most ``lookup_get_bytes`` by
        GET, each value checked and kept for the ``get`` that follows (taken once, checked
        again there), a longer one by EXISTS. Either is one round trip, nodes in parallel.
        """
        known = self.hints.known(keys)
        start = known.index(None) if None in known else len(keys)
        if False in known[:start]:  # a fresh miss before any unknown block: the run ends there
            end = known.index(False)
            self.counters.add(hint_hits=end + 1)
            return end
        self.counters.add(hint_hits=start)
        if start == len(keys):
            return start
        stop = known.index(False, start) if False in known[start:] else len(keys)
        ask = list(keys[start:stop])
        names = self._names(ask, None if tags is None else tags[start:stop])
        self.counters.add(hint_misses=len(ask))
        value_bytes = codec.header_bytes(len(ask[0])) + self.payload_bytes
        if len(ask) * value_bytes > self.lookup_get_bytes or self.kept.ttl_s == 0:
            found = [r is True or r == 1 for r in self._ask(names, "EXISTS")]
            self._note(ask, found)
        else:
            values = self._ask(names, "GET", value_bytes)
            found = self._checked(ask, names, values)
            self.kept.keep([k for k, f in zip(ask, found, strict=True) if f],
                           [v for v, f in zip(values, found, strict=True) if f])
        return start + (found.index(False) if False in found else len(found))

    def get(self, keys: Sequence[bytes], outs: Sequence[Any], tags: Sequence[bytes] | None, leading: bool,
            owners: list[bytes | None] | None = None) -> list[bool]:
        """See ``RemoteTier.get``."""
        if len(outs) != len(keys):
            raise ValueError(f"get needs one out per key: {len(keys)} keys, {len(outs)} outs")
        pb = self.payload_bytes
        views = [byte_view(o, writable=True)[0] for o in outs]
        for view in views:
            if view.nbytes < pb:
                raise ValueError(f"out of {view.nbytes} bytes is shorter than payload_bytes={pb}")
        names = self._names(keys, tags)
        values: list[Any] = self.kept.take(keys) if len(self.kept) else [None] * len(keys)
        num_kept = sum(v is not None for v in values)
        known = self.hints.known(keys)
        stop = known.index(False) if leading and False in known else len(keys)  # nothing past it matters
        ask = [i for i in range(stop) if values[i] is None and known[i] is not False]
        unasked = sum(1 for v in values if v is None) - len(ask)  # known missing, or past one
        if ask:
            value_bytes = codec.header_bytes(len(keys[ask[0]])) + pb
            for i, value in zip(ask, self._ask([names[i] for i in ask], "GET", value_bytes), strict=True):
                values[i] = value
        for i in range(len(keys)):
            if values[i] is None and (i >= stop or known[i] is False):
                values[i] = NOT_ASKED
        ok = self._checked(keys, names, values)
        if leading and False in ok:  # the run ends at the first miss: nothing past it is delivered
            first = ok.index(False)
            ok[first:] = [False] * (len(ok) - first)
        for i, good in enumerate(ok):
            if good:
                views[i][:pb] = values[i][-pb:]  # the one copy: from the received value to the caller
                if owners is not None:
                    owners[i] = codec.owner_of(values[i])
        num_hits = sum(ok)
        self.counters.add(hits=num_hits, misses=len(keys) - num_hits, bytes_read=num_hits * pb,
                          kept_used=num_kept, hint_hits=unasked)
        return ok

    def forget(self, keys: Sequence[bytes]) -> None:
        """This tier deletes ``keys``: their kept values go, and they are missing for now."""
        self.kept.drop(keys)
        self.hints.note(keys, False)

    def _checked(self, keys: Sequence[bytes], names: Sequence[bytes], values: list[Any]) -> list[bool]:
        """Per value (as ``ask`` read it): is it exactly block ``keys[i]``? Invalid values are
        counted, deleted and replaced by None in ``values``; every answer becomes a hint."""
        found = [False] * len(keys)
        heard: list[bool | None] = [None] * len(keys)  # None: no answer (an error, or not asked)
        bad: list[int] = []
        for i, value in enumerate(values):
            if value is NOT_ASKED:
                continue
            if isinstance(value, Odd):  # another length: read aside (or too long to read)
                value = values[i] = value.value if value.value is not None else b""
            if value is None:
                heard[i] = False  # nil: never put, or evicted
            if not isinstance(value, memoryview | bytes):
                continue  # nil, or an exception (counted already)
            payload, reason = codec.decode(value, keys[i], self._layout, self.payload_bytes)
            heard[i] = payload is not None
            if payload is None:
                self.counters.error("corrupt", reason=reason)
                bad.append(i)
                values[i] = None
            else:
                found[i] = True
        self._note(keys, heard)
        if bad:
            self._ask([names[i] for i in bad], "DEL")
        return found

    def _note(self, keys: Sequence[bytes], held: Sequence[bool | None]) -> None:
        """Hints from answers (None: no answer, nothing learned)."""
        pairs = [(k, h) for k, h in zip(keys, held, strict=True) if h is not None]
        if pairs:
            self.hints.note([k for k, _ in pairs], [bool(h) for _, h in pairs])
