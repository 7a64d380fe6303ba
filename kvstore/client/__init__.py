"""The daemon's client: a store in another process (``kvstore.connect``), and the block protocol's wire format.

The client is a store like ``TieredStore`` (the ``kvstore.api.BlockStore`` contract); the daemon
(``kvstore.services.daemon``) serves the same wire format from the other side.
"""
