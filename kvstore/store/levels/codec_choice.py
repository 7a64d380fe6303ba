"""``disk_codec="auto"``: the disk tier stores int8 blocks only where that reads faster.

A lossy disk reads about half the bytes and then decodes them. On a slow drive the saved
transfer wins; on a fast one (or a tmpfs) the decode can cost more than it saves, and the
lossy tier would be slower than a raw one while also being inexact. So "auto" measures, the
first time a directory serves as a disk tier: it writes ``PROBE_BYTES`` of random blocks of
the store's layout raw and int8-encoded into two scratch tiers beside the directory (on the
same filesystem), reads each back cold through the store's own read path (O_DIRECT, the page
cache dropped, decode included) ``ROUNDS`` times in turns, and picks int8 when its median read
is at least ``MIN_GAIN`` faster, else none (exact bytes when compressing gains nothing). The
choice and what it measured are written to ``codec-choice.json`` in the directory, and every
later open takes it from there: a directory's representation never flips with the noise of
a remeasurement (its blocks would become misses). Delete the file to measure again.

A layout int8 cannot encode (an engine's quantized pages) is stored as it is, unmeasured.
Where the probe cannot run (a full or failing filesystem), the store opens raw, says so once,
records nothing, and measures again at its next open.
"""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvstore.codecs import AUTO, get_codec
from kvstore.config import PAGE, StoreConfig
from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.store.index import BlockEntry
from kvstore.store.levels.build import tenant_policy
from kvstore.store.levels.coding import LevelCodec
from kvstore.store.levels.disk_level import DiskLevel
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_files import drop_page_cache
from kvstore.tiers.errors import TierError

log = logging.getLogger("kvstore.store")

CANDIDATE = "int8"
CHOICE_FILE = "codec-choice.json"
PROBE_BYTES = 16 << 20  # raw bytes of the probe's blocks (at least MIN_BLOCKS, at most MAX_BLOCKS)
MIN_BLOCKS, MAX_BLOCKS = 4, 128
ROUNDS = 5
MIN_GAIN = 1.05  # int8's median read must be this many times faster than raw's


def resolve_disk_codec(config: StoreConfig) -> StoreConfig:
    """``config`` with ``disk_codec="auto"`` replaced by the directory's choice (recorded, or
    measured now and recorded); any other config as it is.

    Raises:
        ConfigError: the recorded choice is unreadable (the message names the file).
    """
    settings = config.settings
    if settings.disk_codec != AUTO or settings.disk_path is None:
        return config
    path = Path(settings.disk_path)
    chosen = recorded_choice(path)
    if chosen is None:
        try:
            chosen, measured = measure(config)
        except (TierError, OSError) as exc:  # the tier's own open will say what is wrong, if anything
            log.warning("disk_codec=auto could not measure %s (%s): none for now, measured again at the next "
                        "open", path, exc)
            return replace(config, settings=replace(settings, disk_codec="none"))
        path.mkdir(exist_ok=True)  # its parent exists: the probe ran beside it
        (path / CHOICE_FILE).write_text(json.dumps({"codec": chosen, **measured}, indent=1) + "\n")
        if "raw_ms" in measured:
            log.info("disk_codec=auto chose %s for %s: a cold read of %d blocks took %.1f ms int8, %.1f ms raw "
                     "(recorded in %s)", chosen, path, measured["blocks"], measured["int8_ms"], measured["raw_ms"],
                     CHOICE_FILE)
    return replace(config, settings=replace(settings, disk_codec=chosen))


def recorded_choice(path: Path) -> str | None:
    """The codec ``path``'s choice file names, or None where it has none."""
    record = path / CHOICE_FILE
    if not record.is_file():
        return None
    try:
        chosen = json.loads(record.read_text())["codec"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{record} is unreadable ({exc}); delete it to measure the disk again") from None
    if chosen not in ("none", CANDIDATE):
        raise ConfigError(f"{record} names codec {chosen!r}, not none or {CANDIDATE}; delete it to measure again")
    return str(chosen)


def measure(config: StoreConfig) -> tuple[str, dict[str, Any]]:
    """The codec a cold read on ``config``'s disk favours, and what was measured."""
    try:
        get_codec(CANDIDATE).encoded_bytes(config.codec_layout)
        if config.pages != "none":
            raise LayoutMismatchError("quantized pages")
    except LayoutMismatchError as exc:
        return "none", {"reason": f"{CANDIDATE} cannot store this layout's blocks ({exc})"}
    path = Path(config.settings.disk_path)  # type: ignore[arg-type]
    layout = config.layout
    n = max(MIN_BLOCKS, min(MAX_BLOCKS, PROBE_BYTES // layout.bytes_per_block))
    blocks = torch.randn((n, *layout.block_shape), generator=torch.Generator().manual_seed(0)).to(layout.dtype)
    rows = list(blocks.view(torch.uint8).reshape(n, -1))
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}-codec-probe-", dir=path.parent))
    probes: dict[str, _Probe] = {}
    times: dict[str, list[float]] = {"none": [], CANDIDATE: []}
    try:
        for codec in times:
            probes[codec] = _Probe(scratch / codec, config, codec, rows)
        out = list(torch.empty_like(blocks).view(torch.uint8).reshape(n, -1))  # rows of one tensor, as a get's
        for probe in probes.values():
            probe.read(out)  # warm: threads and staging, as a running store's are
        for r in range(ROUNDS):
            for codec in (("none", CANDIDATE) if r % 2 == 0 else (CANDIDATE, "none")):
                times[codec].append(probes[codec].read(out, cold=True))
    finally:
        for probe in probes.values():
            probe.close()
        shutil.rmtree(scratch, ignore_errors=True)
    raw, coded = statistics.median(times["none"]), statistics.median(times[CANDIDATE])
    chosen = CANDIDATE if raw >= MIN_GAIN * coded else "none"
    return chosen, {"blocks": n, "raw_ms": round(raw * 1e3, 3), "int8_ms": round(coded * 1e3, 3),
                    "rounds": ROUNDS, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


class _Probe:
    """A scratch disk level holding ``rows`` under ``codec``, read as the store reads."""

    def __init__(self, path: Path, config: StoreConfig, codec: str, rows: list[torch.Tensor]) -> None:
        coding = None if codec == "none" else LevelCodec(get_codec(codec), config.layout, PAGE)
        payload = coding.stored_bytes if coding is not None else config.layout.bytes_per_block
        slot = -(-payload // PAGE) * PAGE
        tier = DiskTier(path, len(rows) * slot, payload, sync=False, direct_io=config.direct_io)
        self.level = DiskLevel(tier, 1, tenant_policy("lru"), "all", "probe", coding)
        self.keys = [i.to_bytes(32, "big") for i in range(len(rows))]
        self.slots = tier.allocate(len(rows))
        entries = [BlockEntry(key, None, "", 0.0, [None, slot]) for key, slot in zip(self.keys, self.slots, strict=True)]
        if not self.level.write(entries, self.slots, rows):
            self.level.close()
            raise OSError(f"the disk_codec=auto probe could not write to {path}: {self.level.last_error}")

    def read(self, out: list[torch.Tensor], cold: bool = False) -> float:
        if cold:
            drop_page_cache(self.level.tier.path)
        t0 = time.perf_counter()
        ok = self.level.read(self.keys, self.slots, out)
        elapsed = time.perf_counter() - t0
        if not all(ok):
            raise OSError(f"the disk_codec=auto probe could not read back {ok.count(False)} blocks")
        return elapsed

    def close(self) -> None:
        self.level.close()

