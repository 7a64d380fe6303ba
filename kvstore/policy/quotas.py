"""Quotas per tenant and tier: soft and hard limits, in bytes or as a share of the tier.

- A **soft** quota is a claim to protection: a tenant over its soft quota in a tier loses its
  blocks there first (the tier's ``TenantPolicy`` picks victims from the tenant fullest
  relative to its soft quota). Under it, its blocks leave only when no tenant is over.
- A **hard** quota (host RAM, where puts land) is a cap: a put that would take the tenant past
  it first takes the room of the tenant's own least valuable blocks there (its own policy's
  victims); blocks that still find no room (the tenant's blocks all pinned or being read) are
  refused: not stored, counted in the tenant's ``refused``, never an error to the caller. A
  read promotes the tenant's lower-tier blocks into host RAM only within it too (the rest are
  served without a host copy).

A limit is bytes (an int: of the tier's slots, so of encoded blocks under a codec) or a share
of the tier (a float in (0, 1], or text "25%"); it is turned into blocks per tier
(``Limit.blocks``: rounded down). ``QuotaTable`` holds every tenant's quotas, by tier name
(``"*"`` for every tier); a tenant absent from the table has no quota: no protection, no cap.
Quotas are set on a store at run time (``TieredStore.set_quotas``); the daemon's default is an
equal soft share of every tier for each tenant of its tokens file (``QuotaTable.equal_shares``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import ConfigError

EVERY_TIER = "*"
HARD_TIERS = ("host",)  # a hard quota applies where puts land (see the module docstring)
KINDS = ("soft", "hard")
MAX_BYTES = (1 << 63) - 1  # the largest size (kvstore/services/common/sizes.py: the largest file offset)


@dataclass(frozen=True)
class Limit:
    """Bytes or a share of a tier: exactly one of the two."""

    bytes: int | None = None
    share: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.share is None):
            raise ConfigError(f"a quota limit is bytes or a share, exactly one; got bytes={self.bytes!r}, "
                              f"share={self.share!r}")
        if self.bytes is not None and (type(self.bytes) is not int or self.bytes < 0):
            raise ConfigError(f"a quota in bytes must be an integer >= 0, got {self.bytes!r}")
        if self.bytes is not None and self.bytes > MAX_BYTES:
            raise ConfigError(f"a quota of {self.bytes} bytes is past the largest size, {MAX_BYTES} bytes")
        if self.share is not None and not (isinstance(self.share, float) and math.isfinite(self.share)
                                           and 0 < self.share <= 1):
            raise ConfigError(f"a quota share must be in (0, 1] (or \"1%\" to \"100%\"), got {self.share!r}")

    @classmethod
    def parse(cls, value: Any, parse_bytes: Callable[[str], int] | None = None) -> Limit:
        """An int (bytes), a float (share), "N%" (share), or size text through ``parse_bytes``
        ("2GiB"; a service passes its size parser).

        Raises:
            ConfigError: naming the value and what a limit may be.
        """
        if isinstance(value, bool):
            raise ConfigError(f"a quota limit is bytes, a share or \"N%\", got {value!r}")
        if isinstance(value, int):
            return cls(bytes=value)
        if isinstance(value, float):
            return cls(share=value)
        if isinstance(value, str):
            text = value.strip()
            if text.endswith("%"):
                try:
                    percent = float(text[:-1])
                except ValueError:
                    raise ConfigError(f"a quota share must be a number of percent, got {value!r}") from None
                return cls(share=percent / 100)
            if parse_bytes is not None:
                return cls(bytes=parse_bytes(text))
        sizes = ", or text like '2GiB'" if parse_bytes else ""
        raise ConfigError(f"a quota limit is bytes (an integer{sizes}), a share in (0, 1] or 'N%'; got {value!r}")

    def blocks(self, num_slots: int, slot_bytes: int) -> int:
        """The limit in blocks of a tier of ``num_slots`` slots of ``slot_bytes`` (rounded down)."""
        if self.bytes is not None:
            return self.bytes // slot_bytes
        assert self.share is not None
        return math.floor(self.share * num_slots + 1e-9)

    def describe(self) -> str | int:
        """As written back: bytes as an int, a share as "N%" (six significant digits: a share of
        1e-9 is "1e-07%", which reads back as a share, never "0%", which does not)."""
        return self.bytes if self.bytes is not None else f"{100 * self.share:.6g}%"  # type: ignore[operator]


@dataclass(frozen=True)
class TierQuota:
    """One tenant's quota in one tier; None: no such limit."""

    soft: Limit | None = None
    hard: Limit | None = None

    def __post_init__(self) -> None:
        soft, hard = self.soft, self.hard
        if soft is None or hard is None:
            return
        if soft.bytes is not None and hard.bytes is not None and hard.bytes < soft.bytes:
            raise ConfigError(f"a hard quota ({hard.bytes} bytes) below the soft one ({soft.bytes} bytes)")
        if soft.share is not None and hard.share is not None and hard.share < soft.share:
            raise ConfigError(f"a hard quota ({hard.describe()}) below the soft one ({soft.describe()})")

    def as_dict(self) -> dict[str, Any]:
        return {kind: limit.describe() for kind, limit in (("soft", self.soft), ("hard", self.hard))
                if limit is not None}


