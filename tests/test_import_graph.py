"""The shape of the package: the root is the contract, no import cycle, and the parts that must
stand alone load alone (the layers themselves are import-linter's contracts, `make lint`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import networkx as nx

import kvstore

ROOT = Path(kvstore.__file__).parent
# What a user of any store needs, and nothing else (docs/architecture.md, "The contract").
CONTRACT = {"__init__", "api", "results", "errors", "layout", "keys", "env", "config", "protocol", "cli"}
PACKAGES = {"store", "policy", "client", "codecs", "tiers", "kernels", "events", "engine", "services",
            "integrations", "tools"}


def test_the_roots_file_list_is_the_contract() -> None:
    modules = {p.stem for p in ROOT.glob("*.py")}
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert modules == CONTRACT, f"a new module at the root: {sorted(modules - CONTRACT)} (or one gone)"
    assert packages == PACKAGES, f"packages changed: {sorted(packages ^ PACKAGES)}"


def cycles(exclude_type_checking: bool) -> list[list[str]]:
    graph = grimp.build_graph("kvstore", cache_dir=None, exclude_type_checking_imports=exclude_type_checking)
    edges = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            edges.add_edge(module, imported)
    return sorted(sorted(c) for c in nx.strongly_connected_components(edges) if len(c) > 1)


def test_no_module_of_kvstore_imports_itself_back_at_run_time() -> None:
    assert cycles(exclude_type_checking=True) == []


def loaded_after(statement: str) -> list[str]:
    """The kvstore modules and torch a fresh interpreter holds after ``statement``."""
    code = (f"import sys\n{statement}\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('kvstore') or m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.split()


def test_the_policies_load_without_torch_or_the_store() -> None:
    modules = " ".join(f"kvstore.policy.{p.stem}" for p in (ROOT / "policy").glob("*.py") if p.stem != "__init__")
    loaded = loaded_after(f"import {modules.replace(' ', ', ')}")
    assert "kvstore.policy.eviction" in loaded  # the statement ran
    assert not [m for m in loaded if m.split(".")[0] == "torch"], "kvstore.policy loaded torch"
    assert not [m for m in loaded if m.startswith("kvstore.store")]


def test_the_contract_loads_without_the_store_or_the_client() -> None:
    loaded = loaded_after("import kvstore.api, kvstore.results, kvstore.config, kvstore.protocol")
    assert "kvstore.api" in loaded
    assert not [m for m in loaded if m.startswith(("kvstore.store", "kvstore.client"))]
