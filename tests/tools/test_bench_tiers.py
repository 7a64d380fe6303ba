"""``kvstore bench tiers``' disk rows at a small size, on real files: the store's cold read
checks every byte it gets back, dd reads the very extents that hold the blocks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvstore.tools.bench.harness import BENCH_LAYOUT, scratch_dir
from kvstore.tools.bench.tiers import CEILING_GBPS, bench_disk

from factories import require


def test_the_disk_rows_time_a_verified_cold_read_against_dd_at_4_mib_requests(tmp_path: Path) -> None:
    require(shutil.which("dd") is not None, "dd (coreutils)")
    (read, write), mode = bench_disk(8, 2, tmp_path)
    assert mode in ("O_DIRECT", "buffered+fadvise")
    assert read.name.startswith(f"disk cold read ({mode}), 8 x 192 KiB: ") and read.name.endswith(" GB/s")
    assert read.baseline.startswith("dd") and "bs=4M" in read.baseline and read.target == ">= 0.6x"  # 1.5 MB: short
    assert read.ours_s > 0 and read.base_s > 0
    assert write.name.startswith("disk write") and write.ours_s > 0 and write.base_s > 0


def test_the_tmpfs_row_is_a_rate_against_the_stores_own_ceiling() -> None:
    shm = Path("/dev/shm")
    require(shm.is_dir() and shutil.which("dd") is not None, "/dev/shm and dd")
    with scratch_dir(str(shm), "test-tiers") as where:
        (read,), _mode = bench_disk(8, 2, where, "tmpfs slab", CEILING_GBPS)
    assert read.name.startswith("tmpfs slab cold read") and "(dd " in read.name
    assert read.ratio_kind == "budget" and read.baseline == f"{CEILING_GBPS:g} GB/s"
    assert read.base_s == pytest.approx(8 * BENCH_LAYOUT.bytes_per_block / CEILING_GBPS / 1e9)
    assert read.target == f"< {read.base_s * 1e3:.1f} ms"


def test_the_sweep_reads_each_size_without_promotion_and_promoting_into_a_small_and_a_large_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require(shutil.which("dd") is not None, "dd (coreutils)")
    import kvstore.tools.bench.tiers as tiers

    monkeypatch.setattr(tiers, "DISK_SIZES", (6, 12))
    rows = tiers.bench_disk_sweep(2, tmp_path)
    assert len(rows) == 6 and all(r.ours_s > 0 and r.base_s > 0 and "bs=4M" in r.baseline for r in rows)
    assert [r.name.split(": ")[0].split(", ", 1)[1] for r in rows] == [
        "6 x 192 KiB", "6 x 192 KiB, promotion='get' into a 4-block host tier",
        "6 x 192 KiB, promotion='get' into a 12-block host tier",
        "12 x 192 KiB", "12 x 192 KiB, promotion='get' into a 4-block host tier",
        "12 x 192 KiB, promotion='get' into a 24-block host tier",
    ]
    assert {r.target for r in rows} == {f">= {tiers.SMALL_READ_TARGET}x"}  # 1-2 MB: short reads
    assert not list(tmp_path.iterdir()), "the sweep left its scratch tiers behind"
