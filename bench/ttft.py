"""Time to first token for a 4k-token prompt on the reference llama: miss vs RAM hit vs disk hit.

The prompt's state is published once; then a request extending it by one
token is served three ways in the same run: a miss (fresh caches, the whole
prompt prefilled), a RAM hit (state cloned from the RAM tier), and a disk hit
in a fresh process (state restored from the files the first process wrote,
content hashes verified). TTFT is acquire + prefill of the uncovered tokens
+ the first sampled token. Ratios are against the miss (lower is better).

    python bench/ttft.py [--tokens 4096] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import mlx.core as mx

from kvstate import KvCacheService, Request
from kvstate.models.reference import build

CHILD = """
import json, sys, time, mlx.core as mx
from kvstate import KvCacheService, Request
from kvstate.models.reference import build
directory, tokens, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model, config = build("llama", seed=50)
prompt = tuple(i % 250 + 1 for i in range(tokens))
times = []
for i in range(repeat):
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=1 << 30, disk_dir=directory,
                                     disk_bytes=1 << 32)
    start = time.perf_counter()
    state = service.acquire(Request(prompt + (7 + i,), 8), "bench")
    logits = model(mx.array([list((prompt + (7 + i,))[state.reused_tokens:])]), cache=state.caches)[0, -1]
    int(mx.argmax(logits).item())
    times.append(time.perf_counter() - start)
    assert state.source.value == "disk", state.source
print(json.dumps(times))
"""


def first_token(service: KvCacheService, model, prompt: tuple[int, ...]) -> tuple[float, int]:
    start = time.perf_counter()
    request = Request(prompt, 8)
    state = service.acquire(request, "bench")
    logits = model(mx.array([list(prompt[state.reused_tokens:])]), cache=state.caches)[0, -1]
    int(mx.argmax(logits).item())
    elapsed = time.perf_counter() - start
    service.release(request)
    return elapsed, state.reused_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    model, config = build("llama", seed=50)
    prompt = tuple(i % 250 + 1 for i in range(args.tokens))
    with tempfile.TemporaryDirectory() as directory:
        service = KvCacheService.for_mlx(model, config=config, ram_bytes=1 << 30, disk_dir=directory,
                                         disk_bytes=1 << 32)
        misses, hits = [], []
        for i in range(args.repeat):
            elapsed, reused = first_token(service, model, (900 + i,) + prompt)  # shares nothing
            assert reused == 0
            misses.append(elapsed)
        request = Request(prompt, 8)
        state = service.acquire(request, "bench")
        mx.eval(model(mx.array([list(prompt)]), cache=state.caches))
        service.publish(request, "bench", prompt, state.caches)
        service.release(request)
        assert service.close().durable
        service = KvCacheService.for_mlx(model, config=config, ram_bytes=1 << 30, disk_dir=directory,
                                         disk_bytes=1 << 32)
        request = Request(prompt + (1,), 8)
        state = service.acquire(request, "bench")  # the first is a disk read; it fills RAM via publish
        service.publish(request, "bench", prompt, state.caches)
        service.release(request)
        for i in range(args.repeat):
            elapsed, reused = first_token(service, model, prompt + (7 + i,))
            assert reused == args.tokens
            hits.append(elapsed)
        service.close()
        child = subprocess.run([sys.executable, "-c", CHILD, directory, str(args.tokens), str(args.repeat)],
                               capture_output=True, text=True, check=True)
        disk = json.loads(child.stdout.strip().splitlines()[-1])
    miss, ram, from_disk = (statistics.median(t) for t in (misses, hits, disk))
    print(f"time to first token, {args.tokens}-token prompt, reference llama (CPU), median of {args.repeat}:")
    print(f"  miss (full prefill)       {miss * 1000:8.2f} ms   1.000")
    print(f"  RAM hit                   {ram * 1000:8.2f} ms   {ram / miss:.3f}")
    print(f"  disk hit (fresh process)  {from_disk * 1000:8.2f} ms   {from_disk / miss:.3f}")


if __name__ == "__main__":
    main()
