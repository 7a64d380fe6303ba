"""Names that changed keep working under their old spelling, with a DeprecationWarning naming
the new one (the README's "What changed" lists them; the flags and keys that changed are
tested beside their commands: tests/test_config.py, tests/integrations/test_vllm_parts.py,
tests/engine/test_errors.py)."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(("module", "old", "new"), [
    ("kvstore.services.engine_server.config", "ServeConfig", "EngineServerConfig"),
    ("kvstore.services.router.policy.config", "RouterConfig", "RoutingPolicyConfig"),
    ("kvstore.services.router.policy", "RouterConfig", "RoutingPolicyConfig"),
])
def test_an_old_class_name_is_the_new_class_and_warns(module: str, old: str, new: str) -> None:
    found = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{old} is named {new} now"):
        alias = getattr(found, old)
    assert alias is getattr(found, new)
    with pytest.raises(AttributeError):
        getattr(found, old + "s")
