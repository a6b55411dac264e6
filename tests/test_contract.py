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
from kvstate.interpreters.mlx_interpreter import MlxInterpreter
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


def test_every_event_and_completion_has_a_handler():
    assert subclasses(ev, ev.Event) | subclasses(done, done.Completion) == set(HANDLERS)


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


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_mlx_interpreter_never_imports_the_simulator():
    for name in ("mlx_interpreter.py", "disk_store.py", "mlx_caches.py", "disk_budget.py", "base.py"):
        assert not any("simulator" in module for module in imported_modules(ROOT / "interpreters" / name)), name
