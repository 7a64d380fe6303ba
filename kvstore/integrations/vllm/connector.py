"""KVStoreConnector: kvstore behind vLLM's KV-connector interface (vLLM 0.32, pinned).

vLLM builds one per role: the scheduler-side instance answers lookups and plans each step's
loads and saves (scheduler.py); the worker-side instance moves the bytes (worker.py). Both
open the store named by ``kv_connector_extra_config`` (settings.py) for the namespace of
the model (identity.py). It implements ``SupportsHMA``, so vLLM keeps its hybrid KV cache
manager on with it: a hybrid model (full-attention and sliding-window KV cache groups, as
Gemma 3's) is looked up, loaded and saved per group (groups.py). Load it with::

    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"store_url": "unix:///run/kvstore/kvstore.sock"})
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.integrations.vllm.backend import GuardedStore
from kvstore.integrations.vllm.identity import model_identity
from kvstore.integrations.vllm.metadata import KVStoreMetadata, KVStoreWorkerMeta
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.settings import ConnectorSettings
from kvstore.integrations.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("kvstore.vllm")
# kvstore tier -> vLLM's label; vLLM 0.32 has no REMOTE: its fallback is documented as "remote store"
HIT_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK,
               "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV cache backed by a kvstore daemon or an embedded TieredStore."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(config.kv_connector_extra_config)
        self.identity = model_identity(vllm_config, kv_cache_config, self.settings.model_id)
        is_scheduler = role == KVConnectorRole.SCHEDULER
        if config.kv_load_failure_policy != "recompute" and is_scheduler:
            logger.warning("kvstore: kv_load_failure_policy=%r fails a request whose block is corrupt or "
                           "vanished; 'recompute' makes it a miss", config.kv_load_failure_policy)
        if self.settings.token is not None and is_scheduler:
            logger.warning("kvstore: the daemon token is set in kv_connector_extra_config, which vLLM logs at "
                           "INFO with its non-default arguments; set KVSTORE_TOKEN instead")
        # the scheduler side only looks up, on vLLM's scheduling thread: a short timeout of its own
        self.store = GuardedStore(self.settings, self.identity.layout, self.identity.model_id,
                                  timeout_s=self.settings.lookup_timeout_s if is_scheduler else None)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if is_scheduler:
            self.scheduler_side = SchedulerSide(self.store, self.identity.layout.block_size, self.settings.async_tiers,
                                                load=config.is_kv_consumer, save=config.is_kv_producer,
                                                async_when_idle=self.settings.async_when_idle)
        else:
            self.worker_side = WorkerSide(self.store, self.identity.group_layers, self.identity.layer_bytes)
        logger.info("kvstore: %s connector on %s, namespace %s (%s)", role.name.lower(), self.settings.describe(),
                    self.store.hasher.namespace.id, self.identity.layout.fingerprint())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is a future miss, never an error

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Loads and saves run in wait_for_layer_load / save_kv_layer, between the layers' graph
        # pieces; a full CUDA graph replay would skip them (no load, no save, stale KV).
        return True

    # ============================================================ worker side

    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side hook was called on the scheduler-side connector"
        return self.worker_side

    def _meta(self) -> KVStoreMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreMetadata), f"unexpected connector metadata {type(meta).__name__}"
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self._worker().save_kv_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.get_transfer_results(finished_req_ids).finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker().get_finished()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker().report(self._meta()) if self.has_connector_metadata() else None

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        self.store.close()

    # ============================================================ scheduler side

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-side hook was called on the worker-side connector"
        return self.scheduler_side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        return hit_sources(self._scheduler().hit_tiers(request.request_id, num_external_tokens))

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.null_block = gpu_block_pool.null_block.block_id

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._scheduler().update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        steps = report.sync_load_steps if isinstance(report, KVStoreWorkerMeta) else frozenset()
        self._scheduler().note_worker_output(set(connector_output.invalid_block_ids or ()), steps,
                                             set(connector_output.failed_recving or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler().request_finished(request)
        return False, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA's hook (vLLM calls it instead of ``request_finished``): nothing is left to save."""
        return self.request_finished(request, block_ids[0] if block_ids else [])


def hit_sources(tiers: dict[str, int]) -> dict[CacheHitSource, int]:
    """Tokens per kvstore tier -> tokens per vLLM CacheHitSource (a tier vLLM has no label for
    counts as EXTERNAL_UNSPECIFIED)."""
    out: dict[CacheHitSource, int] = {}
    for tier, n in tiers.items():
        if n:
            source = HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + n
    return out
