"""Mutation testing of core/ and the serving wing: change one operator or constant, run the tests, count who notices.

Mutation sites are comparisons flipped, + and - swapped, and/or swapped, True/False swapped, and
small integers moved by one, across ``core/`` (``--wing core``, the default) or the serving wing's
adapter, batch admission and tenant code (``--wing serving``, against the tests that hold them,
real servers included). Each mutant is written into a private copy of the
source tree, the core's tests run against it (fastest first, stopping at the first failure, with a
fixed hypothesis seed), and a failing run kills it. Workers run mutants in parallel, one tree each.

Survivors that cannot change behaviour are listed, with the reason, in ``tools/equivalent_mutants.txt``;
the tool reports them apart and names any survivor that has no explanation.

    python tools/mutants.py --all [--jobs 16] [--json mutants.json]
    python tools/mutants.py --sample 30 --seed 0
    python tools/mutants.py --rerun mutants.json      # only the survivors of an earlier run
    python tools/mutants.py --only core/state.py:224  # the mutants of one line (or one site)
    python tools/mutants.py --all --shard 1/2         # every other site, to split a run across machines
    python tools/mutants.py --rerun mutants.json --tests tests/test_core_tiers.py  # triage on one file
    python tools/mutants.py --sample 40 --seed 7 --hypothesis-seed 1  # kills that depend on the search's seed
    python tools/mutants.py --wing serving --all --jobs 2 --json serving.json  # the serving wing
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The seed hypothesis searches from in every run (``--hypothesis-seed``): a kill that only one seed's
#: search finds is a kill that depends on luck, and wants an ``@example``.
HYPOTHESIS_SEED = [0]
EXPLAINED = ROOT / "tools" / "equivalent_mutants.txt"
CORE_TESTS = ["tests/test_core_requests.py", "tests/test_core_tiers.py", "tests/test_core_objects.py",
         "tests/test_core_checkpoints.py", "tests/test_core_lifecycle.py", "tests/test_core_reuse.py",
         "tests/test_blocks.py", "tests/test_edges.py", "tests/test_policies.py", "tests/test_prefix_index.py",
         "tests/test_tokens.py", "tests/test_errors.py", "tests/test_block_prefetch.py",
         "tests/test_snapshot_admission.py", "tests/test_entry_lifecycle.py", "tests/test_sharing.py", "tests/test_padded_batch_admission.py",
         "tests/test_objects_and_pressure.py", "tests/test_semantic_mistakes.py", "tests/test_contract.py",
         "tests/test_core_and_lab_policies.py", "tests/test_against_libcachesim.py",
         "tests/test_tiers.py", "tests/test_lab.py::test_unbounded_replays_reproduce_the_published_figures",
         "tests/test_model_check_checkpoints.py", "tests/test_model_check.py", "tests/test_pace.py",
         "tests/test_disk_wear.py", "tests/test_idle.py", "tests/test_remote_tier.py", "tests/test_kv_events.py",
         "tests/test_pins.py"]
#: The serving wing's code where tenants, names and budgets are decided, and the tests that hold it:
#: the quick ones first, then those that run real servers through the ``openai`` client.
SERVING_FILES = ["interpreters/serving/prompt_cache.py", "interpreters/serving/batch_admission.py",
                 "interpreters/serving/tenants.py", "interpreters/serving/deployment_keys.py",
                 "interpreters/serving/model_names.py", "interpreters/serving/pins.py"]
SERVING_TESTS = ["tests/test_tenants.py", "tests/test_prompt_cache.py", "tests/test_serving_admission.py",
                 "tests/test_pins.py", "tests/test_held_segments.py", "tests/test_resumable_rows.py",
                 "tests/test_serve_paths.py", "tests/test_concurrency.py", "tests/test_serve.py",
                 "tests/test_serve_pins.py", "tests/test_serve_resume.py", "tests/test_serve_snapshots.py"]
#: Each wing: the files whose sites are mutated, and the tests a mutant runs against.
WINGS = {"core": (None, CORE_TESTS), "serving": (SERVING_FILES, SERVING_TESTS)}
#: The tests the chosen wing's mutants run against (``--tests`` replaces them).
TESTS = list(CORE_TESTS)
SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.Add: ast.Sub, ast.Sub: ast.Add, ast.And: ast.Or, ast.Or: ast.And}
SYMBOLS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Add: "+",
           ast.Sub: "-", ast.And: "and", ast.Or: "or"}


def sites(path: Path) -> list[dict]:
    """Every mutation site of one file: its node's walk index, and a name that says what changes."""
    tree = ast.parse(path.read_text())
    found = []
    for index, node in enumerate(ast.walk(tree)):
        if isinstance(node, ast.Compare) and type(node.ops[0]) in SWAPS:
            old = type(node.ops[0])
        elif isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in SWAPS:
            old = type(node.op)
        elif isinstance(node, ast.Constant) and (node.value is True or node.value is False):
            found.append(_site(path, index, node, f"{node.value} -> {not node.value}"))
            continue
        elif isinstance(node, ast.Constant) and type(node.value) is int and node.value in (0, 1, 2):
            found.append(_site(path, index, node, f"{node.value} -> {node.value + 1}"))
            continue
        else:
            continue
        found.append(_site(path, index, node, f"{SYMBOLS[old]} -> {SYMBOLS[SWAPS[old]]}"))
    return found


