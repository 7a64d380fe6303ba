"""The daemon's client: a store in another process (``kvstore.connect``).

The client is a store like ``TieredStore`` (the ``kvstore.api.BlockStore`` contract) and imports
nothing of it; it speaks the wire format of ``kvstore.protocol``, which the daemon
(``kvstore.services.daemon``) serves from the other side. ``client.py`` says which module does what.
"""
