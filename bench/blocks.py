"""State in blocks against whole prefixes: disk bytes written, RAM held, reuse, on real models.

Each workload runs through the library's port (``for_mlx``: acquire, prefill what is not reused,
extend the caches over a reply as a generation would, publish, release) on a reference llama with
random weights, on this CPU, with a disk tier and write-behind (every kept state written):

- ``chat``: a 10-turn chat (a 400-token system prompt; 80-token questions, 150-token answers);
- ``agent``: a 50-step agent loop (a 600-token system prompt; each step a 40-token call and a
  200-token tool result appended);
- ``branching``: a 6-turn chat where each turn is answered, regenerated three times and its question
  edited once (every branch published);

a request reuses what is kept, computes the rest and the reply, and publishes the prompt and the
reply (as ``kvstate serve`` keeps the end of each turn); the next turn's prompt holds the reply;

each four ways, side by side in one run: the previous commit's whole-prefix storage (``--baseline``,
exported from git into a temporary folder and run there, as its own process), this commit with
``block_tokens=None`` (whole prefixes), with blocks of ``--block-tokens`` (partial last blocks
kept), and with full blocks only (the tokens past the last full block dropped and recomputed).

    python bench/blocks.py [--baseline HEAD~1] [--models tiny,small] [--workloads chat,agent,branching]
    python bench/blocks.py --baseline-blocks   # also the baseline commit in blocks, this commit's blocks against it
    python bench/blocks.py --restore 8000   # a verified restore, whole and in blocks, against a raw read
    python bench/blocks.py --ids 128        # the token ids a chain's blocks hold, an agent loop of 128 steps

Prints one row per model, workload and storage: bytes written, files on disk, RAM held at the end,
prompt tokens reused, seconds in all and in acquires (each with the caches it hands out evaluated,
where a join of blocks copies), and the ratios of blocks to the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: The package's folders and the modules they install as (pyproject.toml's package-dir).
PACKAGE_DIRS = {"kvstate": "kvstate", "core": "kvstate.core", "effects": "kvstate.effects",
                "interpreters": "kvstate.interpreters", "models": "kvstate.models"}
MODELS = {
    "tiny": dict(vocab_size=512, max_position_embeddings=32768),
    "small": dict(vocab_size=512, max_position_embeddings=32768, hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32),
}


# ---------------------------------------------------------------- the workloads (run in a worker)


def chat(rng: random.Random) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(prompt, reply)`` per request, in order: the next turn's prompt holds the reply."""
    history, out = words(rng, 400), []
    for _ in range(10):
        prompt, reply = history + words(rng, 80), words(rng, 150)
        out.append((prompt, reply))
        history = prompt + reply
    return out


def agent(rng: random.Random) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    history, out = words(rng, 600), []
    for _ in range(50):
        call = words(rng, 40)
        out.append((history, call))
        history = history + call + words(rng, 200)  # the tool's result
    return out


def branching(rng: random.Random) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    history, out = words(rng, 400), []
    for _ in range(6):
        question = words(rng, 80)
        prompt = history + question
        answers = [words(rng, 150) for _ in range(4)]  # the answer, then three regenerates
        out.extend((prompt, answer) for answer in answers)
        out.append((history + question[:60] + words(rng, 20), words(rng, 150)))  # the question edited
        history = prompt + answers[0]
    return out


WORKLOADS = {"chat": chat, "agent": agent, "branching": branching}


def words(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, 500) for _ in range(n))


