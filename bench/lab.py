"""Eviction-lab speed on the bundled conversation trace (12,031 requests, 288,500 block accesses).

In one run:
- block LRU through the lab (``run_blocks``), against a plain-Python OrderedDict LRU over the same
  accesses (the baseline), at 10% of the working set;
- the same accesses through libCacheSim's LRU (the ``libcachesim`` bindings, one ``get`` per access
  from Python, as a Python user of the bindings runs it), the same hits checked;
- whole-prefix replay through the service's full transitions (``run_prefixes``: every request
  acquired, published and released on the simulator), in requests per second.

Ratios are lab time over baseline time on the same accesses (1.0 = as fast as the bare loop).

    python bench/lab.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict

from kvstate.interpreters.lab import traces
from kvstate.interpreters.lab.runs import run_blocks, run_prefixes
from kvstate.interpreters.traces import bundled
from kvstate.models import model_spec

MODEL = model_spec("llama-3.1-8b")


def baseline(accesses: list[int], capacity: int) -> tuple[int, float]:
    """The plainest LRU: an OrderedDict, move_to_end on a hit, popitem on overflow."""
    started = time.perf_counter()
    cache: OrderedDict = OrderedDict()
    hits = 0
    for block in accesses:
        if block in cache:
            cache.move_to_end(block)
            hits += 1
        else:
            cache[block] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits, time.perf_counter() - started


def libcachesim_lru(accesses: list[int], capacity: int) -> tuple[int, float]:
    """libCacheSim's LRU through its Python bindings, one request object reused for every access."""
    import libcachesim

    cache, request = libcachesim.LRU(cache_size=capacity), libcachesim.Request()
    started = time.perf_counter()
    hits = 0
    for block in accesses:
        request.obj_id, request.obj_size = block, 1
        hits += cache.get(request)
    return hits, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    trace = traces.read(bundled())
    accesses = [b for r in trace.requests for b in r.blocks]
    capacity = trace.unique_blocks // 10
    lab_times, base_times, peer_times = [], [], []
    for _ in range(args.repeat):
        hits, base = baseline(accesses, capacity)
        outcome = run_blocks(trace, "lru", capacity, None, MODEL)
        assert outcome.block_hits == hits, "the lab's LRU and the baseline disagree"
        peer_hits, peer = libcachesim_lru(accesses, capacity)
        assert peer_hits == hits, "the lab's LRU and libCacheSim's disagree"
        lab_times.append(outcome.seconds)
        base_times.append(base)
        peer_times.append(peer)
    lab, base, peer = min(lab_times), min(base_times), min(peer_times)
    print(f"block LRU, {len(accesses):,} accesses at {capacity:,} blocks: "
          f"lab {len(accesses) / lab / 1e6:.2f} M accesses/s, OrderedDict baseline "
          f"{len(accesses) / base / 1e6:.2f} M/s, ratio lab/baseline {lab / base:.2f}; libCacheSim "
          f"{len(accesses) / peer / 1e6:.2f} M/s, lab speed / libCacheSim speed {peer / lab:.2f}")
    prefix = min((run_prefixes(trace, "lru", MODEL.bytes_for(512) * capacity, None, MODEL)
                  for _ in range(args.repeat)), key=lambda o: o.seconds)
    print(f"whole-prefix replay through the service: {prefix.requests / prefix.seconds:,.0f} requests/s "
          f"({prefix.block_accesses / prefix.seconds / 1e6:.2f} M block accesses/s), ratio to the baseline's "
          f"time per access {prefix.seconds / prefix.block_accesses / (base / len(accesses)):.1f}")


if __name__ == "__main__":
    main()
