"""The connector's store: a daemon client or an embedded TieredStore, behind one guard.

``GuardedStore`` is the only place the connector touches a store. A store that fails (the
daemon died, a socket timed out, a disk error) is dropped: until ``retry_s`` has passed every
lookup is a miss, every fetch delivers nothing and every put is skipped, then the guard
reconnects. So a dead store costs hits, never a request. An embedded store is shared by the
connectors of one process (vLLM builds a scheduler-side and a worker-side connector).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from kvstore.config import StoreConfig
from kvstore.errors import CapacityError
from kvstore.index import PrefixMatch
from kvstore.integrations.vllm.settings import ConnectorSettings
from kvstore.keys import BlockHasher, ExtraKey, Namespace
from kvstore.layout import KVLayout
from kvstore.store import TieredStore
from kvstore.transfer import FetchHandle, FetchResult

logger = logging.getLogger("kvstore.vllm")

_T = TypeVar("_T")
_EMBEDDED: dict[tuple[str, str], list[Any]] = {}  # (model id, disk path) -> [store, users]
_EMBEDDED_LOCK = threading.Lock()


def _open_embedded(settings: ConnectorSettings, layout: KVLayout, model_id: str) -> TieredStore:
    key = (model_id, str(settings.disk_path))
    with _EMBEDDED_LOCK:
        entry = _EMBEDDED.get(key)
        if entry is None:
            config = StoreConfig(layout=layout, model_id=model_id, host_bytes=settings.host_bytes,
                                 disk_path=settings.disk_path,
                                 disk_bytes=settings.disk_bytes if settings.disk_path else 0,
                                 write_policy=settings.write_policy, hash_algo=settings.hash_algo,
                                 remote_url=settings.remote_url)
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

    Counts ``failures`` (store errors seen) and exposes ``is_up``. Keys are computed locally
    (same recipe as the store), salted with the request's tenant; with a daemon an empty
    tenant salts with the token's tenant, as ``StoreClient.block_keys`` does.
    """

    def __init__(self, settings: ConnectorSettings, layout: KVLayout, model_id: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.layout = layout
        self.model_id = model_id
        self.hasher = BlockHasher(Namespace(model_id, layout, settings.hash_algo))
        self.failures = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._store: Any = None
        self._tenant = ""
        self._next_try = 0.0
        self._closed = False
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="kvstore-vllm")
        self._connect()

    # -------------------------------------------------------------------- lifecycle

    def _connect(self, force: bool = False) -> Any:
        """The store, (re)connecting when it is down and ``retry_s`` has passed (or ``force``).

        Outside inference mode: vLLM may call in from its forward, and the client's shared-memory
        pool (or the embedded store's host pool) made there would be an inference tensor that
        the transfer threads may not write.
        """
        with self._lock, torch.inference_mode(False):
            if self._store is not None or self._closed or (not force and self._clock() < self._next_try):
                return self._store
            try:
                if self.settings.is_daemon:
                    from kvstore.daemon.client import connect

                    client = connect(self.settings.store, self.settings.token, layout=self.layout,
                                     model_id=self.model_id, hash_algo=self.settings.hash_algo,
                                     timeout=self.settings.timeout_s)
                    self._tenant = client.tenant
                    self._store = client
                else:
                    self._store = _open_embedded(self.settings, self.layout, self.model_id)
                logger.info("kvstore: connected to %s, namespace %s", self.settings.describe(),
                            self.hasher.namespace.id)
            except Exception as exc:  # any failure to open is a store that is down
                self._next_try = self._clock() + self.settings.retry_s
                self.failures += 1
                logger.warning("kvstore: %s is unavailable (%s: %s); no hits until it is back, "
                               "next try in %.0f s", self.settings.describe(), type(exc).__name__, exc,
                               self.settings.retry_s)
            return self._store

    def _fail(self, store: Any, exc: BaseException, reconnect_now: bool = False) -> None:
        """Drop ``store`` after an error (once, whichever thread sees it first). With
        ``reconnect_now`` the next call reconnects at once (a restarted daemon), else after retry_s."""
        with self._lock:
            self.failures += 1
            if self._store is not store:
                return
            self._store = None
            self._next_try = 0.0 if reconnect_now else self._clock() + self.settings.retry_s
        if reconnect_now:
            logger.info("kvstore: %s failed (%s: %s); reconnecting", self.settings.describe(), type(exc).__name__, exc)
        else:
            logger.warning("kvstore: %s failed (%s: %s); serving without it for %.0f s", self.settings.describe(),
                           type(exc).__name__, exc, self.settings.retry_s)
        self._release(store)

    def _call(self, op: Callable[[Any], _T], default: _T, force: bool = False) -> _T:
        """``op(store)``; on an error reconnect once and retry, then give ``default``. ``force``
        tries to connect even while backing off."""
        for attempt in range(2):
            store = self._connect(force)
            if store is None:
                return default
            try:
                return op(store)
            except Exception as exc:
                self._fail(store, exc, reconnect_now=attempt == 0)
        return default

    def _release(self, store: Any) -> None:
        try:
            if isinstance(store, TieredStore):
                _close_embedded(store)
            else:
                store.close()
        except Exception as exc:  # a broken connection may fail to close too
            logger.debug("kvstore: closing the store failed: %s", exc)

    @property
    def is_up(self) -> bool:
        return self._connect() is not None

    def close(self) -> None:
        with self._lock:
            store, self._store, self._closed = self._store, None, True
        self._executor.shutdown(wait=True)
        if store is not None:
            self._release(store)

    # -------------------------------------------------------------------- the store API

    def block_keys(self, token_ids: Sequence[int], tenant: str,
                   extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
                   parent: bytes | None = None) -> list[bytes] | None:
        """The chained keys of the full blocks, or None while a daemon's tenant is unknown."""
        if self.settings.is_daemon and not tenant:
            if self._connect() is None:
                return None
            tenant = self._tenant
        return self.hasher.block_keys(token_ids, tenant, extra_keys, parent)

    def lookup(self, keys: Sequence[bytes]) -> PrefixMatch:
        if not keys:
            return PrefixMatch(0)
        return self._call(lambda store: store.lookup(keys), PrefixMatch(0))

    def fetch(self, keys: Sequence[bytes], into: torch.Tensor) -> FetchHandle:
        """Like TieredStore.fetch, on this guard's thread: a failure reconnects and retries once,
        then delivers 0 blocks (the caller reports them; vLLM recomputes). A fetch connects even
        while backing off: it follows a lookup that the store (over another connection) answered."""

        def op(store: Any) -> FetchResult:
            # Views made inside vLLM's inference mode could not be written by the store's threads.
            with torch.inference_mode(False):
                return store.fetch(keys, into).result()

        return FetchHandle(self._executor.submit(self._call, op, FetchResult(0, ()), True), len(keys))

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> bool:
        """Store the blocks; False when the store is down or refused them."""
        if not keys:
            return False

        def put(store: Any) -> bool:
            try:
                with torch.inference_mode(False):
                    store.put(keys, blocks)
            except CapacityError as exc:  # full of pinned or in-flight blocks: the store is fine
                logger.info("kvstore: put of %d blocks refused: %s", len(keys), exc)
                return False
            return True

        return self._call(put, False)

    def stats(self) -> dict[str, dict[str, int]]:
        return self._call(lambda store: store.stats(), {})
