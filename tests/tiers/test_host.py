"""HostTier: slot allocation, and copies in and out of the pool in raw or typed rows."""

from __future__ import annotations

import pytest
import torch

from kvstore.tiers.errors import TierFullError
from kvstore.tiers.host import PAGE, HostTier


@pytest.mark.parametrize("payload", [PAGE, 3 * PAGE, 1000], ids=["one-page", "three-pages", "padded"])
def test_rows_written_come_back_from_any_slots(payload: int) -> None:
    tier = HostTier(16 * PAGE * 3, payload)
    tier.pool.fill_(0xAB)  # a slot's padding after its payload must keep this
    src = torch.randint(0, 256, (6, payload), dtype=torch.uint8)
    slots = [7, 8, 9, 2, 3, 12]  # three runs
    tier.write(slots, src)
    dst = torch.zeros_like(src)
    tier.read(slots, dst)
    assert torch.equal(dst, src)
    one = torch.zeros((1, payload), dtype=torch.uint8)
    tier.read([3], one)
    assert torch.equal(one[0], src[4])
    assert bool((tier.pool[slots, payload:] == 0xAB).all())
    assert bool((tier.pool[[0, 1, 4, 5, 6, 10, 11, 13]] == 0xAB).all())  # other slots untouched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("row_shape", [(4, 2, 64), (3, 5, 8)], ids=["page-multiple", "padded"])
def test_typed_rows_read_the_same_bytes_as_raw_rows(dtype: torch.dtype, row_shape: tuple[int, ...]) -> None:
    payload = torch.empty(row_shape, dtype=dtype).nbytes
    tier = HostTier(8 * PAGE * 2, payload)
    blocks = torch.randn((3, *row_shape)).to(dtype)
    raw = blocks.view(torch.uint8).flatten(1)
    tier.write([5, 1, 2], raw)
    typed = torch.zeros_like(blocks)
    tier.read([5, 1, 2], typed)
    assert torch.equal(typed.view(torch.uint8), blocks.view(torch.uint8))
    # typed rows written read back raw, byte for byte
    tier.write([0], blocks[2:])
    back = torch.zeros((1, payload), dtype=torch.uint8)
    tier.read([0], back)
    assert torch.equal(back[0], raw[2])


def test_rows_of_the_wrong_width_are_refused_and_nothing_is_copied() -> None:
    tier = HostTier(4 * PAGE, PAGE)
    tier.write([0], torch.full((1, PAGE), 7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not one payload"):
        tier.write([0], torch.zeros((1, PAGE - 1), dtype=torch.uint8))
    with pytest.raises(ValueError, match="not one payload"):
        tier.read([0], torch.zeros((1, PAGE // 2), dtype=torch.float32))  # 8 KiB rows
    with pytest.raises(ValueError, match="not one payload"):
        tier.read([0], torch.zeros(PAGE, dtype=torch.uint8))  # no rows at all
    assert bool((tier.pool[0] == 7).all())


def test_slots_are_handed_out_lowest_first_and_never_twice() -> None:
    tier = HostTier(4 * PAGE, PAGE)
    assert tier.allocate(3) == [0, 1, 2]
    tier.release([1])
    assert tier.allocate(2) == [1, 3]
    with pytest.raises(TierFullError, match="need 1 host slots, 0 free of 4"):
        tier.allocate(1)
    tier.check_integrity([0, 1, 2, 3])
    with pytest.raises(AssertionError, match="leak"):
        tier.check_integrity([0, 1, 2])
