"""A harness with a planted bug, so the test suite can show that ``python -m fuzz run`` finds
a crash and keeps its input (tests/fuzz/test_fuzz.py). Not one of the ``TARGETS``.

The bug needs a four-byte magic the fuzzer must build one byte at a time, as a decoder's
branch past a header check does; the seed holds the first byte of it.
"""

from __future__ import annotations

from collections.abc import Callable


def make() -> Callable[[bytes], None]:
    def check(data: bytes) -> None:
        if len(data) >= 4 and data[0] == 0x4B and data[1] == 0x56 and data[2] == 0x43 and data[3] == 0x42:
            raise IndexError("planted: a header check passed and the reader ran off its buffer")

    return check


def seeds() -> dict[str, bytes]:
    return {"start": b"K..."}
