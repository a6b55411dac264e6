"""Two models under one root, as two real processes, each a full service for a fixed number of requests.

Each child runs ``for_mlx`` over its own random-weight llama, with a disk tier under the shared
root, RAM for a few prompts (so publishes spill and restores read files), and checks every reuse
against a fresh prefill. The parent samples both model directories as the file system counts them
while the children run. Then:

- neither directory ever holds more than its service's ``disk_bytes``;
- no child restored wrong state or saw an exception other than a named ``KvStateError``;
- every prefix a child's service held on disk after its final ``flush()`` is found again by a
  restarted service.

And one model directory has one live service: a second, in this process or another, is refused
with :class:`~kvstate.interpreters.mlx.disk_store.DirectoryInUse` until the first is closed or killed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvstate import KvCacheService
from kvstate.interpreters.mlx.disk_budget import directory_bytes
from kvstate.models.reference import build

DISK_BYTES = 96 << 10
REQUESTS = 60

CHILD = textwrap.dedent("""
    import json, random, sys
    import mlx.core as mx
    from kvstate import KvCacheService, KvStateError, Request
    from kvstate.models.reference import build

    root, seed, count, disk_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    model, config = build("llama", seed=seed)
    service = KvCacheService.for_mlx(model, config=config, name=f"model-{seed}", ram_bytes=24 << 10,
                                     disk_dir=root, disk_bytes=disk_bytes)
    print(service.interpreter.store.directory, flush=True)

    def prefilled(tokens):
        caches = model.make_cache()
        model(mx.array([list(tokens)]), cache=caches)
        return [(c.keys[..., :len(tokens), :].tolist(), c.values[..., :len(tokens), :].tolist()) for c in caches]

    rng, wrong, errors, restores = random.Random(seed), 0, 0, 0
    families = [tuple(range(10 * f + 1, 10 * f + 13)) for f in range(6)]
    for n in range(count):
        prompt = rng.choice(families) + tuple(rng.randrange(100, 104) for _ in range(rng.randrange(1, 6)))
        request = Request(prompt, 2)
        try:
            state = service.acquire(request, "n")
            reused = state.reused_tokens
            restores += state.source.value == "disk"
            if reused:
                got = [(c.keys[..., :reused, :].tolist(), c.values[..., :reused, :].tolist()) for c in state.caches]
                wrong += got != prefilled(prompt[:reused])
            model(mx.array([list(prompt[reused:])]), cache=state.caches)
            service.publish(request, "n", prompt, state.caches)
        except KvStateError:
            errors += 1
        finally:
            service.release(request)
        if n % 7 == 0:
            service.boundary()
    service.flush()
    saved = sorted(list(tokens) for _, tokens in service.saved_prefixes())
    report = service.report()
    service.close()
    print(json.dumps({"wrong": wrong, "errors": errors, "restores": restores, "saved": saved,
                      "spills": report.spills}), flush=True)
""")


def test_two_models_under_one_root_keep_their_budgets_and_lose_nothing_durable(tmp_path):
    root = tmp_path / "root"
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(seed), str(REQUESTS),
                                  str(DISK_BYTES)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for seed in (91, 92)]
    directories = []
    for child in children:
        line = child.stdout.readline().strip()
        assert line, f"a child did not start: {child.stderr.read()}"
        directories.append(Path(line))
    peaks, samples = [0, 0], 0
    while any(child.poll() is None for child in children):
        for n, directory in enumerate(directories):
            try:
                peaks[n] = max(peaks[n], directory_bytes(directory))
            except FileNotFoundError:
                pass  # a file deleted while counted: the next sample counts again
        samples += 1
        time.sleep(0.01)
    results = []
    for child in children:
        # Read through the same buffered pipes as the first line: communicate() reads the raw pipe and
        # would miss a last line that readline() had already buffered (a child that ended quickly).
        out, err = child.stdout.read(), child.stderr.read()
        child.wait(timeout=120)
        assert child.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert samples > 5
    assert all(peak <= DISK_BYTES for peak in peaks), (peaks, DISK_BYTES)
    for result in results:
        assert result["wrong"] == 0 and result["errors"] == 0
        assert result["spills"] > 0 and result["restores"] > 0 and result["saved"]
    for seed, result in zip((91, 92), results):  # a restart finds every file the closed service held
        model, config = build("llama", seed=seed)
        with KvCacheService.for_mlx(model, config=config, name=f"model-{seed}", ram_bytes=24 << 10,
                                    disk_dir=str(root), disk_bytes=DISK_BYTES) as again:
            found = sorted(list(tokens) for _, tokens in again.saved_prefixes())
        assert found == result["saved"]


HOLDER = textwrap.dedent("""
    import sys
    from kvstate import KvCacheService
    from kvstate.models.reference import build
    model, config = build("llama", seed=93)
    service = KvCacheService.for_mlx(model, config=config, name="m", ram_bytes=1 << 20, disk_dir=sys.argv[1],
                                     disk_bytes=1 << 20)
    print("live", flush=True)
    sys.stdin.readline()
""")


def test_one_live_service_per_model_directory_a_second_is_refused_until_the_first_is_gone(tmp_path):
    import signal

    from kvstate.interpreters.mlx.disk_store import DirectoryInUse

    model, config = build("llama", seed=93)

    def start():
        return KvCacheService.for_mlx(model, config=config, name="m", ram_bytes=1 << 20, disk_dir=str(tmp_path),
                                      disk_bytes=1 << 20)
    first = start()
    with pytest.raises(DirectoryInUse, match="another live service"):
        start()
    assert first.report().saved_capacity_bytes == 1 << 20  # the first is untouched
    first.close()
    start().close()                                          # once it is closed, a new one starts

    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "live", holder.stderr.read()
        with pytest.raises(DirectoryInUse):
            start()
    finally:
        holder.send_signal(signal.SIGKILL)                   # a crash: the kernel lets go of its claim
        holder.wait(timeout=60)
    start().close()
