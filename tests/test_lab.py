"""The eviction lab: figures a correct replay reproduces, block policies against references, Belady's ceiling."""

from __future__ import annotations

import json
import subprocess
import sys

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvstate.interpreters.lab import traces
from kvstate.interpreters.lab.blocks import BLOCK_POLICIES
from kvstate.interpreters.lab.runs import PREFIX_POLICIES, ceiling, run_blocks, run_prefixes, unbounded
from kvstate.interpreters.lab.sweep import BadCapacity, RayUnavailable, parse_capacity, sweep
from kvstate.interpreters.traces import bundled
from kvstate.models import model_spec

MODEL = model_spec("llama-3.1-8b")
#: The figures interpreters/traces/README.md gives for an unbounded cache (block hit, token-weighted hit).
PUBLISHED = {"conversation_trace.jsonl": (0.3664, 0.3736), "synthetic_trace.jsonl": (0.6396, 0.6512)}


@pytest.fixture(scope="module", params=sorted(PUBLISHED))
def bundled_trace(request):
    return request.param, traces.read(bundled(request.param))


def test_unbounded_replays_reproduce_the_published_figures(bundled_trace):
    name, trace = bundled_trace
    block, token = PUBLISHED[name]
    everything = trace.unique_blocks
    for outcome in (unbounded(trace), run_blocks(trace, "lru", everything, None, MODEL),
                    run_prefixes(trace, "lru", 1 << 62, None, MODEL)):
        assert round(outcome.block_hit_ratio, 4) == block
        assert round(outcome.token_hit_ratio, 4) == token


def test_the_ceiling_at_prefix_granularity_follows_the_geometrys_reuse_rules():
    """An unbounded cache of state that cannot be cut back (a hybrid model) reuses only the exact
    prefixes kept, so its ceiling is below the block-level one; no policy's row rises above it, and
    ``kvstate simulate`` prints it as the unbounded row."""
    trace = traces.Trace("first 400", traces.read(bundled("conversation_trace.jsonl")).requests[:400])
    hybrid = model_spec("qwen3-next-80b-a3b")
    most = ceiling(trace, "prefix", hybrid)
    assert 0 < most.token_hit_ratio < unbounded(trace).token_hit_ratio
    for policy in ("lru", "gdsf"):
        assert run_prefixes(trace, policy, hybrid.bytes_for(512) * 40, None, hybrid).reused_tokens <= most.reused_tokens
    assert ceiling(trace, "block", hybrid) == unbounded(trace)
    # an attention model's state can be cut back: its prefix ceiling is the block-level one
    assert ceiling(trace, "prefix", MODEL).reused_tokens == unbounded(trace).reused_tokens
    done = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "simulate", "--limit", "400",
                           "--granularity", "prefix", "--model", "qwen3-next-80b-a3b", "--capacity", "10%",
                           "--policy", "lru", "--json", "", "--plot", ""], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("(unbounded)")).split()
    assert float(row[2]) == pytest.approx(most.token_hit_ratio, abs=1e-4)


def naive_hits(policy: str, capacity: int, accesses: list[int]) -> int:
    """Straightforward LRU, FIFO and LFU (least uses, then least recent) over a plain list."""
    held: list[int] = []
    uses: dict[int, int] = {}
    last: dict[int, int] = {}
    hits = 0
    for clock, block in enumerate(accesses):
        if block in held:
            hits += 1
            uses[block] += 1
            last[block] = clock
            if policy == "lru":
                held.remove(block)
                held.append(block)
            continue
        if len(held) >= capacity:
            if policy == "lfu":
                victim = min(held, key=lambda b: (uses[b], last[b]))
            else:
                victim = held[0]
            held.remove(victim)
        held.append(block)
        uses[block], last[block] = 1, clock
    return hits


def naive_sieve_hits(capacity: int, accesses: list[int]) -> int:
    """SIEVE as the paper states it, over a plain list (oldest first) and a hand index."""
    queue: list[int] = []
    visited: dict[int, bool] = {}
    hand, hits = None, 0
    for block in accesses:
        if block in visited:
            visited[block] = True
            hits += 1
            continue
        if len(queue) >= capacity:
            i = queue.index(hand) if hand in visited else 0
            while visited[queue[i]]:
                visited[queue[i]] = False
                i = i + 1 if i + 1 < len(queue) else 0
            hand = queue[i + 1] if i + 1 < len(queue) else None
            del visited[queue.pop(i)]
        queue.append(block)
        visited[block] = False
    return hits


def as_trace(accesses: list[int]) -> traces.Trace:
    return traces.Trace("test", tuple(traces.TraceRequest(0.0, 512, 1, (b,)) for b in accesses))


