"""The levels of the cascade: one adapter per medium over its slot store (see base.Level)."""

from kvstore.levels.base import Level
from kvstore.levels.disk import DiskLevel
from kvstore.levels.host import HostLevel

__all__ = ["DiskLevel", "HostLevel", "Level"]