def run_workload(model_name: str, workload: str, block_tokens: int | None, directory: str,
                 partial: bool = True) -> dict:
    """One workload on one storage: what it wrote, held and reused (``partial``: partial last blocks
    kept, else dropped and recomputed)."""
    import mlx.core as mx

    from kvstate import KvCacheService, Request
    from kvstate.interpreters.mlx.caches import arrays_of
    from kvstate.models.reference import build

    model, config = build("llama", seed=1, **MODELS[model_name])
    options = {} if block_tokens is None else {"block_tokens": block_tokens, "partial_blocks": partial}
    service = KvCacheService.for_mlx(model, ram_bytes=4 << 30, disk_dir=directory, disk_bytes=64 << 30,
                                     config=config, background_writes=False, **options)
    reused = prompt_tokens = 0
    started, acquiring = time.perf_counter(), 0.0
    for prompt, reply in WORKLOADS[workload](random.Random(workload)):
        request = Request(prompt, len(reply))
        asked = time.perf_counter()
        state = service.acquire(request, "bench")
        mx.eval(arrays_of(state.caches))  # what the hit hands the loop, made (a join copies here)
        acquiring += time.perf_counter() - asked
        mx.eval(model(mx.array([list(prompt[state.reused_tokens:] + reply)]), cache=state.caches))
        service.publish(request, "bench", prompt + reply, state.caches)
        service.release(request)
        reused += state.reused_tokens
        prompt_tokens += len(prompt)
    seconds = time.perf_counter() - started
    report = service.report()
    ram = service.state.ram.bytes
    service.close()
    files = [path for path in Path(directory).rglob("*.safetensors") if "rejected" not in path.parts]
    return {"bytes_written": report.bytes_written, "files": len(files),
            "disk_bytes": sum(path.stat().st_size for path in files), "ram_bytes": ram, "reused": reused,
            "prompt_tokens": prompt_tokens, "seconds": seconds, "acquiring": acquiring}


# ---------------------------------------------------------------- a verified restore, whole or in blocks


def restore_figures(tokens: int, block_tokens: int, repeat: int) -> None:
    """Seconds of a verified restore of a ``tokens``-token prefix at the Llama-3.1-8B geometry (128
    KiB a token in bf16): read whole from one file; from its block files read into place (as restores
    in blocks run), or one file at a time and then joined (and those loads alone); against the fastest plain read of the whole file's bytes
    into a reused buffer (``bench/disk.py``'s floor); and the CPU time of the raw read, of hashing its
    bytes and of the chain read into place (:func:`cpu_times`). Freed memory is kept for reuse, as in
    ``kvstate serve``; each figure the best of ``repeat``."""
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from disk import best, caches_of, fastest_read

    from kvstate.core.blocks import block_names
    from kvstate.effects import DiskKey
    from kvstate.interpreters.mlx import caches as mlx_caches
    from kvstate.interpreters.mlx.blocks import assemble, assemble_joined, cut
    from kvstate.interpreters.mlx.disk_store import DiskStore, StoreIdentity

    from kvstate.interpreters.mlx.host_memory import keep_freed_memory
    keep_freed_memory()  # as kvstate serve runs: freed memory kept for reuse, so reads fault in no fresh pages
    caches = caches_of(tokens)
    prompt = tuple(range(tokens))
    with tempfile.TemporaryDirectory() as directory:
        store = DiskStore(directory, StoreIdentity("bench", "none", "bench-blocks"))
        key = DiskKey("bench", prompt)
        store.commit(store.encode_prefix(key, caches, True, mlx_caches.live_bytes(caches)))
        names = block_names("bench", prompt, block_tokens)
        classes = [type(cache).__name__ for cache in caches]
        for name in names:
            store.commit(store.encode_block(name, cut(caches, name.start, name.start + len(name.tokens)), classes))
        like = [type(cache)() for cache in caches]

        def whole():
            mx.eval(mlx_caches.arrays_of(store.read_prefix(key)))

        def blocks():
            mx.eval(mlx_caches.arrays_of(assemble_joined(store.read_chain(names), like)))

        def blocks_joined():
            mx.eval(mlx_caches.arrays_of(assemble([store.read_block(name) for name in names], like)))

        def blocks_unjoined():
            mx.eval([a for name in names for layer in store.read_block(name) for a in layer.values()])

        def read_ahead():  # what a read ahead does: each file planned, filled in place and verified, then built
            planned = [store.plan_read_ahead(name) for name in names]
            for read in planned:
                store.fill(read)
            held = [store.built(read) for read in planned]
            mx.eval([a for block in held for layer in block for a in layer.values()])
            return held

        def read_ahead_joined():  # and the request it served: the blocks joined into its caches
            mx.eval(mlx_caches.arrays_of(assemble(read_ahead(), like)))

        def read_ahead_asking_thread() -> float:  # its share on the thread that asks (the reader fills)
            started = time.perf_counter()
            planned = [store.plan_read_ahead(name) for name in names]
            asking = time.perf_counter() - started
            for read in planned:
                store.fill(read)
            started = time.perf_counter()
            held = [store.built(read) for read in planned]
            mx.eval([a for block in held for layer in block for a in layer.values()])
            return asking + time.perf_counter() - started

        path = str(store.prefix_path(key))
        buffer = np.empty(os.path.getsize(path), dtype=np.uint8)
        raw = fastest_read(path, buffer, repeat)
        cpu = cpu_times(path, buffer, blocks, repeat)
        figures = {"whole": best(whole, repeat), "blocks, into place": best(blocks, repeat),
                   "blocks, then joined": best(blocks_joined, repeat), "blocks, not joined": best(blocks_unjoined, repeat),
                   "read ahead": best(read_ahead, repeat), "read ahead, joined": best(read_ahead_joined, repeat),
                   "read ahead, its asking thread's share": min(read_ahead_asking_thread() for _ in range(repeat))}
        print(f"verified restore of {tokens:,} tokens ({os.path.getsize(path) / 1e6:,.0f} MB; {len(names)} block "
              f"files of {block_tokens} tokens); raw read of the whole file {raw * 1e3:.0f} ms")
        for name, seconds in figures.items():
            print(f"  {name:18} {seconds * 1e3:8.0f} ms  {seconds / raw:5.2f}x the raw read")
        print(f"  CPU time (user + system, all threads, the fastest run's): the parallel raw read "
              f"{cpu['raw'] * 1e3:.0f} ms, hashing its bytes {cpu['hash'] * 1e3:.0f} ms, the chain read into "
              f"place {cpu['chain'] * 1e3:.0f} ms ({(cpu['chain'] - cpu['raw'] - cpu['hash']) * 1e3:+.0f} ms beyond "
              f"the read and the hash)")


