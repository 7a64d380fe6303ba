"""The levels of the cascade: one adapter per medium over its slot store (see base.Level), and
the shared levels below them that are asked rather than indexed (see shared.SharedLevel)."""

from kvstore.levels.base import Level
from kvstore.levels.disk_level import DiskLevel
from kvstore.levels.host_level import HostLevel
from kvstore.levels.shared import SharedLevel

__all__ = ["DiskLevel", "HostLevel", "Level", "SharedLevel"]
