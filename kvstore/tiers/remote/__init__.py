"""The remote tier: KV blocks in a Redis Cluster (or one Redis server), shared by nodes.

docs/remote.md has the key and value formats byte by byte, the URLs and the failure model.
"""

from __future__ import annotations

from kvstore.tiers.remote.naming import group_tags
from kvstore.tiers.remote.tier import RemoteTier
from kvstore.tiers.remote.url import RemoteURL, parse_url

__all__ = ["RemoteTier", "RemoteURL", "group_tags", "parse_url"]
