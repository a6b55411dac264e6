"""core/ is pure: no I/O, clock, randomness, threads or mlx, and it imports without mlx."""

import ast
import pathlib
import subprocess
import sys

CORE = pathlib.Path(__file__).resolve().parent.parent / "core"
FORBIDDEN = {"mlx", "os", "io", "time", "random", "threading", "pathlib", "socket", "subprocess", "datetime",
             "shutil", "tempfile", "asyncio", "secrets", "numpy", "safetensors", "mlx_lm", "uuid", "open"}


def imported_modules(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0], node.lineno
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("open", "__import__"):
            yield node.func.id, node.lineno


def test_core_imports_nothing_impure():
    files = sorted(CORE.rglob("*.py"))
    assert files, "core/ has no modules"
    offences = [f"{path.relative_to(CORE.parent)}:{line} imports {name}"
                for path in files for name, line in imported_modules(path) if name in FORBIDDEN]
    assert offences == []


def test_core_imports_without_mlx():
    script = ("import sys\n"
              "class Block:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name.split('.')[0] in ('mlx', 'mlx_lm'):\n"
              "            raise ImportError('mlx is blocked in this test')\n"
              "sys.meta_path.insert(0, Block())\n"
              "import kvstate.core, kvstate.core.transitions, kvstate.effects, kvstate.models\n"
              "assert not any(m.split('.')[0] in ('mlx', 'mlx_lm') for m in sys.modules), sorted(sys.modules)\n"
              "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
