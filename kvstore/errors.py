"""The exception hierarchy of kvstore. Every message carries the numbers that explain it."""

from __future__ import annotations

from kvstore.tiers.errors import CorruptSlotError, TierError, TierFullError, TierIOError


class KVStoreError(Exception):
    """Base class for errors raised by kvstore's own logic."""


class ConfigError(KVStoreError, ValueError):
    """A configuration value is invalid (the message names the field and the value)."""


class LayoutMismatchError(KVStoreError, ValueError):
    """A tensor does not match the store's KV layout (shape, dtype or count)."""


class CapacityError(KVStoreError):
    """A tier cannot make room: e.g. ``need 12 blocks, 3 free of 4096 (4093 pinned)``."""


class DaemonUnreachableError(KVStoreError, OSError):
    """No kvstore daemon answers at the address given (the message names the socket or
    host:port tried). What is raised is also the ``OSError`` the connection met:
    ``FileNotFoundError``, ``ConnectionRefusedError``, ..."""


class CodecError(KVStoreError, ValueError):
    """A block cannot be encoded: NaN/Inf values, or a scale out of the scale dtype's range."""


class CodecFormatError(CodecError):
    """An encoded block this reader refuses: foreign magic, unknown codec id or version,
    another dtype or geometry, or a wrong length. The message names the block and the field."""


__all__ = [
    "CapacityError",
    "CodecError",
    "CodecFormatError",
    "ConfigError",
    "CorruptSlotError",
    "DaemonUnreachableError",
    "KVStoreError",
    "LayoutMismatchError",
    "TierError",
    "TierFullError",
    "TierIOError",
]
