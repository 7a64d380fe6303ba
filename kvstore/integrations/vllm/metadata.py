"""What the scheduler-side connector and the worker-side ones tell each other each step (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Copy ``keys[i]`` from the store into vLLM block ``block_ids[i]`` of KV group ``groups[i]``.

    ``is_async``: the request waits outside the step (WAITING_FOR_REMOTE_KVS) until the
    worker reports it in ``finished_recving``; otherwise the step's forward needs the blocks.
    ``groups``: a hybrid model's entries, group after group (empty: every entry is group 0).
    """

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    is_async: bool
    groups: tuple[int, ...] = ()

    def runs(self) -> list[tuple[int, slice]]:
        """(group, entries) per group, in order (see ``group_runs``)."""
        return group_runs(self.groups, len(self.keys))


@dataclass(frozen=True)
class SaveSpec:
    """After this step's forward, copy vLLM block ``block_ids[i]`` of KV group ``groups[i]``
    to the store as ``keys[i]`` (``groups`` as in LoadSpec); then make ``cool``'s blocks (per
    sliding-window group, its keys in prefix order) the store's next victims."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    groups: tuple[int, ...] = ()
    cool: tuple[tuple[bytes, ...], ...] = ()

    def runs(self) -> list[tuple[int, slice]]:
        return group_runs(self.groups, len(self.keys))


def group_runs(groups: tuple[int, ...], num_entries: int) -> list[tuple[int, slice]]:
    """The runs of equal groups in ``groups``: (group, slice of the entries); one run of group 0
    when ``groups`` is empty."""
    if not groups:
        return [(0, slice(0, num_entries))] if num_entries else []
    assert len(groups) == num_entries, f"{len(groups)} groups for {num_entries} entries"
    runs: list[tuple[int, slice]] = []
    start = 0
    for i in range(1, num_entries + 1):
        if i == num_entries or groups[i] != groups[start]:
            runs.append((groups[start], slice(start, i)))
            start = i
    return runs


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
