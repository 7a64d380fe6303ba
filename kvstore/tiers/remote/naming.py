"""Redis key names of blocks: a format-versioned prefix, a hash tag, the block key.

    <prefix>:v2:g<G>:{<tag hex>}            when the block is its group's head (tag == key)
    <prefix>:v2:g<G>:{<tag hex>}:<key hex>  otherwise

Redis Cluster places a key by the CRC16 of the text between the first ``{`` and the next
``}``, so every block with the same tag lands in one hash slot. The tag of the block at depth
``d`` of a chain is the key of the block at depth ``d - d % G`` (its group head): a run of G
consecutive blocks shares a slot, longer prefixes spread over the cluster. With G = 1 (the
default, see docs/remote.md) each block is its own head.

G is part of the name, so a reader and a writer configured with different G can never read
each other's names as something else: they simply do not meet. A block whose group head is
unknown to the caller has no name (``group_tags`` refuses), rather than a guessed one.
"""

from __future__ import annotations

from collections.abc import Sequence

FORMAT_VERSION = 2  # v2: values carry their owner (codec.py); v1 names are never read
DEFAULT_PREFIX = "kvstore"
MAX_RUN_LENGTH = 1024


def check_prefix(prefix: str) -> str:
    """The prefix if usable in a name (printable ASCII, no braces, spaces or colons at ends)."""
    if not prefix or not prefix.isascii() or not prefix.isprintable() or any(c in prefix for c in "{} "):
        raise ValueError(f"remote key prefix must be printable ASCII without braces or spaces, got {prefix!r}")
    return prefix


def name_pattern(prefix: str = DEFAULT_PREFIX) -> bytes:
    """A SCAN ``MATCH`` glob of every block name of ``prefix`` in this format (any G, any tag):
    the prefix's glob characters escaped."""
    escaped = "".join("\\" + c if c in "*?[]\\" else c for c in prefix)
    return f"{escaped}:v{FORMAT_VERSION}:g*".encode()


def block_name(key: bytes, tag: bytes, prefix: str = DEFAULT_PREFIX, run_length: int = 1) -> bytes:
    """The Redis key of block ``key`` whose group head is ``tag``."""
    head = f"{prefix}:v{FORMAT_VERSION}:g{run_length}:{{{tag.hex()}}}".encode()
    return head if tag == key else head + b":" + key.hex().encode()


def group_tags(
    keys: Sequence[bytes], run_length: int, first_depth: int = 0, head: bytes | None = None
) -> list[bytes]:
    """The tag (group head key) of each of ``keys``, a consecutive run of one chain.

    Args:
        keys: chain order; ``keys[0]`` sits at depth ``first_depth`` (0 = the chain's first block).
        run_length: G.
        first_depth: depth of ``keys[0]``.
        head: key of the group head of ``keys[0]`` when that head is not in ``keys``
            (``first_depth % G != 0``).

    Raises:
        ValueError: the first group's head is needed and not given.
    """
    if run_length == 1:
        return list(keys)
    offset = first_depth % run_length
    if offset and head is None and keys:
        raise ValueError(
            f"block at depth {first_depth} needs the key of its group head (depth {first_depth - offset}) "
            f"to be named with G={run_length}"
        )
    tags: list[bytes] = []
    current = head if offset else None
    for i, key in enumerate(keys):
        if (first_depth + i) % run_length == 0:
            current = key
        assert current is not None
        tags.append(current)
    return tags
