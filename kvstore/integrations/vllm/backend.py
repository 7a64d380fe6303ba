"""The connector's store: a daemon client or an embedded TieredStore, behind one guard.

``GuardedStore`` is the only place the connector touches a store. A store that fails (the
daemon died or stopped answering, a socket timed out, a disk error) is dropped, and a
background thread reconnects: the first attempt at once, then after waits that double from
RETRY_FIRST_S up to ``retry_s``. Until it is back every lookup is a miss, every fetch delivers
nothing and every put is skipped, at once: no caller on vLLM's scheduling thread ever waits for
a connection attempt, so a dead store costs hits, never a request, and a daemon that stops
answering stalls the engine for one lookup timeout per outage. An embedded store is shared by
the connectors of one process (vLLM builds a scheduler-side and a worker-side connector).
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from kvstore.api import BlockStore, check_count, check_ttl
from kvstore.client.client import StoreClient, connect
from kvstore.errors import CapacityError, DaemonUnreachableError
from kvstore.integrations.vllm.settings import ConnectorSettings
from kvstore.keys import BlockHasher, ExtraKey, Namespace
from kvstore.layout import KVLayout
from kvstore.results import BlockInfo, FetchHandle, FetchResult, PrefetchHandle, PrefixMatch
from kvstore.store import TieredStore

logger = logging.getLogger("kvstore.vllm")

_T = TypeVar("_T")
RETRY_FIRST_S = 0.1  # the first wait between reconnection attempts; each later one doubles, up to retry_s
SALT_SEPARATOR = "\x00cache_salt\x00"  # tenant + this + vLLM's cache_salt: a salted request's chain tenant
_EMBEDDED: dict[tuple[str, str], list[Any]] = {}  # (model id, disk path) -> [store, users]
_EMBEDDED_LOCK = threading.Lock()


def _open_embedded(settings: ConnectorSettings, layout: KVLayout, model_id: str) -> TieredStore:
    store_settings = settings.store_settings
    key = (model_id, str(store_settings.disk_path))
    with _EMBEDDED_LOCK:
        entry = _EMBEDDED.get(key)
        if entry is None:
            config = store_settings.store_config(layout, model_id)
            entry = _EMBEDDED[key] = [TieredStore(config), 0]  # (built outside inference mode)
        entry[1] += 1
        return entry[0]


def _close_embedded(store: TieredStore) -> None:
    with _EMBEDDED_LOCK:
        for key, entry in list(_EMBEDDED.items()):
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] == 0:
                    del _EMBEDDED[key]
                    store.close()  # host-only blocks are written back to disk here


@atexit.register
def _close_all_embedded() -> None:
    """A process that never shut its LLM down still writes its host tier back."""
    with _EMBEDDED_LOCK:
        stores = [entry[0] for entry in _EMBEDDED.values()]
        _EMBEDDED.clear()
    for store in stores:
        try:
            store.close()
        except Exception as exc:  # at exit there is nobody left to raise to
            logger.warning("kvstore: closing the embedded store at exit failed: %s", exc)


class GuardedStore:
    """A store whose failures are misses. Thread-safe.

    Counts ``failures`` (store errors and failed connection attempts) and exposes ``is_up``.
    Keys are computed locally (same recipe as the store), salted with the request's tenant
    (``tenant_for``). ``timeout_s`` bounds one daemon request (default: the settings'); the
    scheduler-side guard passes ``lookup_timeout_s``, as it runs on vLLM's scheduling thread.
    """

    def __init__(self, settings: ConnectorSettings, layout: KVLayout, model_id: str,
                 timeout_s: float | None = None) -> None:
        self.settings = settings
        self.layout = layout
        self.model_id = model_id
        self.timeout_s = settings.timeout_s if timeout_s is None else timeout_s
        self.hasher = BlockHasher(Namespace(model_id, layout, settings.hash_algo))
        self.failures = 0
        self._lock = threading.Lock()
        self._store: BlockStore | None = None
        self._tenant = ""
        self._closed = False
        self._quiet = False  # a failed attempt was logged: the next ones log at debug level
        self._wake = threading.Event()  # set by close(): the reconnect thread stops waiting
        self._reconnector: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="kvstore-vllm")
        if self._attempt() is None:  # the first attempt in vLLM's startup, so the first request can hit
            self._reconnect_later(RETRY_FIRST_S)

    # -------------------------------------------------------------------- lifecycle

    def _open(self) -> StoreClient | TieredStore:
        """A new store (no lock held: a daemon that accepts but never answers blocks timeout_s).

        Outside inference mode: vLLM may call in from its forward, and the client's shared-memory
        pool (or the embedded store's host pool) made there would be an inference tensor that
        the transfer threads may not write.
        """
        with torch.inference_mode(False):
            if self.settings.is_daemon:
                return connect(self.settings.store_url, self.settings.token, layout=self.layout,
                               model_id=self.model_id, hash_algo=self.settings.hash_algo, timeout=self.timeout_s)
            return _open_embedded(self.settings, self.layout, self.model_id)

    def _attempt(self) -> BlockStore | None:
        """One connection attempt in this thread: the store now in use, or None."""
        try:
            store = self._open()
        except Exception as exc:  # any failure to open is a store that is down
            with self._lock:
                self.failures += 1
                quiet, self._quiet = self._quiet, True
            (logger.debug if quiet else logger.warning)(
                "kvstore: %s is unavailable (%s: %s); no hits until it is back, retrying in the background",
                self.settings.describe(), type(exc).__name__, exc)
            return None
        with self._lock:
            spare = store if self._closed or self._store is not None else None  # closed, or another thread won
            if spare is None:
                self._store, self._quiet = store, False
                self._tenant = store.tenant if isinstance(store, StoreClient) else ""
            current = self._store
        if spare is not None:
            self._release(spare)
        else:
            logger.info("kvstore: connected to %s, namespace %s", self.settings.describe(), self.hasher.namespace.id)
        return current

    def _reconnect_later(self, first_wait: float = 0.0) -> None:
        """Start the background reconnection, unless it runs already (or the guard is closed)."""
        with self._lock:
            if self._closed or self._store is not None or self._reconnector is not None:
                return
            self._reconnector = threading.Thread(target=self._reconnect_loop, args=(first_wait,),
                                                 name="kvstore-vllm-reconnect", daemon=True)
            self._reconnector.start()

    def _reconnect_loop(self, wait: float) -> None:
        while not self._wake.wait(wait):
            self._attempt()
            with self._lock:  # one section with the check: a failure right after starts a new thread
                if self._closed or self._store is not None:
                    self._reconnector = None
                    return
            wait = min(max(2 * wait, RETRY_FIRST_S), self.settings.retry_s)
        with self._lock:
            self._reconnector = None

    def _fail(self, store: BlockStore, exc: BaseException) -> None:
        """Drop ``store`` after an error (once, whichever thread sees it first)."""
        with self._lock:
            self.failures += 1
            if self._store is not store:
                return
            self._store = None
        logger.warning("kvstore: %s failed (%s: %s); serving without it while it reconnects",
                       self.settings.describe(), type(exc).__name__, exc)
        self._release(store, failed=True)

    def _call(self, op: Callable[[BlockStore], _T], default: _T, retry: bool = False, connect: bool = False) -> _T:
        """``op(store)``, or ``default`` at once while the store is down or when op fails.

        ``retry``: after a broken connection (not a timeout), reconnect in this thread and try
        once more (a restarted daemon then costs nothing). ``connect``: while down, try to
        connect in this thread first. Neither is for vLLM's scheduling thread.
        """
        store = self._current()
        if store is None and connect:
            store = self._attempt()
        for last in (not retry, True):
            if store is None:
                break
            try:
                return op(store)
            except Exception as exc:
                self._fail(store, exc)
                if last or isinstance(exc, TimeoutError):  # a stalled daemon: never wait for it twice
                    break
            store = self._attempt()  # a broken connection: once more, on a new one
        self._reconnect_later()
        return default

    def _current(self) -> BlockStore | None:
        with self._lock:
            return self._store

    def _release(self, store: BlockStore, failed: bool = False) -> None:
        """Close a store this no longer uses; a daemon client that ``failed`` is dropped at
        once (its daemon may not answer: a graceful close would wait on it)."""
        try:
            if isinstance(store, TieredStore):
                _close_embedded(store)
            elif failed and isinstance(store, StoreClient):
                store.abort()
            else:
                store.close()
        except Exception as exc:  # a broken connection may fail to close too
            logger.debug("kvstore: closing the store failed: %s", exc)

    @property
    def is_up(self) -> bool:
        return self._current() is not None

    def close(self) -> None:
        with self._lock:
            store, self._store, self._closed = self._store, None, True
        self._wake.set()  # a reconnect thread inside an attempt releases what it opens, then ends
        self._executor.shutdown(wait=True)
        if store is not None:
            self._release(store)

    # -------------------------------------------------------------------- the store API

    def tenant_for(self, cache_salt: str | None) -> str | None:
        """The chain tenant of a request: the daemon token's tenant ("" for an embedded store),
        and vLLM's ``cache_salt`` after SALT_SEPARATOR when the request has one, so a salt never
        names the unsalted chain of a tenant, whatever its text. None while a daemon's tenant is
        unknown (the daemon is down)."""
        tenant = ""
        if self.settings.is_daemon:
            with self._lock:
                if self._store is None:
                    tenant_known = False
                else:
                    tenant_known, tenant = True, self._tenant
            if not tenant_known:
                self._reconnect_later()
                return None
        return tenant + SALT_SEPARATOR + cache_salt if cache_salt else tenant

    @property
    def namespace(self) -> Namespace:
        return self.hasher.namespace

    def block_keys(self, token_ids: Sequence[int] | np.ndarray, tenant: str = "",
                   extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
                   parent: bytes | None = None) -> list[bytes]:
        """The chained keys of the full blocks, computed here (the store's recipe). With a
        daemon an empty tenant is the token's: DaemonUnreachableError while the daemon is down
        and it is unknown (the scheduler then treats the request as a miss)."""
        if self.settings.is_daemon and not tenant:
            known = self.tenant_for(None)
            if known is None:
                raise DaemonUnreachableError(f"{self.settings.describe()} is down: its token's tenant is unknown")
            tenant = known
        return self.hasher.block_keys(token_ids, tenant, extra_keys, parent)

    def group_keys(self, keys: Sequence[bytes], group: int) -> list[bytes]:
        """KV group ``group``'s keys of the prefixes ``keys`` name (kvstore.keys.BlockHasher)."""
        return self.hasher.group_keys(keys, group)

    def lookup(self, keys: Sequence[bytes]) -> PrefixMatch:
        """The leading run the store holds; a miss at once while it is down (never reconnects here:
        this runs on vLLM's scheduling thread)."""
        if not keys:
            return PrefixMatch(0)
        return self._call(lambda store: store.lookup(keys), PrefixMatch(0))

    def fetch(self, keys: Sequence[bytes], into: torch.Tensor) -> FetchHandle:
        """Like TieredStore.fetch, on this guard's thread: a broken connection reconnects and
        retries once, else 0 blocks are delivered (the caller reports them; vLLM recomputes). A
        fetch connects even while the store is down here: it follows a lookup that the store
        (over the scheduler's connection) answered. A destination of the wrong shape is the
        caller's error: LayoutMismatchError."""
        self.layout.check_blocks(into, len(keys))

        def op(store: BlockStore) -> FetchResult:
            # Views made inside vLLM's inference mode could not be written by the store's threads.
            with torch.inference_mode(False):
                return store.fetch(keys, into).result()

        return FetchHandle(self._executor.submit(self._call, op, FetchResult(0, ()), True, True), len(keys))

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor, *, tenant: str = "", group: int | None = None) -> None:
        """Store the blocks, or drop them (counted in ``failures`` when the store failed)."""
        self.try_put(keys, blocks, group)

    def try_put(self, keys: Sequence[bytes], blocks: torch.Tensor, group: int | None = None) -> bool:
        """Store the blocks; False when the store is down or refused them. Blocks of the wrong
        shape are the caller's error, not the store's: LayoutMismatchError."""
        self.layout.check_blocks(blocks, len(keys))
        if not keys:
            return False

        def put(store: BlockStore) -> bool:
            try:
                with torch.inference_mode(False):
                    store.put(keys, blocks, group=group)
            except CapacityError as exc:  # full of pinned or in-flight blocks: the store is fine
                logger.info("kvstore: put of %d blocks refused: %s", len(keys), exc)
                return False
            return True

        return self._call(put, False, retry=True)

    def get(self, keys: Sequence[bytes], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks; KeyError when the store lacks one or is down (a miss either way)."""
        found = self._call(lambda store: store.get(keys, out), None, retry=True, connect=True)
        if found is None:
            raise KeyError(f"{self.settings.describe()} could not give {len(keys)} blocks (down or missing)")
        return found

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each key; all False while it is down."""
        return self._call(lambda store: store.contains(keys), [False] * len(keys))

    def delete(self, keys: Sequence[bytes], *, descendants: bool = False) -> int:
        """Drop the blocks; 0 while the store is down."""
        return self._call(lambda store: store.delete(keys, descendants=descendants), 0, retry=True)

    def cool(self, keys: Sequence[bytes]) -> int:
        """Make the blocks every tier's next victims; 0 while the store is down."""
        return self._call(lambda store: store.cool(keys), 0, retry=True)

    def pin(self, keys: Sequence[bytes], *, ttl_s: float | None = None) -> None:
        """Pin the blocks; while the store is down nothing is held, so nothing is pinned. A
        bad ``ttl_s`` is the caller's error (ValueError), not the store's."""
        ttl = check_ttl(ttl_s)
        self._call(lambda store: store.pin(keys, ttl_s=ttl), None, retry=True)

    def prefetch(self, keys: Sequence[bytes]) -> PrefetchHandle:
        """Warm the store's host RAM; a handle that delivers 0 at once while the store is down.
        Too many keys is the caller's error (ValueError)."""
        check_count("prefetch", len(keys))
        inner = self._call(lambda store: store.prefetch(keys), PrefetchHandle.finished(0, len(keys)))

        def poll(wait_s: float) -> int | None:  # a store that fails meanwhile: nothing was warmed
            try:
                return inner.result(wait_s)
            except TimeoutError:
                return None
            except Exception as exc:
                logger.info("kvstore: a prefetch of %d blocks failed: %s", len(keys), exc)
                return 0

        return PrefetchHandle(len(keys), poll)

    def inspect(self, keys: Sequence[bytes]) -> list[BlockInfo | None]:
        """Where the blocks are; none anywhere while the store is down."""
        check_count("inspect", len(keys))
        return self._call(lambda store: store.inspect(keys), [None] * len(keys))

    def unpin(self, keys: Sequence[bytes]) -> None:
        self._call(lambda store: store.unpin(keys), None, retry=True)

    def stats(self) -> dict[str, dict[str, Any]]:
        return self._call(lambda store: store.stats(), {})

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the puts made so far; False while the store is down."""
        return self._call(lambda store: store.flush(timeout), False)


def _implements_the_contract(store: GuardedStore) -> BlockStore:
    return store  # mypy checks that GuardedStore is a BlockStore, signature by signature
