"""The services: long-running processes over the library and the engine.

``daemon`` (``kvstore serve``), ``engine_server`` (``kvstore engine``), ``router``
(``kvstore route``), and ``common``, what all of them share (sizes, tokens, loopback, HTTP).
"""
