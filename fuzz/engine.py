"""One libFuzzer process over one harness (run by ``python -m fuzz run``, not by hand).

    python -m fuzz.engine NAME RSS_LIMIT_MB [libFuzzer args and corpus directories...]

The harness, and through it kvstore, is imported under ``atheris.instrument_imports`` so that
kvstore's own branches are the coverage libFuzzer steers by (torch, msgpack and the other
libraries are not instrumented: their speed is kept, their branches are not ours to find).

Memory is watched here, not by libFuzzer: its ``-rss_limit_mb`` reads the process's peak RSS
(``getrusage``), which Linux carries over from the parent across fork and exec, so a run
started from a large process (a test suite hours in) would be "out of memory" at its first
input. A thread reads the current VmRSS instead and ends the run past ``RSS_LIMIT_MB``.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

OOM_EXIT = 71  # libFuzzer's own exit code for out-of-memory


def rss_mb() -> int:
    """This process's resident memory now (not its peak), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def watch_memory(limit_mb: int, every_s: float = 0.25) -> None:
    """End the process (exit ``OOM_EXIT``) once its RSS passes ``limit_mb`` (0: never)."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(every_s):
            now = rss_mb()
            if now > limit_mb:
                print(f"==fuzz== ERROR: out-of-memory: RSS {now} MB past the limit of {limit_mb} MB", flush=True)
                os._exit(OOM_EXIT)

    if limit_mb > 0:
        threading.Thread(target=watch, name="fuzz-rss", daemon=True).start()


def main() -> None:
    import atheris

    name, limit_mb, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    with atheris.instrument_imports(include=["kvstore", "fuzz"]):
        from fuzz.targets import load

        target = load(name)
    check = target.make()
    watch_memory(limit_mb)
    atheris.Setup([sys.argv[0], *args, "-rss_limit_mb=0"], check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
