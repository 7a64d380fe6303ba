"""Forget a tenant: every block of it in every tier, pinned or being read, for good.

The order (one forget at a time per store):

  1. blocks of the tenant that a shared level delivers are no longer promoted into host RAM
     (``ReadPath.unpromoted``), so none comes back from the remote while it is swept;
  2. local tiers: every indexed block filed under the tenant loses its pins (every pin group,
     kvstore/store/pins.py) and is deleted from host and disk (the disk catalog commits the delete
     durably: a restart recovers none of them). A block being written is waited for; one
     being read (a copy outside the store lock, a shared-memory read lease) is left to its
     reader, which finishes with the bytes it started with, and taken once it is done
     (looked at again every few milliseconds, up to ``wait_s``: CapacityError after that,
     with what was deleted so far);
  3. shared levels: each deletes every value the tenant owns, whichever store wrote it
     (the remote tier's sweep, kvstore/tiers/remote/sweep.py), and drops what it learned
     lately (hints, kept values);
  4. promotions resume.

Blocks are matched by ``BlockEntry.tenant``: the tenant a put named, or for a block promoted
from the remote tier, its owner's name (``#`` + its owner tag when this store never met that
tenant: both are matched). A put racing the forget is a new block: it is not forgotten.
"""

from __future__ import annotations

import threading
import time

from kvstore.errors import CapacityError
from kvstore.results import ForgetReport
from kvstore.store.cascade import Cascade
from kvstore.store.levels.shared import UNKNOWN_TENANT, owner_tag
from kvstore.store.pins import PinLedger
from kvstore.store.reads import ReadPath
from kvstore.tiers.records import check_name

FORGET_WAIT_S = 30.0  # the longest a forget waits for the readers of the tenant's blocks
POLL_S = 0.005


class TenantForget:
    def __init__(self, cascade: Cascade, reads: ReadPath, pins: PinLedger) -> None:
        self.cascade = cascade
        self.reads = reads
        self.pins = pins
        self._one_at_a_time = threading.Lock()

    def forget(self, tenant: str, *, remote: bool = True, wait_s: float = FORGET_WAIT_S) -> ForgetReport:
        check_name("tenant", tenant)
        names = {tenant, UNKNOWN_TENANT + owner_tag(tenant).hex()}
        cascade = self.cascade
        with self._one_at_a_time:
            with cascade.lock:
                cascade.check_open()
                self.reads.unpromoted |= names
            try:
                deleted, num_blocks, pins = self._local(tenant, names, wait_s)
                failures: list[str] = []
                for shared in cascade.shared if remote else ():
                    count, failed = shared.forget_tenant(tenant)
                    deleted[shared.name] = count
                    failures += failed
            finally:
                with cascade.lock:
                    self.reads.unpromoted -= names
        return ForgetReport(tenant, deleted, num_blocks, pins, tuple(failures))

    def _local(self, tenant: str, names: set[str], wait_s: float) -> tuple[dict[str, int], int, int]:
        cascade = self.cascade
        levels = cascade.levels
        deleted = {level.name: 0 for level in levels}
        num_blocks = pins = 0
        deadline = time.monotonic() + wait_s
        while True:
            with cascade.lock:  # a snapshot (a C-level copy), filtered without the lock
                snapshot = list(cascade.index.entries.values())
            mine = [e for e in snapshot if e.tenant in names]
            with cascade.lock:
                cascade.check_open()
                mine = [e for e in mine if cascade.index.get(e.key) is e]
                keys = [e.key for e in mine]
                if cascade.inflight.any_written(keys):
                    cascade.inflight.wait_written(keys)  # lets the lock go: look again after
                    continue
                pins += self.pins.drop(mine)
                free = [e for e in mine if e.readers == 0]
                for level in levels:
                    deleted[level.name] += sum(1 for e in free if e.slots[level.rank] is not None)
                cascade.placement.delete(free)
                num_blocks += len(free)
                busy = len(mine) - len(free)
            if not busy:
                return deleted, num_blocks, pins
            if time.monotonic() >= deadline:
                raise CapacityError(f"forgetting tenant {tenant!r}: {busy} of its blocks are still being read "
                                    f"after {wait_s} s ({num_blocks} deleted so far); forget it again")
            time.sleep(POLL_S)
