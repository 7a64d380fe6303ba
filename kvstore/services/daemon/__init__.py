"""The store daemon: ``kvstore serve``, its block protocol, client, REST app and dashboard.

``kvstore.connect(url, ...)`` (kvstore.client.client.connect) opens a client.
"""

from __future__ import annotations
