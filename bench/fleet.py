"""Two ``kvstate serve`` processes sharing a tier on a real object store, against two stock servers.

A fleet of two servers behind a router that sends each turn of a conversation to either at random
(seeded): the same sequence of turns goes to two kvstate servers sharing a SeaweedFS bucket (each
with its own disk directory, ``--remote``) and to two stock ``mlx_lm.server`` processes, each with
its own prompt cache. A turn whose conversation last ran on the other server is *moved*: stock
prefills its whole history again, kvstate fetches the blocks it lacks from the bucket; a turn on the
same server is *stayed* (a local hit for both). Every server is warmed up first, twice.

Prints TTFT p50 and p99 of moved and stayed turns on each fleet, the ratios, and what crossed the
network: bytes fetched from and written to the bucket per token served, and the share of what was
written that any server read back. Then the break-even bandwidth of the geometry run: the network speed
above which fetching a token's KV beats prefilling it at the prefill pace kvstate measured here
(the bytes a token's KV takes times tokens prefilled per second). Loopback is not a network: it moves
gigabytes a second, so the figures here are a floor for a remote hit's cost, not a fleet's.

    python bench/fleet.py [--geometry small|1b|8b] [--sessions 6 --turns 6] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from serve import GEOMETRIES, SYSTEM, Server, text  # noqa: E402

from tests.object_store import ObjectStore  # noqa: E402


def metrics(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as reply:
        values = {}
        for line in reply.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
    return values


def run_fleet(servers: list[Server], plan: list[list[int]], user_words: int, max_tokens: int) -> list[dict]:
    """Each conversation's turns, in rounds (every conversation's turn t before any's t + 1), each sent
    to the server the plan names; each record says whether it moved."""
    histories = [[{"role": "system", "content": SYSTEM}] for _ in plan]
    last: list[int | None] = [None] * len(plan)
    records = []
    for turn in range(len(plan[0])):
        for session, targets in enumerate(plan):
            history = histories[session]
            history.append({"role": "user", "content": text(user_words, session * 100 + turn)})
            result = servers[targets[turn]].chat(history, max_tokens)
            history.append({"role": "assistant", "content": result["reply"]})
            result["moved"] = last[session] is not None and last[session] != targets[turn]
            result["first"] = last[session] is None
            last[session] = targets[turn]
            records.append(result)
    return records


def figures(records: list[dict], kind: str) -> dict:
    ttft = {"moved": sorted(r["ttft"] for r in records if r["moved"]),
            "stayed": sorted(r["ttft"] for r in records if not r["moved"] and not r["first"])}
    return {f"{kind}_{what}_{stat}": value for what, values in ttft.items() if values
            for stat, value in (("p50", statistics.median(values)),
                                ("p99", values[min(len(values) - 1, int(0.99 * len(values)))]),
                                ("n", len(values)))}


def kv_bytes_per_token(geometry: dict, dtype_bytes: int) -> int:
    """The bytes a token's KV takes at a llama ``geometry``: keys and values of every layer."""
    return 2 * geometry["num_hidden_layers"] * geometry["num_key_value_heads"] * geometry["head_dim"] * dtype_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="small")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-words", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ram-bytes", type=int, default=4 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()

    import mlx.core as mx

    from kvstate.models.model_dir import save_model_dir

    work = Path(tempfile.mkdtemp(prefix="kvstate-bench-fleet-"))
    dtype = mx.float32 if args.geometry == "small" else mx.bfloat16
    model_dir = save_model_dir(work / "model", "llama", seed=1, dtype=dtype, **GEOMETRIES[args.geometry])
    rng = random.Random(args.seed)
    plan = [[rng.randrange(2) for _ in range(args.turns)] for _ in range(args.sessions)]
    os.environ.update({"AWS_ACCESS_KEY_ID": "kvstate", "AWS_SECRET_ACCESS_KEY": "kvstate",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    store = ObjectStore(work / "seaweedfs")
    servers: list[Server] = []
    try:
        shared = ["--remote", f"s3://{store.bucket}/fleet", "--remote-endpoint", store.endpoint,
                  "--salt-key-file", str(work / "salt.key")]
        ours = [Server("kvstate", model_dir, args.ram_bytes, work / f"disk-{n}", work / f"kvstate-{n}.log",
                       work / "jit", shared) for n in range(2)]
        servers += ours
        stock = [Server("stock", model_dir, args.ram_bytes, None, work / f"stock-{n}.log", work / "jit")
                 for n in range(2)]
        servers += stock
        for server in servers:
            server.warm_up()
        before = [metrics(server) for server in ours]
        kvstate_records = run_fleet(ours, plan, args.user_words, args.max_tokens)
        stock_records = run_fleet(stock, plan, args.user_words, args.max_tokens)
        after = [metrics(server) for server in ours]
        for server in ours:
            server.stop()  # a clean stop: what is kept and not yet in the bucket is written there
        stored = [item["Size"] for page in store.client.get_paginator("list_objects_v2").paginate(
            Bucket=store.bucket, Prefix="fleet/") for item in page.get("Contents", [])]
    finally:
        for server in servers:
            server.stop()
        store.stop()
    same_text = all(a["reply"] == b["reply"] for a, b in zip(kvstate_records, stock_records))

    def grown(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before))
    fetched, written = grown("kvstate_remote_bytes_read_total"), grown("kvstate_remote_writes_total")
    prefill_rate = statistics.median(a.get("kvstate_prefill_tokens_per_s", 0.0) for a in after) or None
    geometry = GEOMETRIES[args.geometry]
    per_token = kv_bytes_per_token(geometry, 4 if args.geometry == "small" else 2)
    tokens = sum(r["tokens"] for r in kvstate_records)
    rows = {**figures(kvstate_records, "kvstate"), **figures(stock_records, "stock"),
            "remote_bytes_read": fetched, "remote_blocks_read": grown("kvstate_remote_blocks_read_total"),
            "remote_blocks_written": written, "bucket_objects": len(stored), "bucket_bytes": sum(stored),
            "remote_failures": grown("kvstate_remote_failures_total"),
            "remote_rejected": grown("kvstate_remote_rejected_total"),
            "cached_moved": sum(r["cached"] for r in kvstate_records if r["moved"]), "same_text": same_text,
            "prefill_tokens_per_s": prefill_rate, "output_tokens": tokens, "kv_bytes_per_token": per_token}
    print(f"geometry {args.geometry}, {mx.default_device()}, {args.sessions} conversations of {args.turns} turns, "
          f"each turn to one of two servers at random (seed {args.seed}); the same text from both fleets: {same_text}")
    print(f"{'turns':8}{'fleet':9}{'n':>4}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
    for what in ("moved", "stayed"):
        for kind in ("kvstate", "stock"):
            if f"{kind}_{what}_p50" in rows:
                print(f"{what:8}{kind:9}{rows[f'{kind}_{what}_n']:>4}{rows[f'{kind}_{what}_p50'] * 1e3:>13.1f}"
                      f"{rows[f'{kind}_{what}_p99'] * 1e3:>13.1f}")
        if f"kvstate_{what}_p50" in rows and f"stock_{what}_p50" in rows:
            print(f"{'':8}{'ratio':9}{'':>4}{rows[f'kvstate_{what}_p50'] / rows[f'stock_{what}_p50']:>12.2f}x"
                  f"{rows[f'kvstate_{what}_p99'] / rows[f'stock_{what}_p99']:>12.2f}x")
    if "kvstate_moved_p50" in rows and "kvstate_stayed_p50" in rows:
        print(f"kvstate moved / kvstate stayed (a fetch against a local hit): "
              f"{rows['kvstate_moved_p50'] / rows['kvstate_stayed_p50']:.2f}x p50")
    print(f"bucket: {rows['remote_blocks_read']:.0f} blocks fetched ({fetched / 1e6:.1f} MB, "
          f"{fetched / max(tokens, 1) / 1e3:.1f} kB per output token); {len(stored)} objects written "
          f"({sum(stored) / 1e6:.1f} MB), of which {fetched / max(sum(stored), 1):.2f} was read back; "
          f"{rows['cached_moved']} prompt "
          f"tokens of moved turns reused; failures {rows['remote_failures']:.0f}, rejected "
          f"{rows['remote_rejected']:.0f}")
    if prefill_rate:
        print(f"break-even: {per_token / 1024:.1f} KiB of KV a token x {prefill_rate:,.0f} tokens/s prefilled here "
              f"= {per_token * prefill_rate / 1e9:.3f} GB/s; a remote hit pays on a network faster than that")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
