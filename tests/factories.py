"""Store factories shared by the store tests: small layouts, deterministic payloads, stores.

A plain module, not conftest.py: the engine tests have a conftest of their own, and two
modules named ``conftest`` cannot both be imported by name.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvstore import KVLayout, StoreConfig, TieredStore

SLOT = 4096  # every block of SMALL_LAYOUT fits one 4 KiB slot


SMALL_LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)


def payload_for(key: bytes, layout: KVLayout = SMALL_LAYOUT) -> torch.Tensor:
    """Deterministic block contents derived from the key, so any process can check them."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape, generator=gen).to(layout.dtype)


def blocks_for(keys: list[bytes], layout: KVLayout = SMALL_LAYOUT) -> torch.Tensor:
    if not keys:
        return torch.empty((0, *layout.block_shape), dtype=layout.dtype)
    return torch.stack([payload_for(k, layout) for k in keys])


def make_store(
    tmp_path: Path | None,
    host_blocks: int = 8,
    disk_blocks: int = 0,
    layout: KVLayout = SMALL_LAYOUT,
    **overrides: object,
) -> TieredStore:
    """A store over SMALL_LAYOUT with capacities given in blocks (4 KiB slots)."""
    kwargs: dict[str, object] = {"layout": layout, "model_id": "test-model", "host_bytes": host_blocks * SLOT}
    if disk_blocks:
        assert tmp_path is not None
        kwargs.update(disk_path=tmp_path / "disk", disk_bytes=disk_blocks * SLOT)
    kwargs.update(overrides)
    return TieredStore(StoreConfig(**kwargs))  # type: ignore[arg-type]


def chain(store: TieredStore, num_blocks: int, salt: int = 0, tenant: str = "") -> list[bytes]:
    """Keys of a prompt of ``num_blocks`` full blocks; different salts give unrelated chains."""
    bs = store.layout.block_size
    tokens = [salt * 100_000 + i for i in range(num_blocks * bs)]
    return store.block_keys(tokens, tenant=tenant)


def require(found: object, missing: str) -> None:
    """Skip the calling test when ``found`` is falsy; under CI (CI=true) fail instead: CI
    installs everything the suite drives (.ci/run), so a missing part there is a defect."""
    if found:
        return
    import os

    import pytest

    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {missing}")
    pytest.skip(missing)


def transformers_from_gguf(path: Path) -> Any:
    """transformers' own loading of a GGUF file, float32 and in eval mode: the reference the
    engine's GGUF models are held to (the test extra has transformers and accelerate)."""
    import importlib.util

    require(importlib.util.find_spec("transformers"), "transformers is not installed (pip extra 'test')")
    require(importlib.util.find_spec("accelerate"), "accelerate is not installed (transformers needs it for GGUF)")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def run_in_threads(worker: Callable[[int], None], num_threads: int, timeout: float = 120.0) -> None:
    """Run ``worker(i)`` on ``num_threads`` threads at once; re-raise the first exception any
    of them raised (an assertion in a worker thread fails the test, not just that thread)."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            worker(i)
        except BaseException as exc:  # reported to the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), f"a worker thread still runs after {timeout} s"
    if errors:
        raise errors[0]


class Run(NamedTuple):
    """A call running on its own thread (``started``); its exception, if any, lands in ``errors``."""

    thread: threading.Thread
    errors: list[BaseException]


def started(fn: Callable[[], object]) -> Run:
    """``fn`` running on its own thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # reported to the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return Run(thread, errors)


class HeldDiskWrite:
    """Holds up the disk level's first ``write`` (a write-through put's, outside the store
    lock) until ``gate`` is set; later writes go straight through."""

    def __init__(self, store: TieredStore) -> None:
        self.level = store.level("disk")
        self.original = self.level.write  # type: ignore[union-attr]
        self.inside, self.gate = threading.Event(), threading.Event()
        self.calls = 0
        self.level.write = self._write  # type: ignore[union-attr,method-assign]

    def _write(self, *args: Any) -> bool:
        self.calls += 1
        if self.calls == 1:
            self.inside.set()
            assert self.gate.wait(30)
        return bool(self.original(*args))

    def release(self, *runs: Run) -> None:
        """Let the held write go on; each of ``runs`` must then end, without an error."""
        self.gate.set()
        for thread, errors in runs:
            thread.join(30)
            assert not thread.is_alive(), "still running 30 s after the held disk write went on"
            assert not errors, errors


# where a store call waits for blocks being written outside the store lock (InFlight in
# kvstore/store/inflight.py): a test that holds a write waits for its other calls to get there
WRITE_WAITS = ("wait_written", "wait_all_written")


def crash_disk_write_once(store: TieredStore) -> None:
    """The disk level's next ``write`` raises (a bug, not a medium failure: those return
    False); the writes after it go through."""
    disk = store.level("disk")
    write = disk.write  # type: ignore[union-attr]

    def crash_once(*args: Any) -> bool:
        disk.write = write  # type: ignore[union-attr,method-assign]
        raise RuntimeError("a bug in the disk level")

    disk.write = crash_once  # type: ignore[union-attr,method-assign]


def finishes(fn: Callable[[], object], within: float = 5.0) -> Any:
    """``fn()``'s result, asserting it returned within ``within`` seconds (it must not wait
    for the held disk write)."""
    out: list[Any] = []
    thread, errors = started(lambda: out.append(fn()))
    thread.join(within)
    assert not thread.is_alive(), f"waited over {within} s: it is queued behind the held disk write"
    if errors:
        raise errors[0]
    return out[0]
