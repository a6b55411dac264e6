"""The contract between the core and the interpreters holds by construction.

Every effect the core can emit has a performer in every interpreter; every port event and every
completion has a handler in the core; both interpreters are what the facade calls; and the MLX
interpreter stands on its own (it never imports the simulator).
"""

from __future__ import annotations

import ast
import inspect
import tempfile
from pathlib import Path

import pytest

from kvstate import KvCacheService, model_spec
from kvstate.core import events as ev
from kvstate.core.transitions import HANDLERS
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from kvstate.interpreters.base import PERFORMERS, Interpreter
from kvstate.interpreters.mlx.interpreter import MlxInterpreter
from kvstate.interpreters.simulator import SimulatorInterpreter
from kvstate.models.reference import build

ROOT = Path(__file__).resolve().parent.parent


def subclasses(module, base):
    return {cls for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, base) and cls is not base and cls.__module__ == module.__name__}


def test_every_effect_has_a_performer_in_every_interpreter():
    effects = subclasses(fx, fx.Effect)
    assert effects == set(PERFORMERS)
    for interpreter in (SimulatorInterpreter, MlxInterpreter):
        missing = [name for name in PERFORMERS.values() if not callable(getattr(interpreter, name, None))]
        assert missing == [], f"{interpreter.__name__} lacks {missing}"


def parameters(function) -> list[tuple[str, object, object]]:
    """A callable's parameters as names, kinds and defaults (annotations are strings, compared apart)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("interpreter", [SimulatorInterpreter, MlxInterpreter], ids=["simulator", "mlx"])
def test_every_performer_takes_its_effect_alone_and_every_protocol_method_has_the_protocols_signature(interpreter):
    for method in set(PERFORMERS.values()):
        assert [name for name, _, _ in parameters(getattr(interpreter, method))] == ["self", "e"], method
    for name, member in inspect.getmembers(Interpreter):
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        own, wanted = parameters(getattr(interpreter, name)), parameters(member)
        assert own[:len(wanted)] == wanted, f"{interpreter.__name__}.{name}"   # the protocol's, in its order
        assert all(default is not inspect.Parameter.empty for _, _, default in own[len(wanted):]), \
            f"{interpreter.__name__}.{name} asks more than the protocol gives"


def test_every_event_and_completion_has_a_handler():
    assert subclasses(ev, ev.Event) | subclasses(done, done.Completion) == set(HANDLERS)
    for event, handler in HANDLERS.items():
        assert len(inspect.signature(handler).parameters) == 2, handler  # (state, event): one handler shape


@pytest.mark.parametrize("kind", ["simulator", "mlx"])
def test_both_interpreters_are_what_the_facade_calls(kind):
    if kind == "simulator":
        service = KvCacheService.simulated(model_spec("llama-3.2-1b"), ram_bytes=1 << 20)
    else:
        model, config = build("llama", seed=1)
        service = KvCacheService.for_mlx(model, config=config, ram_bytes=1 << 20, disk_dir=tempfile.mkdtemp(),
                                         disk_bytes=1 << 20)
    assert isinstance(service.interpreter, Interpreter)
    service.close()


#: Where each package of the project lives (pyproject.toml's package-dir).
PACKAGE_DIRS = {"kvstate": "kvstate", "kvstate.core": "core", "kvstate.effects": "effects",
                "kvstate.interpreters": "interpreters", "kvstate.models": "models"}


def project_modules() -> dict[str, Path]:
    """Every module of the installed project, by its dotted name."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Each project module and the project modules it imports anywhere in its text (a function's own
    imports included: a lazy import is a dependency all the same). A module's parent packages, which
    Python initialises first, are not counted: a package's ``__init__`` gathers its modules, it is not
    one of their dependencies."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from package import module`` depends on the module; ``from module import name`` on the module
                found = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                         for alias in node.names]
            else:
                continue
            edges |= {module for module in found if module in modules and module != name}
        graph[name] = edges
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for module in graph[stack.pop()]:
            if module not in seen:
                seen.add(module)
                stack.append(module)
    return seen


def test_no_module_imports_itself_through_others():
    """No import circles anywhere, transitive and lazy imports included (a package importing its own
    modules in ``__init__`` is not a circle: its modules import the package's parents, never it)."""
    graph = import_graph()
    circles = sorted(name for name in graph if name in reachable(graph, name))
    assert not circles, f"modules that import themselves through others: {circles}"


def test_the_mlx_interpreter_never_imports_the_simulator_nor_the_port():
    graph = import_graph()
    for name in [m for m in graph if m.startswith("kvstate.interpreters.mlx")] + ["kvstate.interpreters.base"]:
        found = reachable(graph, name)
        assert "kvstate.interpreters.simulator" not in found, name
        assert "kvstate.interpreters.service" not in found, name
    assert "kvstate.interpreters.service" not in reachable(graph, "kvstate.interpreters.simulator")
