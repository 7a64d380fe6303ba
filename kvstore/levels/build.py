"""The levels a ``StoreConfig`` describes: the indexed cascade (host RAM, then disk) and the
shared levels below it (the remote tier), each under its configured codec."""

from __future__ import annotations

from kvstore.codecs import get_codec
from kvstore.config import PAGE, StoreConfig
from kvstore.eviction import DeferredAccess, make_policy
from kvstore.kernels.pages import PAGE_CODES
from kvstore.keys import Namespace
from kvstore.levels.base import Level
from kvstore.levels.coding import LevelCodec
from kvstore.levels.disk_level import CODED_SUFFIX, DiskLevel
from kvstore.levels.host_level import HostLevel
from kvstore.levels.shared import SharedLevel
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier


def build_levels(config: StoreConfig, namespace: Namespace) -> list[Level]:
    """The cascade a config describes, fastest first: host RAM, then disk when configured.
    Each level stores blocks under its configured codec (``*_codec``)."""
    layout = config.layout
    host_coding = _coding(config, "host", 1)
    payload = host_coding.stored_bytes if host_coding else layout.bytes_per_block
    host = HostTier(config.host_bytes, payload, pin_memory=config.pin_host_memory, shared=config.shared_host)
    # host hits are on readers' critical path: their policy bookkeeping waits for the next write
    levels: list[Level] = [HostLevel(host, DeferredAccess(make_policy(config.host_policy)), host_coding)]
    if config.disk_path is not None:
        disk_coding = _coding(config, "disk", PAGE)
        payload = disk_coding.stored_bytes if disk_coding else layout.bytes_per_block
        # A directory holding this namespace's blocks under another codec is reformatted (its
        # blocks become misses) rather than refused: the slot size changed with the codec.
        others = LevelCodec.sibling_sizes(layout, PAGE) - {payload}
        disk = DiskTier(config.disk_path, config.disk_bytes, payload, sync=config.sync_disk,
                        direct_io=config.direct_io, replaceable=others,
                        owners=(namespace.id, f"{namespace.id}{CODED_SUFFIX}"))
        levels.append(DiskLevel(disk, len(levels), make_policy(config.disk_policy), config.disk_admission,
                                namespace.id, disk_coding))
    return levels


def _coding(config: StoreConfig, tier: str, align: int) -> LevelCodec | None:
    """The LevelCodec of ``tier``'s codec, None for a raw tier (blocks or pages kept as they are)."""
    codec = get_codec(config.tier_codec(tier))
    if not codec.lossy:
        return None
    return LevelCodec(codec, config.layout, align, PAGE_CODES[config.pages] if config.pages != "none" else None)


def build_shared(config: StoreConfig) -> list[SharedLevel]:
    """The shared levels below the local ones: the remote tier when ``remote_url`` is set."""
    if config.remote_url is None:
        return []
    from kvstore.levels.remote_level import RemoteLevel
    from kvstore.tiers.remote import RemoteTier

    coding = _coding(config, "remote", 1)
    # Under a lossy codec the names and the layout id say so: stores with other codecs never
    # meet these values (nor take them for corrupt and delete them).
    suffix = "" if coding is None else f"-{coding.codec.name}"
    tier = RemoteTier(config.remote_url, coding.stored_bytes if coding else config.layout.bytes_per_block,
                      config.layout.fingerprint() + suffix, prefix=config.remote_prefix + suffix,
                      timeout_s=config.remote_timeout_s, queue_blocks=config.remote_queue_blocks)
    return [RemoteLevel(tier, config.remote_writes, coding)]
