"""The embedded store: one index, one lock.

``TieredStore`` (tiered.py) is the ``BlockStore`` in this process. Under it, the ``Cascade``
(cascade.py) holds the levels (levels/: a tier of one medium, its eviction policy, counters,
admission and codec), the block index (index.py) and the store lock; every module here that
changes the index does so under that lock, through the cascade. docs/architecture.md maps the
modules.
"""

from __future__ import annotations

from kvstore.store.tiered import TieredStore

__all__ = ["TieredStore"]
