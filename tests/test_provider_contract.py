"""The provider contract is declared in one place (issue 25 item 1): every operation the scheduler, the API and
the app ask of a provider is declared on `providers/base.Provider` with a default, every provider subclasses it
with the same signatures, and nothing asks a provider what it has (no getattr/hasattr/callable/inspect)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from aibro_backend.providers.aws import AwsProvider
from aibro_backend.providers.base import Provider
from aibro_backend.providers.local import LocalProvider
from aibro_backend.providers.ray import RayProvider
from aibro_backend.providers.ssh import SshProvider

pytestmark = pytest.mark.fast
BACKEND = Path(__file__).resolve().parents[1] / "backend" / "aibro_backend"
SERVER = sorted((BACKEND / "server").glob("*.py"))
CALLERS = [BACKEND / "scheduling" / "scheduler.py", *SERVER, BACKEND / "api" / "user.py"]
PROVIDERS = [LocalProvider, AwsProvider, RayProvider, SshProvider]


def _is_provider(node: ast.AST) -> bool:
    """An expression that is a provider: `provider`, `p` in a loop over providers, `self.providers[...]`, ..."""
    text = ast.unparse(node)
    return (
        text in ("provider", "p")
        or text.startswith(("self.providers[", "self.providers.get("))
        or ("providers[" in text or "providers.get(" in text)
    )


def test_nothing_asks_a_provider_what_it_has() -> None:
    for path in CALLERS:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("getattr", "hasattr", "callable") and node.args and _is_provider(node.args[0]):
                    pytest.fail(f"{path.name}:{node.lineno}: {ast.unparse(node)} asks a provider what it has")
            if isinstance(node, ast.Attribute) and ast.unparse(node).startswith("inspect."):
                pytest.fail(f"{path.name}:{node.lineno}: inspects a provider")


def test_every_operation_used_is_declared_with_a_docstring() -> None:
    used: set[str] = set()
    for path in CALLERS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _is_provider(node.value):
                used.add(node.attr)
    used -= {"values", "items", "get"}  # the dict of providers itself
    assert {"launch", "alive", "terminate", "reap", "adopt", "reconcile", "poll", "can_stop"} <= used, used
    # asked of Ray's and SSH's own provider where loaders.py holds it as its own type, at load
    local_only = {"wait_ready", "check"}
    undeclared = sorted(name for name in used - local_only if not hasattr(Provider, name))
    assert not undeclared, f"used on providers but not declared in providers/base.py: {undeclared}"
    for name in used - local_only:
        member = getattr(Provider, name)
        if callable(member):
            assert inspect.getdoc(member), f"Provider.{name} says what it means"


def test_what_only_the_local_provider_has_is_read_from_its_typed_field() -> None:
    """`Backend.local` is the LocalProvider; the provider table (`dict[str, Provider]`) is never indexed by name for
    it, so nothing reads an attribute the contract does not declare."""
    for path in CALLERS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and ast.unparse(node).endswith('providers["local"]'):
                pytest.fail(f"{path.name}:{node.lineno}: {ast.unparse(node)} (use backend.local)")


@pytest.mark.parametrize("cls", PROVIDERS, ids=lambda c: c.__name__)
def test_each_provider_subclasses_the_contract_with_its_signatures(cls: type) -> None:
    assert issubclass(cls, Provider)
    assert not getattr(cls, "__abstractmethods__", None), f"{cls.__name__} leaves {cls.__abstractmethods__} out"
    for name, member in inspect.getmembers(Provider, inspect.isfunction):
        own = getattr(cls, name)
        if own is member:
            continue
        want = list(inspect.signature(member).parameters)
        have = list(inspect.signature(own).parameters)
        assert have[: len(want)] == want, f"{cls.__name__}.{name}{have} differs from Provider.{name}{want}"
