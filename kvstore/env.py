"""Every environment variable kvstore reads, in one place, but one: ``KVSTORE_KERNELS``, which the
kernels read themselves (``kvstore.kernels.kernel_backend``), since they import nothing of the store."""

from __future__ import annotations

import os


def token() -> str | None:
    """``KVSTORE_TOKEN``: the daemon's access token, when not given on the command line."""
    return os.environ.get("KVSTORE_TOKEN") or None


def router_token() -> str | None:
    """``KVSTORE_ROUTER_TOKEN``: the secret a router and its replicas share (``--router-token``),
    kept off the command line."""
    return os.environ.get("KVSTORE_ROUTER_TOKEN") or None


def shm_disabled() -> bool:
    """``KVSTORE_NO_SHM=1``: clients never use the daemon's shared-memory path."""
    return os.environ.get("KVSTORE_NO_SHM", "").strip() not in ("", "0")


def model_cache() -> str | None:
    """``KVSTORE_MODEL_CACHE``: where GGUF checkpoints' converted copies are kept (default ./.kvstore/models)."""
    return os.environ.get("KVSTORE_MODEL_CACHE") or None
