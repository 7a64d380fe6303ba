"""The trace reader of ``kvstore replay`` (kvstore/tools/replay/trace.py): Mooncake-format
JSON lines (``hash_ids``, ``input_length``, an optional ``tenant``) into per-request chains of
block keys.

Input: the whole trace file. The harness writes it to one temporary path and loads it as
``kvstore replay`` does, with the lines' own tenants and again with ``--tenants 3``. What
must hold:

- a file it refuses is a ReplayError naming where (never a JSON, Unicode, Recursion, Type or
  Key error);
- a trace it loads has one request per non-blank line, each request's chain as long as its
  ``hash_ids``, every key's parent the key before it in its chain (None for the first), its
  input lengths and tenants as the lines give them (``--tenants 3``: ``t0`` to ``t2``, or a
  ReplayError when the lines name tenants), every tenant's key owned by that tenant, and the
  same chains on a second load.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvstore.keys import BlockHasher
from kvstore.tools.replay.trace import TRACE_NAMESPACE, ReplayError, Trace, load_trace

# the Mooncake traces (their README.md): the repository's parent holds shared/, as for tests/tools
TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
DERIVED = 3


def _check_trace(trace: Trace, lines: list[dict[str, object]], derived: bool) -> None:
    assert trace.num_requests == len(lines), (trace.num_requests, len(lines))
    assert [len(chain) for chain in trace.chains] == [len(line["hash_ids"]) for line in lines]  # type: ignore[arg-type]
    assert trace.input_lengths == [line.get("input_length") for line in lines]
    for chain in trace.chains:
        for parent, key in zip([None, *chain], chain, strict=False):
            assert trace.parents[key] == parent, "a key's parent is not the key before it"
    named = [line.get("tenant") for line in lines]
    if derived:
        assert len(trace.tenants) == len(lines) and set(trace.tenants) <= {f"t{k}" for k in range(DERIVED)}
    elif any(named):
        assert trace.tenants == [t or "" for t in named], trace.tenants
    else:
        assert trace.tenants == [], trace.tenants
    for chain, tenant in zip(trace.chains, trace.tenants, strict=False):  # (no tenants: [])
        if tenant:
            assert all(trace.owners[key] == tenant for key in chain), "a tenant's key owned by another"


def make() -> Callable[[bytes], None]:
    root = Path(tempfile.mkdtemp(prefix="kvstore-fuzz-trace-"))
    atexit.register(shutil.rmtree, root, True)
    path = root / "trace.jsonl"
    hasher = BlockHasher(TRACE_NAMESPACE)

    def check(data: bytes) -> None:
        path.write_bytes(data)
        try:
            trace = load_trace(path, hasher)
        except ReplayError:
            return
        lines = [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
        _check_trace(trace, lines, derived=False)
        assert load_trace(path, hasher).chains == trace.chains, "a second load made other chains"
        try:
            derived = load_trace(path, hasher, tenants=DERIVED)
        except ReplayError:
            assert any(line.get("tenant") is not None for line in lines), "--tenants refused a trace naming none"
            return
        _check_trace(derived, lines, derived=True)

    return check


def _head(name: str, num_lines: int) -> bytes:
    with open(TRACES / name, "rb") as f:
        return b"".join(f.readline() for _ in range(num_lines))


def seeds() -> dict[str, bytes]:
    """The first lines of the shared Mooncake traces (``TRACES``), a few KB each,
    and the same lines naming tenants (with a blank line between)."""
    conversation, synthetic = _head("conversation_trace.jsonl", 20), _head("synthetic_trace.jsonl", 4)
    named = []
    for i, line in enumerate(conversation.splitlines()[:8]):
        obj = json.loads(line)
        named.append(json.dumps({**obj, "tenant": ["acme", "globex", "flood"][i % 3]}).encode())
    return {"conversation-first-20-lines": conversation, "synthetic-first-4-lines": synthetic,
            "conversation-8-lines-naming-tenants": b"\n".join(named[:4]) + b"\n\n" + b"\n".join(named[4:]) + b"\n"}
