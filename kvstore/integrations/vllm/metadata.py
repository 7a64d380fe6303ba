"""What the scheduler-side connector tells the worker-side one each step (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
