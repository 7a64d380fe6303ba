"""The levels of the cascade: one adapter per medium over its slot store (see base.Level), and
the shared levels below them that are asked rather than indexed (see shared.SharedLevel)."""

from kvstore.store.levels.base import Level
from kvstore.store.levels.disk_level import DiskLevel
from kvstore.store.levels.host_level import HostLevel
from kvstore.store.levels.shared import SharedLevel

__all__ = ["DiskLevel", "HostLevel", "Level", "SharedLevel"]
