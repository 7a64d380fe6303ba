"""The daemon's client: ``kvstore.connect(url, ...)`` -> StoreClient, TieredStore's semantics.

A client is one connection, one request at a time (thread-safe behind its channel's lock; open
one client per thread for parallel traffic). ``StoreClient`` is the ``BlockStore`` contract over
the parts of this package:

- ``Channel`` (channel.py): the socket (address.py), frames, request ids, pipelined requests;
- ``ShmWrites`` and ``ShmReads`` (shm_writes.py, shm_reads.py): over a Unix socket, when the
  daemon offers its host pool, puts and gets copy straight into and out of the mapped pool
  (docs/protocol.md, "Shared memory"); what they cannot do goes over the socket;
- ``ManagementCalls`` (manage.py): prefetch, inspect, forget_tenant.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvstore import env
from kvstore.api import BlockStore, check_ttl
from kvstore.client.address import open_socket, parse_address
from kvstore.client.channel import Channel
from kvstore.client.manage import FORGET_TIMEOUT_S, ManagementCalls
from kvstore.client.pool_map import MappedPool
from kvstore.client.shm_reads import ShmReads
from kvstore.client.shm_writes import ShmWrites
from kvstore.keys import BlockHasher, ExtraKey, Namespace
from kvstore.layout import KVLayout, raw_rows
from kvstore.protocol import VERSION, layout_to_dict
from kvstore.results import (
    HOST,
    BlockInfo,
    FetchHandle,
    FetchResult,
    ForgetReport,
    PrefetchHandle,
    PrefixMatch,
)
from kvstore.tiers.host import PayloadViews

# parse_address lives in address.py; callers that check a store_url import it from here too
__all__ = ["StoreClient", "connect", "parse_address"]

TIER_NAMES = {"h": "host", "d": "disk", "r": "remote"}


def connect(url: str, token: str | None = None, *, layout: KVLayout, model_id: str,
            hash_algo: str = "sha256", shm: bool | None = None, timeout: float = 30.0) -> StoreClient:
    """Open a client of the daemon at ``url`` for one namespace (model id + KV layout).

    Args:
        url: ``unix://PATH`` (absolute, ``unix:///run/kvstore.sock``, or relative to the
            working directory, ``unix://.kvstore/kvstore.sock``) or ``tcp://HOST:PORT``.
        token: the caller's token (or KVSTORE_TOKEN); it decides the tenant.
        layout, model_id, hash_algo: the namespace, as for a TieredStore.
        shm: use the shared-memory path when the daemon offers it (default: on Unix sockets,
            unless KVSTORE_NO_SHM=1).
        timeout: seconds one request may take.

    Raises:
        RemoteError: the daemon refused the hello (bad token, version, layout, no slot).
        ValueError: ``url`` is neither form.
        OSError: nothing listens at ``url`` (the message names the path or address tried).
    """
    return StoreClient(url, token if token is not None else env.token(), layout, model_id, hash_algo, shm, timeout)


class StoreClient:
    """A TieredStore-like view of one namespace in a daemon."""

    def __init__(self, url: str, token: str | None, layout: KVLayout, model_id: str, hash_algo: str,
                 shm: bool | None, timeout: float) -> None:
        sock = open_socket(url, timeout)
        self.url = url
        self.layout = layout
        self.model_id = model_id
        self.hasher = BlockHasher(Namespace(model_id, layout, hash_algo))
        self._channel = Channel(sock, self.hasher.key_bytes)
        self._manage = ManagementCalls(self._channel)
        self._mapped: MappedPool | None = None  # the daemon's host pool, while mapped; the parts below use it
        self._reads: ShmReads | None = None
        self._writes: ShmWrites | None = None
        self._executor: ThreadPoolExecutor | None = None  # fetch()'s thread, started by the first
        want_shm = self._channel.is_unix if shm is None else shm
        want_shm = want_shm and not env.shm_disabled()
        hello = self._channel.call({"op": "hello", "version": VERSION, "token": token, "model_id": model_id,
                                    "layout": layout_to_dict(layout), "hash_algo": hash_algo, "shm": want_shm})[0]
        self.tenant: str = hello["tenant"]
        self.namespace_id: str = hello["namespace"]
        self._channel.max_frame = hello["max_frame"]
        self._channel.max_keys = hello["max_keys"]
        self.max_blocks: int = hello["max_blocks"]
        if hello.get("shm"):
            self._map_pool(hello["shm"])

    def _map_pool(self, info: dict[str, Any]) -> None:
        self._mapped = pool = MappedPool(info["path"], info["slot_bytes"], info["num_slots"],
                                         bool(info.get("generations")))
        payloads = PayloadViews(pool.slots[:, : self.layout.bytes_per_block])
        self._reads = ShmReads(self._channel, pool, payloads)
        self._writes = ShmWrites(self._channel, payloads, self._reads)
        self._channel.due = self._reads.take_touches  # lock-free reads, told in front of the next request

    @property
    def uses_shm(self) -> bool:
        return self._mapped is not None

    @property
    def max_keys(self) -> int:
        """Keys one request carries (the daemon's frame bounds them); longer calls are split."""
        return self._channel.max_keys

    @property
    def num_lost_puts(self) -> int:
        """Blocks of shared-memory puts whose commit found its lease expired: not stored."""
        return 0 if self._writes is None else self._writes.num_lost_puts

    # ------------------------------------------------------------------------ the store API

    @property
    def namespace(self) -> Namespace:
        return self.hasher.namespace

    def block_keys(self, token_ids: Sequence[int] | np.ndarray, tenant: str = "",
                   extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
                   parent: bytes | None = None) -> list[bytes]:
        """One chained key per full block, salted with ``tenant``; "" is this connection's
        tenant (its token's, set by the daemon). The daemon files every key under the token's
        tenant as well, so another tenant name only partitions this token's own blocks."""
        return self.hasher.block_keys(token_ids, tenant or self.tenant, extra_keys, parent)

    def group_keys(self, keys: Sequence[bytes], group: int) -> list[bytes]:
        """KV group ``group``'s keys of the prefixes ``keys`` name (kvstore.keys.BlockHasher)."""
        return self.hasher.group_keys(keys, group)

    def lookup(self, keys: Sequence[bytes]) -> PrefixMatch:
        """The leading run of ``keys`` the daemon holds, and the fastest tier of each."""
        tiers: list[str] = []
        for chunk in self._channel.key_batches(keys):
            reply = self._channel.call({"op": "lookup", "keys": self._channel.keys_blob(chunk)})[0]
            tiers += [TIER_NAMES[c] for c in reply["tiers"]]
            if reply["num_blocks"] < len(chunk):
                break
        return PrefixMatch(len(tiers), tuple(tiers))

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor, *, tenant: str = "", group: int | None = None) -> None:
        """Store ``blocks[i]`` under ``keys[i]`` (CapacityError when the daemon has no room).
        ``tenant`` salted the keys already; the daemon files them under the token's tenant.
        ``group``: their KV group (the daemon's KV events name it).

        Over shared memory the call returns once the bytes are in the daemon's slots and their
        commit is sent: this client's next request is ordered after it (and reports its
        failure, if any); other clients see the blocks once the daemon has read the commit,
        or once ``flush()`` returns."""
        src = self.layout.input_blocks(blocks, len(keys))
        for start in range(0, len(keys), self.max_blocks):
            stop = min(len(keys), start + self.max_blocks)
            rows = src if stop - start == len(src) else src[start:stop]
            if self._writes is None or not self._writes.put(keys[start:stop], rows, group):
                data = raw_rows(rows).numpy().data.cast("B")
                meta: dict[str, object] = {"op": "put", "keys": self._channel.keys_blob(keys[start:stop])}
                if group is not None:
                    meta["group"] = group
                self._channel.call(meta, data)

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks under ``keys``; KeyError naming the first one the daemon lacks."""
        out = self.layout.output_blocks(len(keys), out)
        n = self._read(keys, out).num_blocks
        if n < len(keys):
            raise KeyError(f"block {keys[n].hex()} (#{n}) is not in the store")
        return out

    def fetch(self, keys: Sequence[bytes], into: torch.Tensor) -> FetchHandle:
        """Copy the leading run of found blocks into ``into`` on a background thread."""
        self.layout.check_blocks(into, len(keys))
        if not into.is_contiguous():
            raise ValueError("fetch(into=...) needs a contiguous tensor")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvstore-client")
        keys = list(keys)

        def run() -> FetchResult:
            if into.device.type == "cpu":
                return self._read(keys, into)
            staging = torch.empty((len(keys), *self.layout.block_shape), dtype=self.layout.dtype)
            result = self._read(keys, staging)
            into[: result.num_blocks].copy_(staging[: result.num_blocks])
            return result

        return FetchHandle(self._executor.submit(run), len(keys))

    def _read(self, keys: Sequence[bytes], out: torch.Tensor) -> FetchResult:
        """The leading run of found blocks into ``out`` (the layout's blocks, contiguous, CPU).
        ``out`` stays typed down to the copies (PayloadViews views the pool as its rows): a
        byte view of it is made only for the socket path."""
        if self._channel.has_pending:  # once the last put is settled its slots are remembered: lock-free reads
            self._channel.settle()
        tiers: list[str] = []
        for start in range(0, len(keys), self.max_blocks):
            chunk = keys[start : start + self.max_blocks]
            got = self._read_chunk(chunk, out if len(chunk) == len(out) else out[start : start + len(chunk)])
            tiers += got
            if len(got) < len(chunk):
                break
        return FetchResult(len(tiers), tuple(tiers))

    def _read_chunk(self, keys: Sequence[bytes], dst: torch.Tensor) -> list[str]:
        """The leading run of one request's blocks: from the mapped pool, then over the socket."""
        num_host = 0 if self._reads is None else self._reads.read(keys, dst)
        if num_host == len(keys):
            return [HOST] * num_host
        view = raw_rows(dst[num_host:]).numpy().data.cast("B")
        reply = self._channel.call({"op": "get", "keys": self._channel.keys_blob(keys[num_host:])}, into=view)[0]
        return [HOST] * num_host + [TIER_NAMES[c] for c in reply.get("tiers", "h" * reply["num_blocks"])]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        found: list[bool] = []
        for batch in self._channel.key_batches(keys):
            found += self._channel.call({"op": "exists", "keys": self._channel.keys_blob(batch)})[0]["found"]
        return found

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.contains(keys)

    def delete(self, keys: Sequence[bytes], *, descendants: bool = False, tenant: str | None = None) -> int:
        """Delete the blocks under ``keys``; returns how many there were. More keys than one
        request carries go in several, each all or nothing. ``descendants``: every block the
        daemon knows to chain below them too; ``tenant``: another tenant's (admin token)."""
        deleted = 0
        with self._channel.lock:
            # The daemon runs a connection's requests concurrently: a read lease this client
            # gave back by a posted release must be gone first, or its blocks count as being
            # read and the delete is refused.
            self._channel.settle_locked()
            self._channel.settle_posts_locked()
            for batch in self._channel.key_batches(keys):
                meta = {"op": "delete", "keys": self._channel.keys_blob(batch), "descendants": descendants}
                deleted += int(self._channel.call_locked(_named(meta, tenant))[0]["num_deleted"])
        return deleted

    def cool(self, keys: Sequence[bytes], *, tenant: str | None = None) -> int:
        """Make the blocks every tier's next victims (``cool`` op); how many the daemon held."""
        cooled = 0
        for batch in self._channel.key_batches(keys):
            reply = self._channel.call(_named({"op": "cool", "keys": self._channel.keys_blob(batch)}, tenant))[0]
            cooled += int(reply["num_blocks"])
        return cooled

    def pin(self, keys: Sequence[bytes], *, ttl_s: float | None = None, tenant: str | None = None) -> None:
        """Protect blocks from eviction while this connection lives (or until unpin), and
        with ``ttl_s`` no longer than that. ``tenant``: another tenant's (admin token)."""
        ttl = check_ttl(ttl_s)
        for batch in self._channel.key_batches(keys):
            self._channel.call(_named({"op": "pin", "keys": self._channel.keys_blob(batch), "ttl_s": ttl}, tenant))

    def unpin(self, keys: Sequence[bytes], *, tenant: str | None = None) -> None:
        """Undo this connection's most recent pin of each key."""
        for batch in self._channel.key_batches(keys):
            self._channel.call(_named({"op": "unpin", "keys": self._channel.keys_blob(batch)}, tenant))

    def prefetch(self, keys: Sequence[bytes], *, tenant: str | None = None) -> PrefetchHandle:
        """Bring the blocks up to the daemon's host RAM (manage.py)."""
        return self._manage.prefetch(keys, tenant=tenant)

    def inspect(self, keys: Sequence[bytes], *, tenant: str | None = None) -> list[BlockInfo | None]:
        """Per key, where the daemon holds its block and how (manage.py)."""
        return self._manage.inspect(keys, tenant=tenant)

    def forget_tenant(self, tenant: str | None = None, *, timeout: float = FORGET_TIMEOUT_S) -> ForgetReport:
        """Delete every block of a tenant from the whole daemon (manage.py)."""
        return self._manage.forget_tenant(tenant, timeout=timeout)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier of this namespace, as TieredStore.stats()."""
        return dict(self._channel.call({"op": "stats"})[0]["tiers"])

    def daemon_stats(self) -> dict[str, Any]:
        """stats() plus this tenant's counters in this namespace."""
        return self._channel.call({"op": "stats"})[0]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until this client's puts are published to every client of the daemon (a
        shared-memory put returns once its commit is sent; this client's own later requests
        already see it). True when done; the socket's timeout bounds the wait (``timeout`` is
        accepted for TieredStore.flush's signature)."""
        self._channel.settle()
        return True

    def close(self) -> None:
        """End the connection. Once it returns the daemon has ended it too (or did not answer
        within ``channel.CLOSE_WAIT_S``): this connection's pins and leases are released, and it
        no longer counts against the daemon's ``max_connections``."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._writes is not None:
            self._writes.close()
        self._channel.close()  # reads the last put's commit first: it must land before its leases end with us
        if self._reads is not None:
            self._reads.close()
        self._mapped = None

    def abort(self) -> None:
        """Drop the connection at once, without a word to the daemon: for a connection that
        failed or timed out, where ``close`` could wait on a daemon that does not answer. The
        daemon ends its pins and leases when it sees the connection go."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        if self._writes is not None:
            self._writes.close()
        if self._reads is not None:
            self._reads.close()
        self._mapped = None
        self._channel.abort()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------ raw requests

    def _call(self, meta: dict[str, Any], data: Any = b"", into: memoryview | None = None
              ) -> tuple[dict[str, Any], bytes]:
        """One request as the daemon reads it, and its reply: for ops the API above does not
        send as such (the daemon's tests use it to speak the protocol directly)."""
        return self._channel.call(meta, data, into)

    def _keys_blob(self, keys: Sequence[bytes]) -> bytes:
        return self._channel.keys_blob(keys)


def _named(meta: dict[str, Any], tenant: str | None) -> dict[str, Any]:
    """``meta`` acting on ``tenant`` (the admin's choice), or on the connection's own."""
    if tenant is not None:
        meta["tenant"] = tenant
    return meta


def _implements_the_contract(store: StoreClient) -> BlockStore:
    return store  # mypy checks that StoreClient is a BlockStore, signature by signature