def _site(path: Path, index: int, node: ast.AST, change: str) -> dict:
    where = f"{path.relative_to(ROOT)}:{node.lineno}:{node.col_offset}"
    return {"file": str(path.relative_to(ROOT)), "index": index, "where": where, "change": change,
            "name": f"{where} {change}"}


def mutate(path: Path, index: int) -> str:
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
        return ast.unparse(tree)
    raise IndexError(index)


def explanations() -> dict[str, str]:
    """``name  # reason`` lines of the equivalent-mutant list, by site name."""
    if not EXPLAINED.exists():
        return {}
    found = {}
    for line in EXPLAINED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition("#")
            found[name.strip()] = reason.strip()
    return found


def package(tree: Path) -> Path:
    """A kvstate package made of links into ``tree``, to put first on PYTHONPATH."""
    top = tree / "_pkg" / "kvstate"
    top.mkdir(parents=True)
    shutil.copy(tree / "kvstate" / "__init__.py", top / "__init__.py")
    shutil.rmtree(tree / "kvstate")  # else the copy's own kvstate/ folder would shadow the package
    for name in ("core", "effects", "interpreters", "models"):
        os.symlink(tree / name, top / name)
    return tree / "_pkg"


def copy_tree(into: Path) -> tuple[Path, dict]:
    tree = into / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", ".venv", ".ci-venv", "*.pyc", ".whl", ".gpu-*",
                                                              "__pycache__", ".hypothesis", "kvstate-lab.*"))
    path = os.pathsep.join(filter(None, [str(package(tree)), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "KVSTATE_CHECK_PROFILE": "ci",
           "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", "import kvstate.core.transitions as t; print(t.__file__)"],
                          cwd=tree, env=env, capture_output=True, text=True)
    if not done.stdout.strip().startswith(str(tree)):
        raise SystemExit(f"the tests would not import the mutated copy: {done.stdout}{done.stderr}")
    return tree, env


def tests_pass_unmutated(tree: Path, env: dict) -> None:
    """A mutant counts as killed when the tests fail, so they must pass on the source as it is."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--hypothesis-seed={HYPOTHESIS_SEED[0]}", *TESTS], cwd=tree, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"the tests fail without any mutation; fix them first:\n{done.stdout[-3000:]}")


def run_one(site: dict, tree: Path, env: dict, timeout: float) -> tuple[bool, float, str]:
    """Kill or not: the tests against ``tree`` with this one mutation applied; restores the file after."""
    target = tree / site["file"]
    original = target.read_text()
    target.write_text(mutate(ROOT / site["file"], site["index"]))
    shutil.rmtree(tree / ".hypothesis", ignore_errors=True)  # no example found for another mutant is replayed
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               f"--hypothesis-seed={HYPOTHESIS_SEED[0]}", *TESTS], cwd=tree, env=env,
                              capture_output=True, text=True,
                              timeout=timeout)
        dead, how = done.returncode != 0, _first_failure(done.stdout)
    except subprocess.TimeoutExpired:
        dead, how = True, f"timed out after {timeout:.0f} s"
    finally:
        target.write_text(original)
    return dead, time.perf_counter() - start, how


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("FAILED") or line.startswith("ERROR"):
            return line
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    chosen_by = parser.add_mutually_exclusive_group()
    chosen_by.add_argument("--all", action="store_true", help="every site of the wing")
    chosen_by.add_argument("--sample", type=int, default=30, help="this many sites, drawn with --seed")
    chosen_by.add_argument("--only", nargs="+", help="the sites whose names start with these, e.g. core/state.py:224")
    chosen_by.add_argument("--rerun", type=Path, nargs="+", help="the survivors recorded in these JSONs of earlier runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wing", choices=sorted(WINGS), default="core",
                        help="core/ against the core's tests, or the serving wing against the serving tests")
    parser.add_argument("--shard", default="1/1", help="K/N: run every Nth chosen mutant from the Kth, to split a run")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=300, help="seconds a mutant may run; a hang kills it")
    parser.add_argument("--json", type=Path, help="write every mutant's outcome here")
    parser.add_argument("--tests", nargs="+", help="run these tests instead of the core's (a quick triage: "
                                                    "a survivor of a subset may still die to the rest)")
    parser.add_argument("--hypothesis-seed", type=int, default=0,
                        help="the seed of hypothesis's search (another seed shows which kills depend on it)")
    args = parser.parse_args()
    HYPOTHESIS_SEED[0] = args.hypothesis_seed
    files, TESTS[:] = WINGS[args.wing]
    if args.tests:
        TESTS[:] = args.tests

    paths = sorted((ROOT / "core").rglob("*.py")) if files is None else [ROOT / f for f in files]
    everything = [site for f in paths for site in sites(f)]
    if args.all:
        chosen = everything
    elif args.only:
        chosen = [site for site in everything if site["name"].startswith(tuple(args.only))]
    elif args.rerun:
        wanted = {m["name"] for run in args.rerun for m in json.loads(run.read_text())["mutants"] if not m["killed"]}
        chosen = [site for site in everything if site["name"] in wanted]
    else:
        chosen = random.Random(args.seed).sample(everything, min(args.sample, len(everything)))
    k, n = (int(part) for part in args.shard.split("/"))
    chosen = chosen[k - 1::n]
    explained = explanations()

    with tempfile.TemporaryDirectory() as scratch:
        trees = [copy_tree(Path(scratch) / f"w{n}") for n in range(max(1, min(args.jobs, len(chosen))))]
        tests_pass_unmutated(*trees[0])
        free = list(trees)
        lock = threading.Lock()
        outcomes: list[dict] = []

        def work(site: dict) -> dict:
            tree, env = free.pop()
            try:
                dead, seconds, how = run_one(site, tree, env, args.timeout)
            finally:
                free.append((tree, env))
            outcome = {**site, "killed": dead, "seconds": round(seconds, 1), "by": how}
            label = "killed  " if dead else ("explained" if site["name"] in explained else "SURVIVED")
            with lock:
                outcomes.append(outcome)
                if args.json:  # after every mutant, so a run cut short keeps what it found
                    args.json.write_text(json.dumps({"sites": len(everything), "mutants": outcomes}, indent=1))
            print(f"[{len(outcomes)}/{len(chosen)}] {label} {site['name']}  ({seconds:.0f} s)", flush=True)
            return outcome

        with ThreadPoolExecutor(len(trees)) as pool:
            list(pool.map(work, chosen))

    outcomes.sort(key=lambda m: (m["file"], m["index"]))
    killed = sum(m["killed"] for m in outcomes)
    survivors = [m for m in outcomes if not m["killed"]]
    unexplained = [m for m in survivors if m["name"] not in explained]
    equivalent = len(survivors) - len(unexplained)
    print(f"\nkilled {killed} of {len(outcomes)} mutants ({killed / max(1, len(outcomes)):.1%}); "
          f"{equivalent} survivors explained as equivalent, {len(unexplained)} unexplained; "
          f"{killed / max(1, len(outcomes) - equivalent):.1%} of the mutants that can change a decision; "
          f"{len(everything)} sites in the {args.wing} wing")
    for m in unexplained:
        print(f"  unexplained survivor: {m['name']}")
    names = {site["name"] for site in everything}
    for name in sorted(n for n in set(explained) - names if n.startswith(tuple(str(p.relative_to(ROOT)) for p in paths))):
        print(f"  stale explanation (no such site now): {name}")
    if args.json:
        args.json.write_text(json.dumps({"sites": len(everything), "killed": killed, "mutants": outcomes}, indent=1))


if __name__ == "__main__":
    main()