block_sequences = st.lists(st.integers(0, 30), min_size=1, max_size=300)


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu"])
@settings(max_examples=200, deadline=None)
@given(accesses=block_sequences, capacity=st.integers(1, 25))
def test_block_policies_agree_exactly_with_references(policy, accesses, capacity):
    assert run_blocks(as_trace(accesses), policy, capacity, None, MODEL).block_hits == \
        naive_hits(policy, capacity, accesses)


@settings(max_examples=200, deadline=None)
@given(accesses=block_sequences, capacity=st.integers(1, 25))
def test_block_sieve_agrees_with_the_papers_algorithm(accesses, capacity):
    assert run_blocks(as_trace(accesses), "sieve", capacity, None, MODEL).block_hits == \
        naive_sieve_hits(capacity, accesses)


@settings(max_examples=200, deadline=None)
@given(accesses=block_sequences, capacity=st.integers(1, 25))
def test_belady_is_never_beaten(accesses, capacity):
    trace = as_trace(accesses)
    ceiling = run_blocks(trace, "belady", capacity, None, MODEL).block_hits
    for policy in BLOCK_POLICIES:
        assert run_blocks(trace, policy, capacity, None, MODEL).block_hits <= ceiling, policy


@pytest.mark.parametrize("policy", sorted(BLOCK_POLICIES))
def test_every_block_policy_stays_within_capacity_and_hits_with_room(policy):
    trace = traces.chat(300, seed=3)
    small = run_blocks(trace, policy, 20, None, MODEL)
    roomy = run_blocks(trace, policy, trace.unique_blocks, None, MODEL)
    assert 0 < small.block_hits <= roomy.block_hits == unbounded(trace).block_hits


def test_a_disk_tier_behind_ram_serves_what_ram_evicted():
    trace = traces.chat(400, seed=4)
    alone = run_blocks(trace, "lru", 30, None, MODEL)
    tiered = run_blocks(trace, "lru", 30, 10**9, MODEL)
    assert tiered.block_hits > alone.block_hits
    assert tiered.disk_bytes_written > 0 and tiered.disk_bytes_read > 0


def test_the_reports_disk_wear_is_what_the_disk_saw():
    """Through the service, the report's bytes written and read are the bytes the simulated disk
    wrote and read, and the row's write amplification is their ratio."""
    trace = traces.chat(400, seed=4)
    outcome = run_prefixes(trace, "lru", MODEL.bytes_for(512) * 30, MODEL.bytes_for(512) * 1000, MODEL)
    assert outcome.report.bytes_written == outcome.disk_bytes_written > 0
    assert outcome.report.bytes_read == outcome.disk_bytes_read > 0
    assert outcome.write_amplification == outcome.disk_bytes_written / outcome.disk_bytes_read
    assert run_prefixes(trace, "lru", MODEL.bytes_for(512) * 30, None, MODEL).write_amplification == 0.0


@pytest.mark.parametrize("kind", sorted(traces.SYNTHETIC))
def test_synthetic_workloads_are_seeded_and_share_prefixes(kind):
    first, again, other = (traces.SYNTHETIC[kind](500, seed=s) for s in (1, 1, 2))
    assert first.requests == again.requests and first.requests != other.requests
    assert len(first.requests) == 500
    assert 0.2 < unbounded(first).block_hit_ratio < 1.0