def cpu_times(path: str, buffer, chain_read, repeat: int) -> dict[str, float]:
    """CPU seconds (user and system, every thread) of the fastest of ``repeat`` runs of: the parallel raw
    read of ``path``, the hash of its bytes, and ``chain_read``. A verified read copies every byte and
    hashes it: what the chain read spends beyond those two is its own work (headers, pieces, tasks)."""
    import resource

    from disk import read_parallel

    from kvstate.interpreters.mlx import content_hash

    def cpu_of(call) -> float:
        runs = []
        for _ in range(repeat):
            before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            call()
            after = resource.getrusage(resource.RUSAGE_SELF)
            runs.append((time.perf_counter() - started,
                         after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime))
        return min(runs)[1]
    return {"raw": cpu_of(lambda: read_parallel(path, buffer)), "hash": cpu_of(lambda: content_hash.digest(buffer)),
            "chain": cpu_of(chain_read)}


# ---------------------------------------------------------------- the baseline, from git


def export_commit(revision: str, into: Path) -> Path:
    """The package as ``revision`` has it, laid out for import under ``into`` (the folders the
    project installs through package-dir, at their module paths)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", revision, *PACKAGE_DIRS],
                             check=True, capture_output=True).stdout
    raw = into / "raw"
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(raw, filter="data")
    root = into / "site"
    for folder, module in PACKAGE_DIRS.items():
        target = root.joinpath(*module.split("."))
        target.parent.mkdir(parents=True, exist_ok=True)
        (raw / folder).rename(target)
    return root


def in_worker(site: Path | None, job: dict) -> dict:
    """``job`` run by this file in a fresh process, importing the package from ``site`` (None: the
    installed one)."""
    environment = dict(os.environ)
    if site is not None:
        environment["PYTHONPATH"] = str(site)
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], check=True, capture_output=True,
                          text=True, env=environment, cwd=site or REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


def ids_held(steps: int, block_tokens: int) -> None:
    """The bytes of token ids the blocks of one chain hold: an agent loop of ``steps`` steps of 1,000
    tokens each, published step by step through the simulator (the core's entries, as production keeps
    them), against what a copy of each block's path from the namespace's start would take."""
    from kvstate import KvCacheService, Request, SimCaches, model_spec
    spec = model_spec("llama-3.1-8b")
    service = KvCacheService.simulated(spec, ram_bytes=spec.bytes_for(steps * 1000 + 1000), block_tokens=block_tokens)
    tokens: tuple[int, ...] = ()
    for step in range(steps):
        tokens += tuple(range(step * 1000 + 1, step * 1000 + 1001))
        service.publish(Request(tokens, 1), "default", tokens, SimCaches(tokens, spec))
    blocks = [entry for entry in service.state.entries.values() if entry.is_block]
    held = sum(len(source) for source in {id(e.source): e.source for e in blocks}.values())
    paths = sum(len(entry.packed) for entry in blocks)
    print(f"{len(blocks)} blocks over {len(tokens):,} tokens: ids held {held / 2**20:.1f} MiB; "
          f"a path a block would hold {paths / 2**20:.1f} MiB ({paths / held:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD~1", help="the commit whose whole-prefix storage is the baseline")
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--workloads", default="chat,agent,branching")
    parser.add_argument("--block-tokens", type=int, default=256)
    parser.add_argument("--baseline-blocks", action="store_true",
                        help="also run the baseline commit in blocks (its row 'baseline blocks'), and give "
                             "this commit's blocks against it")
    parser.add_argument("--restore", type=int, default=None, metavar="TOKENS",
                        help="instead: time a verified restore of a prefix this long, whole and in blocks")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ids", type=int, default=None, metavar="STEPS",
                        help="the token ids the blocks of an agent loop of this many steps hold (no model run)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ids:
        ids_held(args.ids, args.block_tokens)
        return
    if args.restore:
        restore_figures(args.restore, args.block_tokens, args.repeat)
        return
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(run_workload(job["model"], job["workload"], job["block_tokens"], job["directory"],
                                      job.get("partial", True))))
        return
    with tempfile.TemporaryDirectory() as work:
        site = export_commit(args.baseline, Path(work))
        baseline_name = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.baseline], check=True,
                                       capture_output=True, text=True).stdout.strip()
        print(f"blocks of {args.block_tokens} tokens against whole prefixes ({baseline_name} exported, and this "
              f"commit with block_tokens=None); write-behind, every kept state written")
        print(f"{'model':6} {'workload':10} {'storage':14} {'written MB':>10} {'files':>6} {'disk MB':>8} "
              f"{'RAM MB':>7} {'reused':>7} {'s':>6} {'acquire s':>9}  blocks / baseline")
        for model in args.models.split(","):
            for workload in args.workloads.split(","):
                rows = {}
                storages = [("baseline", site, None, True), ("whole", None, None, True),
                            ("blocks", None, args.block_tokens, True), ("full blocks", None, args.block_tokens, False)]
                if args.baseline_blocks:
                    storages.insert(2, ("baseline blocks", site, args.block_tokens, True))
                for storage, where, block_tokens, partial in storages:
                    directory = Path(work) / f"{model}-{workload}-{storage}".replace(" ", "-")
                    rows[storage] = in_worker(where, {"model": model, "workload": workload, "partial": partial,
                                                      "block_tokens": block_tokens, "directory": str(directory)})
                base = rows["baseline"]
                for storage, row in rows.items():
                    ratios = ""
                    if storage in ("blocks", "full blocks"):
                        ratios = (f"written {row['bytes_written'] / base['bytes_written']:.3f}x, "
                                  f"RAM {row['ram_bytes'] / base['ram_bytes']:.3f}x, "
                                  f"reused {row['reused'] / max(1, base['reused']):.3f}x, "
                                  f"acquire {row['acquiring'] / base['acquiring']:.2f}x")
                        if args.baseline_blocks and storage == "blocks":
                            before = rows["baseline blocks"]
                            ratios += (f"; against baseline blocks: acquire "
                                       f"{row['acquiring'] / before['acquiring']:.2f}x, "
                                       f"s {row['seconds'] / before['seconds']:.2f}x")
                    print(f"{model:6} {workload:10} {storage:14} {row['bytes_written'] / 1e6:10.2f} {row['files']:6d} "
                          f"{row['disk_bytes'] / 1e6:8.2f} {row['ram_bytes'] / 1e6:7.2f} {row['reused']:7d} "
                          f"{row['seconds']:6.1f} {row['acquiring']:9.3f}  {ratios}", flush=True)


if __name__ == "__main__":
    main()
