"""Mutation testing of core/: change one operator or constant, run the core's tests, count who notices.

A sample of mutation sites (comparisons flipped, + and - swapped, and/or swapped, True/False
swapped, small integers moved by one) across ``core/``, drawn with a fixed seed. Each mutant is
written into a copy of the source tree, the core's tests run against it, and a failing run kills
it. Prints killed / total and the survivors, with file and line.

    python tools/mutants.py [--sample 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_model_check.py", "tests/test_model_check_checkpoints.py", "tests/test_policies.py",
         "tests/test_prefix_index.py", "tests/test_tiers.py", "tests/test_errors.py", "tests/test_lifecycle.py",
         "tests/test_lab.py::test_unbounded_replays_reproduce_the_published_figures"]
SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.Add: ast.Sub, ast.Sub: ast.Add, ast.And: ast.Or, ast.Or: ast.And}


def sites(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    found = []
    for index, node in enumerate(ast.walk(tree)):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in SWAPS:
            found.append((index, "compare"))
        elif isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in SWAPS:
            found.append((index, "operator"))
        elif isinstance(node, ast.Constant) and (node.value is True or node.value is False):
            found.append((index, "boolean"))
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value in (0, 1, 2):
            found.append((index, "integer"))
    return found


def mutate(path: Path, index: int) -> tuple[str, int]:
    tree = ast.parse(path.read_text())
    for i, node in enumerate(ast.walk(tree)):
        if i != index:
            continue
        if isinstance(node, ast.Compare):
            node.ops[0] = SWAPS[type(node.ops[0])]()
        elif isinstance(node, (ast.BinOp, ast.BoolOp)):
            node.op = SWAPS[type(node.op)]()
        elif node.value is True or node.value is False:
            node.value = not node.value
        else:
            node.value = node.value + 1
        return ast.unparse(tree), getattr(node, "lineno", 0)
    raise IndexError(index)


def package(tree: Path) -> Path:
    """A kvstate package made of links into ``tree``, to put first on PYTHONPATH."""
    top = tree / "_pkg" / "kvstate"
    top.mkdir(parents=True)
    shutil.copy(tree / "kvstate" / "__init__.py", top / "__init__.py")
    shutil.rmtree(tree / "kvstate")  # else the copy's own kvstate/ folder would shadow the package
    for name in ("core", "effects", "interpreters", "models"):
        os.symlink(tree / name, top / name)
    return tree / "_pkg"


def check_imports_the_copy(tree: Path, env: dict) -> None:
    done = subprocess.run([sys.executable, "-c", "import kvstate.core.transitions as t; print(t.__file__)"],
                          cwd=tree, env=env, capture_output=True, text=True)
    if not done.stdout.strip().startswith(str(tree)):
        raise SystemExit(f"the tests would not import the mutated copy: {done.stdout}{done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    files = sorted((ROOT / "core").rglob("*.py"))
    everything = [(f, i, kind) for f in files for i, kind in sites(f)]
    chosen = random.Random(args.seed).sample(everything, min(args.sample, len(everything)))
    killed, survivors = 0, []
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "tree"
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", ".venv", ".ci-venv", "*.pyc", ".whl",
                                                                  ".gpu-*", "__pycache__"))
        pythonpath = package(tree)
        check_imports_the_copy(tree, {**os.environ, "PYTHONPATH": str(pythonpath)})
        for number, (path, index, kind) in enumerate(chosen, 1):
            target = tree / path.relative_to(ROOT)
            original = target.read_text()
            source, line = mutate(path, index)
            target.write_text(source)
            env = {**os.environ, "PYTHONPATH": str(pythonpath), "KVSTATE_CHECK_PROFILE": "ci"}
            try:
                done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS],
                                      cwd=tree, env=env, capture_output=True, text=True, timeout=300)
                dead = done.returncode != 0
            except subprocess.TimeoutExpired:
                dead = True
            target.write_text(original)
            where = f"{path.relative_to(ROOT)}:{line} ({kind})"
            killed += dead
            if not dead:
                survivors.append(where)
            print(f"[{number}/{len(chosen)}] {'killed ' if dead else 'SURVIVED'} {where}", flush=True)
    print(f"\nkilled {killed} of {len(chosen)} mutants ({killed / len(chosen):.0%}) out of {len(everything)} sites")
    for where in survivors:
        print(f"  survivor: {where}")


if __name__ == "__main__":
    main()