@dataclass(frozen=True)
class QuotaTable:
    """Every tenant's quotas: ``tenants[tenant][tier]`` (tier ``"*"``: every tier without its
    own entry). Frozen: a change builds a new table (``with_tenant``)."""

    tenants: Mapping[str, Mapping[str, TierQuota]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rows = {t: dict(q) for t, q in self.tenants.items()}
        for tenant, tiers in rows.items():
            try:
                named = isinstance(tenant, str) and len(tenant.encode()) <= 255
            except UnicodeEncodeError:  # a lone surrogate: JSON's "\ud800"
                named = False
            if not named:
                raise ConfigError(f"a tenant name is a str of at most 255 UTF-8 bytes, got {tenant!r:.80}")
            for tier, quota in tiers.items():
                if not isinstance(quota, TierQuota):
                    raise ConfigError(f"tenant {tenant!r} tier {tier!r}: expected a TierQuota, got {quota!r}")
        object.__setattr__(self, "tenants", rows)

    @classmethod
    def equal_shares(cls, tenants: Iterable[str]) -> QuotaTable:
        """An equal soft share of every tier for each of ``tenants`` (the daemon's default)."""
        names = list(dict.fromkeys(tenants))
        if not names:
            return cls()
        share = Limit(share=1.0 / len(names))
        return cls({name: {EVERY_TIER: TierQuota(soft=share)} for name in names})

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], parse_bytes: Callable[[str], int] | None = None,
                  where: str = "quotas") -> QuotaTable:
        """``{tenant: {tier: {"soft": limit, "hard": limit}}}`` (TOML, JSON), checked.

        Raises:
            ConfigError: naming ``where``, the tenant and tier, for anything else.
        """
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{where} must be a table of tenants, got {type(doc).__name__}")
        return cls({tenant: parse_tiers(tiers, parse_bytes, f"{where}.{tenant}") for tenant, tiers in doc.items()})

    def with_tenant(self, tenant: str, tiers: Mapping[str, TierQuota | None]) -> QuotaTable:
        """This table with ``tenant``'s quotas in ``tiers`` replaced (None removes one)."""
        rows = {t: dict(q) for t, q in self.tenants.items()}
        row = rows.setdefault(tenant, {})
        for tier, quota in tiers.items():
            if quota is None:
                row.pop(tier, None)
            else:
                row[tier] = quota
        if not row:
            del rows[tenant]
        return QuotaTable(rows)

    def merged(self, other: QuotaTable) -> QuotaTable:
        """This table with ``other``'s tenants' tiers laid over it."""
        out = self
        for tenant, tiers in other.tenants.items():
            out = out.with_tenant(tenant, tiers)
        return out

    def restricted(self, tiers: Iterable[str]) -> QuotaTable:
        """This table without the entries of tiers other than ``tiers`` (and ``"*"``): a
        daemon's namespace whose share holds no disk tier takes the rest."""
        keep = {*tiers, EVERY_TIER}
        rows = {t: {tier: q for tier, q in row.items() if tier in keep} for t, row in self.tenants.items()}
        return QuotaTable({t: row for t, row in rows.items() if row})

    def quota(self, tenant: str, tier: str) -> TierQuota | None:
        tiers = self.tenants.get(tenant)
        if tiers is None:
            return None
        return tiers.get(tier, tiers.get(EVERY_TIER))

    def limits(self, tier: str, num_slots: int, slot_bytes: int) -> tuple[dict[str, int] | None, dict[str, int]]:
        """``(soft, hard)`` in blocks of one tier, per tenant with such a limit there; soft is
        None when no tenant has any quota in the tier (its policy stays shared)."""
        soft: dict[str, int] = {}
        hard: dict[str, int] = {}
        for tenant in self.tenants:
            quota = self.quota(tenant, tier)
            if quota is None:
                continue
            if quota.soft is not None:
                soft[tenant] = quota.soft.blocks(num_slots, slot_bytes)
            if quota.hard is not None and tier in HARD_TIERS:
                hard[tenant] = quota.hard.blocks(num_slots, slot_bytes)
        return (soft if soft or hard else None), hard

    def check_tiers(self, tiers: Iterable[str]) -> None:
        """ConfigError for a tier name not in ``tiers`` (nor ``"*"``), or a hard quota where
        none applies."""
        known = set(tiers)
        for tenant, row in self.tenants.items():
            for tier, quota in row.items():
                if tier != EVERY_TIER and tier not in known:
                    why = " (the remote tier takes no quota: Redis evicts it, shared by every store)" \
                        if tier == "remote" else ""
                    raise ConfigError(f"quota of tenant {tenant!r}: no tier {tier!r}{why}; "
                                      f"tiers: {sorted(known)} or {EVERY_TIER!r} for all")
                if quota.hard is not None and tier not in (*HARD_TIERS, EVERY_TIER):
                    raise ConfigError(f"quota of tenant {tenant!r}: a hard quota applies to {list(HARD_TIERS)} "
                                      f"(where puts land), not {tier!r}; give {tier!r} a soft quota")

    def as_dict(self) -> dict[str, dict[str, dict[str, Any]]]:
        return {tenant: {tier: q.as_dict() for tier, q in tiers.items()} for tenant, tiers in self.tenants.items()}


def parse_tiers(tiers: Any, parse_bytes: Callable[[str], int] | None = None,
                where: str = "quota") -> dict[str, TierQuota]:
    """``{tier: {"soft": ..., "hard": ...}}`` -> TierQuota per tier; an empty table: no quota
    in that tier. ConfigError naming ``where`` and the key."""
    if not isinstance(tiers, Mapping):
        raise ConfigError(f"{where} must be a table of tiers ({{\"host\": {{\"soft\": \"25%\"}}}}), "
                          f"got {type(tiers).__name__}")
    out: dict[str, TierQuota] = {}
    for tier, kinds in tiers.items():
        if not isinstance(kinds, Mapping):
            raise ConfigError(f"{where}.{tier} must be a table with soft and/or hard, got {kinds!r}")
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise ConfigError(f"{where}.{tier}: unknown keys {unknown}; known: {list(KINDS)}")
        try:
            limits = {kind: Limit.parse(kinds[kind], parse_bytes) for kind in KINDS if kind in kinds}
            out[str(tier)] = TierQuota(**limits)
        except ConfigError as exc:
            raise ConfigError(f"{where}.{tier}: {exc}") from None
    return out
