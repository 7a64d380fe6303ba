"""The store daemon: ``kvstore serve``, the server side of its block protocol, its REST app and
dashboard. The client and the wire format are in ``kvstore.client`` (the library): engines
import them without the daemon.
"""

from __future__ import annotations