def test_kvstate_jsonl_with_tokens_or_blocks(tmp_path):
    path = tmp_path / "trace.jsonl"
    system = list(range(600))
    records = [
        {"arrival": 0.0, "session": "a", "tokens": system + [1, 2, 3], "output_length": 5},
        {"arrival": 1.0, "session": "b", "tokens": system + [9], "output_length": 5},
        {"arrival": 2.0, "namespace": "other", "tokens": system + [9], "output_length": 5},
        {"arrival": 3.0, "blocks": [7, 8], "input_length": 700, "output_length": 1},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    trace = traces.read(path)
    a, b, c, d = trace.requests
    assert a.blocks[0] == b.blocks[0] != c.blocks[0]  # namespaces never share blocks
    assert a.blocks[1] != b.blocks[1] and a.input_length == 603 and d.input_length == 700


def test_capacities_in_every_form():
    trace = traces.chat(200, seed=5)
    per_block = MODEL.bytes_for(512)
    assert parse_capacity("1000", "blocks", trace, MODEL).blocks == 1000
    assert parse_capacity("3M", "tokens", trace, MODEL).blocks == 3_000_000 // 512
    assert parse_capacity("20GB", "blocks", trace, MODEL).blocks == 20 * 10**9 // per_block
    assert parse_capacity("10%", "blocks", trace, MODEL).blocks == int(0.1 * trace.unique_blocks)
    assert parse_capacity("0.1x", "blocks", trace, MODEL).blocks == int(0.1 * trace.unique_blocks)
    assert parse_capacity("1e3", "blocks", trace, MODEL).blocks == 1000
    assert parse_capacity("1", "blocks", trace, MODEL).blocks == 1  # one block, never the whole working set
    with pytest.raises(BadCapacity, match="10%"):
        parse_capacity("0.1", "blocks", trace, MODEL)  # ambiguous: a fraction is written 10% or 0.1x
    assert parse_capacity("512K", "bytes", trace, MODEL).nbytes == 512_000
    with pytest.raises(BadCapacity):
        parse_capacity("lots", "blocks", trace, MODEL)


def test_prefix_granularity_runs_the_service_and_only_its_policies():
    trace = traces.rag(300, seed=6)
    for policy in PREFIX_POLICIES:
        outcome = run_prefixes(trace, policy, MODEL.bytes_for(512) * 40, MODEL.bytes_for(512) * 400, MODEL)
        assert 0 < outcome.token_hit_ratio <= unbounded(trace).token_hit_ratio
        assert outcome.disk_bytes_written > 0
    with pytest.raises(ValueError, match="block granularity only"):
        run_prefixes(trace, "belady", 10**9, None, MODEL)


def test_simulate_command_writes_rows_and_a_plot(tmp_path):
    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    done = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "simulate", "--synthetic", "chat",
                           "--requests", "300", "--policy", "lru,belady", "--capacity", "50,50%",
                           "--json", str(out), "--plot", str(png)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["capacity"]) for r in rows] == [("lru", "50"), ("lru", "50%"), ("belady", "50"),
                                                           ("belady", "50%")]
    required = {"policy", "capacity", "unit", "granularity", "requests", "request_hit_rate", "token_hit_ratio",
                "block_hit_ratio", "disk_bytes_written", "disk_bytes_read", "write_amplification",
                "prefill_seconds_saved"}
    assert all(required <= set(r) for r in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "simulate", "--granularity", "prefix",
                          "--policy", "arc", "--synthetic", "rag"], capture_output=True, text=True)
    assert bad.returncode == 2 and "not available at prefix granularity" in bad.stderr


def test_simulate_with_no_arguments_writes_the_table_json_and_plot(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "simulate", "--limit", "2000"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "bundled Mooncake conversation trace" in done.stdout and "(unbounded)" in done.stdout
    rows = json.loads((tmp_path / "kvstate-lab.json").read_text())
    assert len(rows) == len(BLOCK_POLICIES) * 5
    assert (tmp_path / "kvstate-lab.png").read_bytes()[:4] == b"\x89PNG"


def _without_timing(rows):
    return [attrs.evolve(row, seconds=0.0) for row in rows]


@pytest.mark.parametrize("granularity", ["block", "prefix"])
def test_a_sweep_on_ray_gives_the_rows_of_the_local_run(granularity):
    """The cells of a sweep sent to a local Ray instance come back as the same rows, in the same
    order, as the local process pool gives (their wall-clock seconds aside)."""
    ray = pytest.importorskip("ray", reason="sweeps on Ray need the ray package (kvstate[ray])")
    trace = traces.chat(400, seed=3)
    capacities = [parse_capacity(c, "blocks", trace, MODEL) for c in ("20", "10%", "50%")]
    policies = ["lru", "sieve", "s3fifo"] + (["belady"] if granularity == "block" else [])
    local = sweep(trace, policies, capacities, granularity, MODEL, processes=2, progress=False)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = sweep(trace, policies, capacities, granularity, MODEL, progress=False, ray="")
    finally:
        ray.shutdown()
    assert _without_timing(remote) == _without_timing(local)
    assert len(local) == len(policies) * len(capacities) and any(row.token_hit_ratio > 0 for row in local)


def test_a_sweep_on_ray_without_ray_installed_says_how_to_get_it(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_ray)
    trace = traces.chat(20, seed=1)
    with pytest.raises(RayUnavailable, match=r"kvstate\[ray\]"):
        sweep(trace, ["lru"], [parse_capacity("10", "blocks", trace, MODEL)], "block", MODEL, progress=False,
              ray="")


prompt_chains = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(chains=prompt_chains, capacity=st.integers(1, 12))
def test_leaf_first_lru_never_evicts_a_block_that_a_held_block_extends(chains, capacity):
    """Prompts as chains of blocks (a block's id names its whole prefix, as chained ids do): the
    leaf-first cache evicts only blocks that no held block extends, so it cuts chains from their
    tails, and it never holds more than its capacity."""
    from kvstate.interpreters.lab.blocks import LeafLRUBlocks

    cache, parent_of = LeafLRUBlocks(capacity), {}
    for chain in chains:
        blocks = [tuple(chain[:n + 1]) for n in range(len(chain))]  # a prefix names a block
        cache.begin()
        for before, block in zip([None] + blocks, blocks):
            parent_of[block] = before
            if cache.lookup(block):
                continue
            victim = cache.insert(block)
            held = set(cache._parent)
            assert len(held) <= capacity
            assert victim is None or victim not in held
            assert victim is None or not any(parent_of[b] == victim for b in held)
