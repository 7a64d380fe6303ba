"""Registry: the daemon's namespaces (one TieredStore each), its tokens, its counters.

Capacity rule: the configured host and disk sizes are hard totals. They are cut into
``max_namespaces`` equal slots; a namespace takes one slot on its first hello (or at start,
when its disk directory already exists) and keeps it for the daemon's life.

Quotas (kvstore/policy/quotas.py): one table for the daemon, put in force in every namespace's
store (each applies it to its own share of the tiers): an equal soft share of every tier for
each tenant of the tokens file (``default_quotas="equal"``), then the tokens file's quotas,
then the config's ``[quotas]``; ``set_quota`` changes a tenant's at run time (admin REST).

Tenant isolation: a connection's tenant comes from its token. Every key a tenant sends is
scoped before it reaches a store: ``stored = SHA-256(SCOPE_TAG || lp(tenant) || key)``
(truncated to the key size), so no key a tenant can send names another tenant's block,
whatever salt it hashed its prompt with.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvstore.codecs import AUTO, get_codec, sizing_codec, stored_bytes
from kvstore.config import PAGE, StoreConfig
from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.keys import HASHES, Namespace
from kvstore.layout import KVLayout
from kvstore.policy.quotas import QuotaTable, TierQuota
from kvstore.protocol import Code, ProtocolError, layout_from_dict, layout_to_dict
from kvstore.services.common.tokens import Tokens
from kvstore.services.daemon.config import DaemonConfig
from kvstore.store import TieredStore
from kvstore.store.stats import TierCounters, is_count, tier_stats

SCOPE_TAG = b"kvstore/tenant-scope/v1\x00"
SCOPE_MEMO = 1 << 16  # memoised scoped keys per tenant (~13 MB at most)
SCOPE_MEMO_TENANTS = 64
COUNTERS = ("requests", "lookup_blocks", "hit_blocks", "put_blocks", "get_blocks",
            "bytes_in", "bytes_out", "errors")


SHARED_OCCUPANCY = ("capacity_bytes", "used_bytes", "num_blocks", "evictions", "nodes_up")


@dataclass
class NamespaceState:
    """One namespace the daemon serves: its store and its per-tenant counters."""

    id: str
    model_id: str
    layout: KVLayout
    hash_algo: str
    store: TieredStore
    scoped: bool = True
    counters: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: dict.fromkeys(COUNTERS, 0)))
    _memo: dict[str, dict[bytes, bytes]] = field(default_factory=dict, repr=False)

    def scope(self, tenant: str, keys: list[bytes]) -> list[bytes]:
        """The stored keys for a tenant's keys (identity for an embedded, unscoped store).

        Results are memoised per tenant (a bounded dict, cleared when full): engines look up
        the same prefixes again and again, and a hash costs more than a dict hit.
        """
        if not self.scoped:
            return keys
        memo = self._memo.get(tenant)
        if memo is None or len(memo) > SCOPE_MEMO:
            memo = self._memo[tenant] = {}
            if len(self._memo) > SCOPE_MEMO_TENANTS:
                self._memo.clear()
                self._memo[tenant] = memo
        n = self.store.hasher.key_bytes
        base = None
        out = []
        for key in keys:
            stored = memo.get(key)
            if stored is None:
                if base is None:
                    base = hashlib.sha256(SCOPE_TAG + struct.pack("<I", len(tenant.encode())) + tenant.encode())
                h = base.copy()
                h.update(key)
                stored = memo[key] = h.digest()[:n]
            out.append(stored)
        return out

    def count(self, tenant: str, **deltas: int) -> None:
        row = self.counters[tenant]
        for name, value in deltas.items():
            row[name] += value

    def describe(self) -> dict[str, Any]:
        tiers = self.store.stats()
        return {"id": self.id, "model_id": self.model_id, "layout": layout_to_dict(self.layout),
                "hash_algo": self.hash_algo, "block_bytes": self.layout.bytes_per_block,
                "num_blocks": len(self.store),
                "capacity_bytes": {t: s["capacity_bytes"] for t, s in tiers.items()},
                "codecs": self.store.view.codecs()}


class Registry:
    """Namespaces by id, created on first use within the configured totals. Thread-safe."""

    def __init__(self, config: DaemonConfig | None, tokens: Tokens) -> None:
        self.config = config
        self.tokens = tokens
        self._lock = threading.Lock()
        self._namespaces: dict[str, NamespaceState] = {}
        self.on_open: list[Callable[[TieredStore], None]] = []  # called with each store it opens (KV events)
        base = QuotaTable.equal_shares(tokens.tenants) if config is not None and config.default_quotas == "equal" \
            else QuotaTable()
        table = base.merged(tokens.quotas).merged(config.quotas if config is not None else QuotaTable())
        self._check_quota_tenants(table)
        if config is not None:
            table.check_tiers(self._quota_tiers())
        self.quota_table = table

    @classmethod
    def embedded(cls, store: TieredStore, tokens: Tokens | None = None) -> Registry:
        """A registry over one existing store (REST mounted in an embedding process)."""
        reg = cls(None, tokens or Tokens(None, None))
        ns = store.namespace
        reg._namespaces[ns.id] = NamespaceState(ns.id, ns.model_id, ns.layout, ns.hash_algo, store, scoped=False)
        reg.quota_table = store.quotas
        return reg

    def reopen_existing(self) -> None:
        """Open every namespace whose directory a previous run left (the catalog is the truth)."""
        assert self.config is not None
        root = self.config.data_dir / "namespaces"
        for manifest in sorted(root.glob("*/namespace.json")) if root.exists() else []:
            d = json.loads(manifest.read_text())
            self.open(d["model_id"], layout_from_dict(d["layout"]), d["hash_algo"])

    def open(self, model_id: str, layout: KVLayout, hash_algo: str = "sha256") -> NamespaceState:
        """The namespace of (model, layout, hash), opened on first use.

        Raises:
            ProtocolError: LAYOUT when all namespace slots are taken, the store cannot open, or
                the daemon holds this model's blocks in the same geometry but other KV groups
                (two engines that disagree on which layers slide: both layouts are named).
        """
        if hash_algo not in HASHES:
            raise ProtocolError(Code.LAYOUT, f"hash_algo must be one of {sorted(HASHES)}, got {hash_algo!r}")
        ns = Namespace(model_id, layout, hash_algo)
        with self._lock:
            state = self._namespaces.get(ns.id)
            if state is not None:
                return state
            for other in self._namespaces.values():
                if other.model_id == model_id and other.layout.groups != layout.groups \
                        and replace(other.layout, groups=()) == replace(layout, groups=()):
                    raise ProtocolError(Code.LAYOUT, f"model {model_id}: this daemon holds its blocks in KV groups "
                                        f"{other.layout.fingerprint()}, this client's are {layout.fingerprint()}; "
                                        "the two disagree on the model's attention layers")
            cfg = self.config
            if cfg is None or len(self._namespaces) >= cfg.max_namespaces:
                limit = cfg.max_namespaces if cfg else 1
                raise ProtocolError(Code.LAYOUT, f"all {limit} namespace slots are taken; cannot open "
                                    f"{model_id} {layout.fingerprint()}")
            store = TieredStore(self._store_config(ns))
            store.set_quotas(self.quota_table.restricted(store.levels))
            for hook in self.on_open:
                hook(store)
            state = NamespaceState(ns.id, model_id, layout, hash_algo, store)
            self._namespaces[ns.id] = state
            return state

    def _store_config(self, ns: Namespace) -> StoreConfig:
        """The namespace's store: the daemon's settings with this namespace's shares of the
        totals, its disk tier under data_dir (none when the share holds no block of its
        layout, and then no write_through either) and the hash its client chose."""
        cfg = self.config
        assert cfg is not None
        slot = -(-ns.layout.bytes_per_block // PAGE) * PAGE
        host, disk = cfg.host_bytes_per_namespace, cfg.disk_bytes_per_namespace
        if host < slot:
            raise ProtocolError(Code.CAPACITY, f"host share of {host} bytes per namespace is below one "
                                f"{slot}-byte block of {ns.layout.fingerprint()}")
        settings = replace(cfg.store_settings, host_bytes=host, hash_algo=ns.hash_algo, disk_path=None, disk_bytes=0,
                           write_policy="write_back")
        # "auto" is chosen when the namespace's store opens: a raw block's room, the larger, until then
        disk_codec = sizing_codec(cfg.store_settings.disk_codec)
        for tier in ("host", "disk", "remote"):
            codec = sizing_codec(getattr(cfg.store_settings, f"{tier}_codec"))
            try:
                codec.encoded_bytes(ns.layout)
            except LayoutMismatchError as exc:  # e.g. an engine's quantized pages (uint8) under int8
                raise ProtocolError(Code.LAYOUT, f"this daemon's {tier}_codec={codec.name!r} cannot hold blocks of "
                                    f"{ns.layout.fingerprint()} ({exc}); an engine with a quantized pool needs a "
                                    "daemon whose tiers keep blocks as they are (codec none)") from None
        if disk >= -(-stored_bytes(disk_codec, ns.layout, PAGE) // PAGE) * PAGE:
            where = cfg.data_dir / "namespaces" / ns.id
            where.mkdir(parents=True, exist_ok=True)
            manifest = {"model_id": ns.model_id, "layout": layout_to_dict(ns.layout), "hash_algo": ns.hash_algo}
            (where / "namespace.json").write_text(json.dumps(manifest, indent=1) + "\n")
            settings = replace(settings, disk_path=where / "disk", disk_bytes=disk, write_policy=cfg.store_settings.write_policy)
        return settings.store_config(ns.layout, ns.model_id, shared_host=cfg.shm, pin_host_memory=False)

    def namespaces(self) -> list[NamespaceState]:
        with self._lock:
            return list(self._namespaces.values())

    def get(self, ns_id: str) -> NamespaceState | None:
        with self._lock:
            return self._namespaces.get(ns_id)

    def find_model(self, model: str) -> list[NamespaceState]:
        """Namespaces whose model id (or namespace id) is ``model``."""
        return [s for s in self.namespaces() if model in (s.model_id, s.id)]

    def tiers(self) -> dict[str, dict[str, Any]]:
        """Per tier name, every counter summed over the namespaces, and the tier's codec.

        A daemon's configured tiers are there from its start, before any namespace opens: their
        ``capacity_bytes`` is the configured total (``--host-mem``, ``--disk-size``; every namespace
        slot's share), their use and counters start at zero. A shared tier (remote: its rows
        have ``nodes_up``) reports the cluster's own occupancy in every namespace: that part is
        taken once (the largest seen), not summed.
        """
        out: dict[str, dict[str, Any]] = {}
        cfg = self.config
        if cfg is not None:
            out["host"] = tier_stats(TierCounters(), cfg.store_settings.host_bytes, 0, 0)
            if cfg.disk_bytes_per_namespace >= PAGE:
                out["disk"] = tier_stats(TierCounters(), cfg.store_settings.disk_bytes, 0, 0)
            for tier, codec_name in (("host", cfg.store_settings.host_codec), ("disk", cfg.store_settings.disk_codec)):
                if tier in out:
                    out[tier].update(codec=codec_name, lossy=codec_name == AUTO or get_codec(codec_name).lossy)
            if cfg.store_settings.remote_url is not None:
                out["remote"] = dict(tier_stats(TierCounters(), 0, 0, 0), dropped=0, pending=0, nodes_up=0,
                                     round_trips=0, hint_hits=0, hint_misses=0, kept_used=0, replica_reads=0,
                                     codec=cfg.store_settings.remote_codec, lossy=get_codec(cfg.store_settings.remote_codec).lossy)
        configured = {"host", "disk"} & set(out)
        for state in self.namespaces():
            for tier, row in state.store.stats().items():
                acc = out.setdefault(tier, {k: 0 for k, v in row.items() if is_count(v)})
                shared = "nodes_up" in row
                for name, value in row.items():
                    if not is_count(value):
                        acc[name] = value  # codec and lossy: the same in every namespace
                    elif shared and name in SHARED_OCCUPANCY:
                        acc[name] = max(acc.get(name, 0), value)
                    elif name != "capacity_bytes" or tier not in configured:
                        acc[name] = acc.get(name, 0) + value
        return out

    def remote_nodes(self) -> list[dict[str, Any]]:
        """The remote tier's nodes (memory, evictions, breaker), as the first namespace sees
        them (every namespace's store talks to the same cluster); empty without a remote."""
        for state in self.namespaces():
            nodes = state.store.view.remote_nodes()
            if nodes:
                return nodes
        return []

    # ----------------------------------------------------------------------------- quotas, usage

    def _quota_tiers(self) -> list[str]:
        """The tiers a quota may name: the indexed ones (a shared tier's rows have nodes_up)."""
        return [tier for tier, row in self.tiers().items() if "nodes_up" not in row]

    def quota_tenants(self) -> set[str] | None:
        """The tenants a quota may name: the tokens file's and the admin's ``""``; None (any)
        on an open store, whose callers name their tenants themselves."""
        return None if self.tokens.is_open else {"", *self.tokens.tenants}

    def _check_quota_tenants(self, table: QuotaTable) -> None:
        """ConfigError for a quota of a tenant no token names."""
        known = self.quota_tenants()
        unknown = sorted(set(table.tenants) - known) if known is not None else []
        if unknown:
            raise ConfigError(f"quotas for unknown tenants {unknown}; the tokens name {sorted(known or ())}")

    def set_quota(self, tenant: str, tiers: dict[str, TierQuota | None]) -> QuotaTable:
        """Replace ``tenant``'s quotas in ``tiers`` (None removes one) in every namespace, now.

        Raises:
            ConfigError: an unknown tenant or tier, or a hard quota off host RAM; nothing
                changes then.
        """
        known = self._quota_tiers()  # (takes the lock itself)
        with self._lock:
            table = self.quota_table.with_tenant(tenant, tiers)
            self._check_quota_tenants(table)
            table.check_tiers(known)
            for state in self._namespaces.values():
                state.store.set_quotas(table.restricted(state.store.levels))
            self.quota_table = table
            return table

    def tenant_usage(self) -> dict[str, dict[str, Any]]:
        """Per tenant, its usage summed over the namespaces (TieredStore.tenant_stats: blocks,
        bytes, counters and quota limits in blocks, per tier)."""
        out: dict[str, dict[str, Any]] = {}
        for state in self.namespaces():
            for tenant, usage in state.store.view.tenant_stats().items():
                acc = out.setdefault(tenant, {"tiers": {}, "blocks": 0, "bytes": 0})
                acc["blocks"] += usage["blocks"]
                acc["bytes"] += usage["bytes"]
                for tier, row in usage["tiers"].items():
                    into = acc["tiers"].setdefault(tier, {})
                    for name, value in row.items():
                        if value is None:
                            into.setdefault(name, None)
                        else:
                            into[name] = (into.get(name) or 0) + value
        return out

    def tenant_counters(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for state in self.namespaces():
            for tenant, row in list(state.counters.items()):
                acc = out.setdefault(tenant, dict.fromkeys(COUNTERS, 0))
                for name, value in row.items():
                    acc[name] += value
        return out

    def close(self) -> None:
        for state in self.namespaces():
            state.store.close()
