"""DiskTier against a plain-dict model through write / overwrite / delete / read / corrupt / reopen."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.tiers.disk import DiskTier

PAYLOAD = 100
SLOT = 4096
NUM_SLOTS = 12


def payload_for(key: bytes, version: int) -> bytes:
    return hashlib.shake_128(key + version.to_bytes(4, "little")).digest(PAYLOAD)


class DiskModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="disk-model-"))
        self.tier = self._open()
        self.model: dict[bytes, tuple[int, int]] = {}  # key -> (slot, version)
        self.corrupt: set[bytes] = set()  # keys whose slot bytes were flipped
        self.next_key = 0

    def _open(self) -> DiskTier:
        return DiskTier(self.root / "d", NUM_SLOTS * SLOT, PAYLOAD, sync=False)

    def _write(self, keys: list[bytes], versions: list[int]) -> None:
        slots = self.tier.allocate(len(keys))
        payloads = [memoryview(payload_for(k, v)) for k, v in zip(keys, versions, strict=True)]
        self.tier.write(keys, slots, payloads, [f"v{v}" for v in versions], "layout")
        for key, slot, version in zip(keys, slots, versions, strict=True):
            self.model[key] = (slot, version)
            self.corrupt.discard(key)

    @rule(n=st.integers(1, 5))
    def write_new(self, n: int) -> None:
        if self.tier.num_free < n:
            return
        keys = [hashlib.sha256(b"%d" % (self.next_key + i)).digest() for i in range(n)]
        self.next_key += n
        self._write(keys, [0] * n)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def overwrite(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3, unique=True))
        if self.tier.num_free >= len(keys):
            self._write(keys, [self.model[k][1] + 1 for k in keys])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        self.tier.delete(keys)
        for key in keys:
            del self.model[key]
            self.corrupt.discard(key)

    @rule(n=st.integers(1, 4))
    def reserve_and_release(self, n: int) -> None:
        if self.tier.num_free >= n:
            self.tier.release(self.tier.allocate(n))

    @precondition(lambda self: set(self.model) - self.corrupt)
    @rule(data=st.data())
    def flip_a_byte(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(set(self.model) - self.corrupt)))
        offset = self.model[key][0] * SLOT + data.draw(st.integers(0, PAYLOAD - 1))
        with open(self.root / "d" / "slab-000.bin", "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x01]))
        self.corrupt.add(key)

    @precondition(lambda self: self.model)
    @rule()
    def read_everything(self) -> None:
        keys = sorted(self.model)
        outs = [torch.zeros(PAYLOAD, dtype=torch.uint8) for _ in keys]
        errors_before = self.tier.errors
        flags = self.tier.read(keys, [self.model[k][0] for k in keys], outs)
        for key, out, good in zip(keys, outs, flags, strict=True):
            assert good == (key not in self.corrupt), (
                f"{key.hex()}: read {good}, corrupt {key in self.corrupt}"
            )
            if good:
                assert bytes(out.numpy()) == payload_for(key, self.model[key][1])
        assert self.tier.errors - errors_before == len(self.corrupt)
        for key in self.corrupt:
            del self.model[key]
        self.corrupt.clear()

    @rule()
    def reopen(self) -> None:
        self.tier.close()
        self.tier = self._open()

    @invariant()
    def catalog_matches_model(self) -> None:
        assert {e.key: e.slot for e in self.tier.entries()} == {k: s for k, (s, _) in self.model.items()}
        assert self.tier.num_used == len(self.model)
        assert self.tier.num_free == NUM_SLOTS - len(self.model)
        self.tier.check_integrity()

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.root, ignore_errors=True)


TestDiskModel = DiskModel.TestCase
TestDiskModel.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
