"""What the scheduler-side connector and the worker-side ones tell each other each step (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Copy ``keys[i]`` from the store into vLLM block ``block_ids[i]``.

    ``is_async``: the request waits outside the step (WAITING_FOR_REMOTE_KVS) until the
    worker reports it in ``finished_recving``; otherwise the step's forward needs the blocks.
    """

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    is_async: bool


@dataclass(frozen=True)
class SaveSpec:
    """After this step's forward, copy vLLM block ``block_ids[i]`` to the store as ``keys[i]``."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]


@dataclass
class KVStoreMetadata(KVConnectorMetadata):
    """One step's plan; ``step`` numbers the scheduler's steps (KVStoreWorkerMeta echoes it)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    step: int = 0

    @property
    def has_sync_loads(self) -> bool:
        return any(not load.is_async for load in self.loads)


@dataclass
class KVStoreWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the steps whose synchronous loads this output settled.

    Every load error of those steps is in the same output's ``invalid_block_ids``, which
    vLLM unions over all ranks (as it aggregates this metadata), so once the scheduler sees a
    step here it knows whether any rank missed a block of it.
    """

    sync_load_steps: frozenset[int] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVStoreWorkerMeta), f"unexpected worker metadata {type(other).__name__}"
        return KVStoreWorkerMeta(self.sync_load_steps | other.sync_load_steps)
