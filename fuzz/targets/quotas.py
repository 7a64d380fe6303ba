"""Quota and size parsing (kvstore/policy/quotas.py, kvstore/services/common/sizes.py): the
size text of every CLI flag and TOML key (``parse_size``), a quota map as the REST API and the
daemon's TOML hand it over (``QuotaTable.from_dict``), and ``kvstore replay --quotas FILE``.

Input: the first byte picks what the rest is (UTF-8, undecodable bytes replaced):

- 0: a size (``"512MiB"``);
- 1: a quota map as JSON, ``{tenant: {tier: {"soft": limit, "hard": limit}}}``;
- 2: a ``--quotas`` TOML file of ``[quotas.TENANT]`` tables (bytes as they are), read against
  a trace of tenants acme, flood and globex.

What must hold:

- bad input is a ConfigError (ReplayError for ``--quotas``), never another error;
- a size parsed is an int in [0, MAX_SIZE]; ``format_size`` of it, and the int itself, parse
  back to it;
- a table parsed obeys what its classes state (a limit is bytes, an int in [0, MAX_SIZE] as
  any size, or a share in (0, 1]; a hard limit is not below a soft one of its kind); written
  back as the REST API shows it (``as_dict``), it reads back the same; its limits in blocks of
  a tier are ints in [0, the tier's slots] for shares; ``check_tiers`` passes or refuses with
  ConfigError; ``restricted`` and ``merged`` keep every row they should.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.policy.quotas import EVERY_TIER, Limit, QuotaTable
from kvstore.services.common.sizes import MAX_SIZE, format_size, parse_size
from kvstore.tools.replay.command import quota_setting
from kvstore.tools.replay.trace import ReplayError, Trace

TENANTS = ["acme", "flood", "globex"]
TIERS = ("host", "disk")
NUM_SLOTS, SLOT_BYTES = 1000, 4096


def _check_size(text: str) -> None:
    try:
        size = parse_size(text)
    except ConfigError:
        return
    assert type(size) is int and 0 <= size <= MAX_SIZE, (text, size)
    assert parse_size(format_size(size)) == size, (text, size, format_size(size))
    assert parse_size(size) == size


def _check_limit(limit: Limit | None) -> None:
    if limit is None:
        return
    assert (limit.bytes is None) != (limit.share is None), limit
    if limit.bytes is not None:
        assert type(limit.bytes) is int and 0 <= limit.bytes <= MAX_SIZE, limit
        assert 0 <= limit.blocks(NUM_SLOTS, SLOT_BYTES) == limit.bytes // SLOT_BYTES
    else:
        assert limit.share is not None and math.isfinite(limit.share) and 0 < limit.share <= 1, limit
        assert 0 <= limit.blocks(NUM_SLOTS, SLOT_BYTES) <= NUM_SLOTS, limit


def _check_table(table: QuotaTable) -> None:
    for row in table.tenants.values():
        for quota in row.values():
            _check_limit(quota.soft)
            _check_limit(quota.hard)
            if quota.soft is not None and quota.hard is not None:
                for kind in ("bytes", "share"):
                    soft, hard = getattr(quota.soft, kind), getattr(quota.hard, kind)
                    assert soft is None or hard is None or soft <= hard, quota
    shown = table.as_dict()
    again = QuotaTable.from_dict(json.loads(json.dumps(shown)), parse_size)
    assert again.as_dict() == shown, (shown, again.as_dict())
    for tier in TIERS:
        soft, hard = table.limits(tier, NUM_SLOTS, SLOT_BYTES)
        assert all(type(n) is int and n >= 0 for n in [*(soft or {}).values(), *hard.values()]), (soft, hard)
    with contextlib.suppress(ConfigError):  # a tier the daemon lacks, a hard quota off host: refused
        table.check_tiers(TIERS)
    kept = table.restricted(["host"])
    assert all(set(row) <= {"host", EVERY_TIER} for row in kept.tenants.values()), kept
    rows = {t: r for t, r in shown.items() if r}  # (merging drops a tenant with no tier)
    assert table.merged(table).as_dict() == rows == QuotaTable().merged(table).as_dict()


def make() -> Callable[[bytes], None]:
    root = Path(tempfile.mkdtemp(prefix="kvstore-fuzz-quotas-"))
    atexit.register(shutil.rmtree, root, True)
    path = root / "quotas.toml"
    trace = Trace("fuzz", [[], [], []], {}, tenants=list(TENANTS))

    def check(data: bytes) -> None:
        if not data:
            return
        mode, body = data[0] % 3, data[1:]
        if mode == 0:
            _check_size(body.decode("utf-8", "replace"))
            return
        if mode == 1:
            try:
                doc = json.loads(body.decode("utf-8", "replace"))
            except (ValueError, RecursionError):
                return
            try:
                table = QuotaTable.from_dict(doc, parse_size)
            except ConfigError:
                return
        else:
            path.write_bytes(body)
            try:
                _, found = quota_setting(str(path), trace)
            except ReplayError:
                return
            assert found is not None
            assert set(found.tenants) <= set(TENANTS), found.tenants
            table = found
        _check_table(table)

    return check


def seeds() -> dict[str, bytes]:
    """Sizes as the docs and tests write them; quota maps of every limit form (bytes, sizes,
    shares, percentages, the ``"*"`` tier), as JSON and as a ``--quotas`` file."""
    sizes = ["512MiB", "20GiB", "1.5 MiB", "0", "4096", " 2 g ", "64mib", "1TB"]
    maps: dict[str, Any] = {
        "docs": {"acme": {"host": {"soft": "40%", "hard": "2GiB"}, "disk": {"soft": "25%"}}},
        "every-form": {"flood": {"*": {"soft": 0.25}, "host": {"soft": 1048576, "hard": "1.5 MiB"}},
                       "globex": {"host": {"soft": "12.5%", "hard": "100%"}, "disk": {}}},
    }
    toml = (b'[quotas.acme]\nhost = { soft = "40%", hard = "2GiB" }\ndisk = { soft = "25%" }\n\n'
            b'[quotas.flood]\n"*" = { soft = 0.25 }\nhost = { soft = 1048576, hard = "1.5 MiB" }\n')
    out = {f"size-{s.strip()}": b"\0" + s.encode() for s in sizes}
    out.update({f"map-{name}": b"\1" + json.dumps(doc).encode() for name, doc in maps.items()})
    out["replay-quotas-file"] = b"\2" + toml
    return out
