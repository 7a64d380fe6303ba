"""The levels a ``StoreConfig`` describes: the indexed cascade (host RAM, then disk) and the
shared levels below it (the remote tier), each under its configured codec.

Every indexed level's policy is a ``TenantPolicy`` around the configured one (blocks per
tenant, quotas; its owner lookup is bound by the cascade, which owns the index). Admission:
``disk_admission`` on the disk level, ``remote_admission`` on the remote; a ``tinylfu`` one
reads an access sketch that host's policy feeds with every put and hit.
"""

from __future__ import annotations

import functools

from kvstore.codecs import get_codec
from kvstore.config import PAGE, StoreConfig
from kvstore.kernels.pages import PAGE_CODES
from kvstore.keys import Namespace
from kvstore.policy.admission import AdmissionPolicy, TinyLFU, make_admission
from kvstore.policy.eviction import DeferredAccess, Key, make_policy
from kvstore.policy.sketch import FrequencySketch
from kvstore.policy.tenant_policy import TenantPolicy
from kvstore.store.levels.base import Level
from kvstore.store.levels.coding import LevelCodec
from kvstore.store.levels.disk_level import CODED_SUFFIX, DiskLevel
from kvstore.store.levels.host_level import HostLevel
from kvstore.store.levels.shared import SharedLevel
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier


def _unbound(key: Key) -> str:
    raise AssertionError("a level's TenantPolicy is used before the cascade bound its owner lookup")


def tenant_policy(name: str) -> TenantPolicy:
    """A level's policy: ``name`` (kvstore.policy.eviction.POLICIES) per tenant or shared."""
    return TenantPolicy(functools.partial(make_policy, name), _unbound)


def build_levels(config: StoreConfig, namespace: Namespace) -> list[Level]:
    """The cascade a config describes, fastest first: host RAM, then disk when configured.
    Each level stores blocks under its configured codec (``*_codec``)."""
    layout = config.layout
    host_coding = _coding(config, "host", 1)
    payload = host_coding.stored_bytes if host_coding else layout.bytes_per_block
    host = HostTier(config.settings.host_bytes, payload, pin_memory=config.pin_host_memory, shared=config.shared_host)
    # host hits are on readers' critical path: their policy bookkeeping waits for the next write
    host_policy = tenant_policy(config.host_policy)
    levels: list[Level] = [HostLevel(host, DeferredAccess(host_policy), host_coding)]
    if config.settings.disk_path is not None:
        disk_coding = _coding(config, "disk", PAGE)
        payload = disk_coding.stored_bytes if disk_coding else layout.bytes_per_block
        # A directory holding this namespace's blocks under another codec is reformatted (its
        # blocks become misses) rather than refused: the slot size changed with the codec.
        others = LevelCodec.sibling_sizes(layout, PAGE) - {payload}
        disk = DiskTier(config.settings.disk_path, config.settings.disk_bytes, payload, sync=config.sync_disk,
                        direct_io=config.direct_io, replaceable=others,
                        owners=(namespace.id, f"{namespace.id}{CODED_SUFFIX}"))
        levels.append(DiskLevel(disk, len(levels), tenant_policy(config.disk_policy), "all",
                                namespace.id, disk_coding))
    return levels


def build_admissions(config: StoreConfig, levels: list[Level], shared: list[SharedLevel]) -> None:
    """Give the disk level ``disk_admission`` and the shared levels ``remote_admission``; a
    ``tinylfu`` one gets the access sketch that host's policy feeds (sized to the largest
    local tier)."""
    sketch: FrequencySketch | None = None
    if TinyLFU.name in (config.settings.disk_admission, config.settings.remote_admission):
        sketch = FrequencySketch(max(level.num_slots for level in levels))
        host_policy = levels[0].tenants
        assert host_policy is not None
        host_policy.on_touch = sketch.add

    def make(name: str) -> AdmissionPolicy:
        return make_admission(name, sketch)

    for level in levels[1:]:
        level.admission = make(config.settings.disk_admission)
    for level_below in shared:
        level_below.admission = make(config.settings.remote_admission)


def _coding(config: StoreConfig, tier: str, align: int) -> LevelCodec | None:
    """The LevelCodec of ``tier``'s codec, None for a raw tier (blocks or pages kept as they are)."""
    codec = get_codec(config.tier_codec(tier))
    if not codec.lossy:
        return None
    return LevelCodec(codec, config.layout, align, PAGE_CODES[config.pages] if config.pages != "none" else None)


def build_shared(config: StoreConfig) -> list[SharedLevel]:
    """The shared levels below the local ones: the remote tier when ``remote_url`` is set."""
    if config.settings.remote_url is None:
        return []
    from kvstore.store.levels.remote_level import RemoteLevel
    from kvstore.tiers.remote import RemoteTier

    coding = _coding(config, "remote", 1)
    # Under a lossy codec the names and the layout id say so: stores with other codecs never
    # meet these values (nor take them for corrupt and delete them).
    suffix = "" if coding is None else f"-{coding.codec.name}"
    tier = RemoteTier(config.settings.remote_url, coding.stored_bytes if coding else config.layout.bytes_per_block,
                      config.layout.fingerprint() + suffix, prefix=config.settings.remote_prefix + suffix,
                      timeout_s=config.settings.remote_timeout_s, queue_blocks=config.settings.remote_queue_blocks)
    return [RemoteLevel(tier, config.settings.remote_writes, coding)]
