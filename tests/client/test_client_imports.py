"""The daemon's client stands alone: importing it, or reaching it as ``kvstore.connect``, loads
nothing of the embedded store (``kvstore.store``) nor of the policies (``kvstore.policy``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# what a fresh interpreter runs, and a module that shows the statement loaded the client
STATEMENTS = [
    ("import kvstore.client", "kvstore.client"),
    ("import kvstore.client.client", "kvstore.client.client"),
    ("import kvstore; kvstore.connect", "kvstore.client.client"),
    ("from kvstore.client.client import StoreClient, connect, parse_address", "kvstore.client.address"),
]


def loaded_after(statement: str) -> list[str]:
    """The kvstore modules a fresh interpreter holds after ``statement``."""
    code = f"import sys\n{statement}\nprint('\\n'.join(m for m in sys.modules if m.startswith('kvstore')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


@pytest.mark.parametrize(("statement", "client_module"), STATEMENTS, ids=[s for s, _ in STATEMENTS])
def test_the_client_loads_without_the_store_or_the_policies(statement: str, client_module: str) -> None:
    loaded = loaded_after(statement)
    assert client_module in loaded  # the statement ran
    assert [m for m in loaded if m.startswith(("kvstore.store", "kvstore.policy"))] == []
