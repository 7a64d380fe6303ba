"""Errors raised by the tier slot stores.

Tiers import nothing from ``kvstore``; ``kvstore.errors`` re-exports these so callers catch
one hierarchy.
"""

from __future__ import annotations


class TierError(Exception):
    """Base class for failures inside a tier (I/O, corrupt slots, space)."""


class TierFullError(TierError):
    """The tier has fewer free slots than asked for, or its medium ran out of space (ENOSPC)."""


class TierIOError(TierError):
    """The medium failed (EIO and friends); the operation did not take effect."""


class CorruptSlotError(TierError):
    """A slot's bytes do not match the checksum recorded for its key."""
