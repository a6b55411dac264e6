"""Absolute figures on a GPU: kvstate under MLX's GPU backend (CUDA or Metal), realistic geometries.

Random-weight mlx-lm llamas in bf16 at a Llama-3.2-1B-like and a Llama-3.1-8B-like geometry (the
catalogue's numbers), through the reference scheduler's calls and the service with the disk tier:

- time to first token for 4k, 16k and 32k-token prompts: miss (full prefill), RAM hit, and disk
  hit (state written by an earlier process, read by a fresh one, hashes verified); on CUDA also the
  same disk hit with the restored arrays left in host memory for their first use to pull over
  (``not moved``), as restores did before they moved them to the device in bulk;
- restore bandwidth from disk into GPU memory and spill bandwidth out of it, against a raw read and
  a raw write+fsync of the same bytes in the same run (the raw read is the fastest plain read of the
  file into a buffer allocated once and reused, as in ``bench/disk.py``, page cache warm; ``to device``
  is that buffer's bytes then landed on the device by ``mx.array`` and first use);
- the service's own decision time per request (every ``core.step``) beside the model's decode
  step time, so its overhead shows as a fraction.

On a machine where MLX has no GPU it says so in one line and exits. ``--allow-cpu`` runs the same
code on the CPU with ``--models tiny`` for checking the script itself.

    python bench/gpu.py [--models 1b,8b] [--prompts 4096,16384,32768] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np

from disk import fastest_read, read_whole  # bench/disk.py: the fastest plain read, into a reused buffer

CONFIGS = {
    "tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=256,
                 max_position_embeddings=65536, tie_word_embeddings=True),
    "1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, vocab_size=128256,
               max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0),
    "8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, vocab_size=128256,
               max_position_embeddings=131072, tie_word_embeddings=False, rope_theta=500000.0),
}


def on_cuda() -> bool:
    from kvstate.interpreters.mlx.device_memory import on_cuda
    return on_cuda()


def on_gpu() -> bool:
    return mx.default_device().type == mx.gpu


def build(name: str, seed: int = 0):
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    config = CONFIGS[name]
    model = llama.Model(llama.ModelArgs.from_dict(config))
    key = mx.random.key(seed)
    keys = iter(mx.random.split(key, 4096))
    model.update(tree_map(lambda a: (mx.random.normal(a.shape, key=next(keys)) * 0.02).astype(mx.bfloat16),
                          model.parameters()))
    mx.eval(model.parameters())
    return model, config


class StepClock:
    """Wraps the facade's ``step`` to add up the time the core spends deciding."""

    def __init__(self) -> None:
        import kvstate.interpreters.service as facade
        self.facade, self.original, self.seconds, self.calls = facade, facade.step, 0.0, 0

        def timed(state, event):
            start = time.perf_counter()
            try:
                return self.original(state, event)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        facade.step = timed


def progress(message: str) -> None:
    """One line on stderr as each part finishes, so a run cut short still shows how far it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def fingerprint_once() -> None:
    """Fingerprint the in-process model once per process, as a server does once at start-up.

    Every service built here is for the same model; hashing its weights again for each (seconds at
    8B) would only time the fingerprint, which ``bench/identity.py`` measures on its own.
    """
    import kvstate.interpreters.mlx.interpreter as interpreter
    original, known = interpreter.model_fingerprint, {}

    def once(model, config=None):
        if id(model) not in known:
            known[id(model)] = original(model, config)
        return known[id(model)]
    interpreter.model_fingerprint = once


def service_for(model, config, directory, block_tokens: int | None = None):
    """A service on ``model`` with 64 GiB of RAM and a disk tier in ``directory``; state kept whole, or
    in blocks of ``block_tokens`` (as ``kvstate serve`` keeps it)."""
    from kvstate import KvCacheService
    return KvCacheService.for_mlx(model, config=config, name="bench", ram_bytes=64 << 30, disk_dir=directory,
                                  disk_bytes=512 << 30, block_tokens=block_tokens)


#: Requests whose decisions are timed (each the core steps of its acquire, publish and release, and
#: the completions they bring); the median is reported, so one slow first call does not set it.
DECISION_REQUESTS = 64

VOCAB = 250  # token ids below every model's vocabulary (the tiny one has 256)


def prompt_of(length: int, salt: int = 0) -> tuple[int, ...]:
    return tuple((i * 7919 + salt) % VOCAB + 1 for i in range(length))


def ttft(service, model, prompt) -> tuple[float, int, str]:
    from kvstate import Request
    start = time.perf_counter()
    request = Request(prompt, 16)
    state = service.acquire(request, "bench")
    logits = model(mx.array([list(prompt[state.reused_tokens:])]), cache=state.caches)[0, -1]
    mx.eval(mx.argmax(logits))
    elapsed = time.perf_counter() - start
    service.release(request)
    return elapsed, state.reused_tokens, state.source.value


def prefill(model, caches, tokens, chunk: int = 4096) -> mx.array:
    """Prefill in chunks, as mlx-lm's generate_step does, so long prompts fit activation memory."""
    logits = None
    for start in range(0, len(tokens), chunk):
        logits = model(mx.array([list(tokens[start:start + chunk])]), cache=caches)
        mx.eval(logits)
    return logits[0, -1]


def writer_phase(name: str, lengths: list[int], directory: str, repeat: int) -> dict:
    """This process: misses, RAM hits, spill bandwidth, decision overhead; leaves the disk state behind."""
    from kvstate import Request
    from kvstate.interpreters.mlx import caches as mlx_caches

    model, config = build(name)
    progress(f"write {name}: model built")
    service = service_for(model, config, directory)
    progress(f"write {name}: service built")
    out: dict = {"model": name, "rows": []}
    for length in lengths:
        prompt = prompt_of(length, salt=length)
        misses = []
        for i in range(repeat + 1):  # the first of every kind of run warms kernels up and is not counted
            request = Request((VOCAB + 1 + i,) + prompt[1:], 16)  # shares nothing with what is kept
            start = time.perf_counter()
            state = service.acquire(request, "bench")
            logits = prefill(model, state.caches, request.prompt)
            mx.eval(mx.argmax(logits))
            misses.append(time.perf_counter() - start)
            service.release(request)
        misses = misses[1:]
        progress(f"write {name} {length}: miss {statistics.median(misses) * 1000:.1f} ms")
        request = Request(prompt, 16)
        state = service.acquire(request, "bench")
        prefill(model, state.caches, prompt[state.reused_tokens:])
        nbytes = mlx_caches.live_bytes(state.caches)
        store = service.interpreter.store
        key_caches = state.caches
        spill = []
        for _ in range(repeat):  # encode (device to host, hashes) and atomic commit
            from kvstate.effects import DiskKey
            start = time.perf_counter()
            store.commit(store.encode_prefix(DiskKey("spill-probe", prompt), key_caches, True, nbytes))
            spill.append(time.perf_counter() - start)
        raw = b"\0" * nbytes
        raw_write = []
        for _ in range(repeat):
            start = time.perf_counter()
            with open(os.path.join(directory, "raw.bin"), "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            raw_write.append(time.perf_counter() - start)
        service.publish(request, "bench", prompt, state.caches)
        service.release(request)
        hits = []
        for i in range(repeat + 1):
            elapsed, reused, source = ttft(service, model, prompt + (5 + i,))
            assert (reused, source) == (length, "ram"), (reused, source)
            hits.append(elapsed)
        hits = hits[1:]
        progress(f"write {name} {length}: RAM hit {statistics.median(hits) * 1000:.1f} ms, "
                 f"spill {nbytes / statistics.median(spill) / 1e9:.2f} GB/s")
        out["rows"].append({"tokens": length, "bytes": nbytes, "miss_s": statistics.median(misses),
                            "ram_hit_s": statistics.median(hits), "spill_s": statistics.median(spill),
                            "raw_write_s": statistics.median(raw_write)})
    # decision time beside the model's step time
    clock = StepClock()
    decode = []
    prompt = prompt_of(512, salt=3)
    per_request = []
    for i in range(DECISION_REQUESTS):
        before = clock.seconds
        request = Request(prompt + (i + 1,), 16)
        state = service.acquire(request, "bench")
        logits = prefill(model, state.caches, request.prompt[state.reused_tokens:])
        token = int(mx.argmax(logits).item())
        start = time.perf_counter()
        mx.eval(model(mx.array([[token]]), cache=state.caches))
        decode.append(time.perf_counter() - start)
        service.publish(request, "bench", request.prompt + (token,), state.caches)
        service.release(request)
        per_request.append(clock.seconds - before)
    out["decision_s_per_request"] = statistics.median(per_request)
    out["decision_s_mean"] = statistics.fmean(per_request)
    out["core_steps"] = clock.calls
    out["decode_step_s"] = statistics.median(decode)
    progress(f"write {name}: decisions {out['decision_s_per_request'] * 1e6:.0f} µs per request")
    assert service.close().durable
    return out


def reader_phase(name: str, lengths: list[int], directory: str, repeat: int) -> dict:
    """A fresh process: disk hits and restore bandwidth from the files the writer left."""
    model, config = build(name)
    progress(f"read {name}: model built")
    out: dict = {"rows": []}
    for length in lengths:
        prompt = prompt_of(length, salt=length)
        hits, unmoved, restores, raw_reads, to_device, buffer = [], [], [], [], [], None
        for i in range(repeat + 1):
            # The same disk hit with the restored arrays left in host memory for their first use to pull
            # over (as before restores moved them to the device in bulk), in the same round.
            if on_cuda():
                service = service_for(model, config, directory)
                service.interpreter.store.to_device = False
                mx.eval(model(mx.array([[1]]))[0, -1])
                elapsed, reused, source = ttft(service, model, prompt + (150 + i,))
                assert (reused, source) == (length, "disk"), (reused, source)
                unmoved.append(elapsed)
                service.close()
            service = service_for(model, config, directory)  # RAM empty: the state comes from disk
            # Building a service for a model loaded in process fingerprints every weight on the host,
            # which leaves them in host memory; the first forward after it would pull them back (about
            # 1 s at 8B on an H200). A model served from its directory is identified by its files and
            # pays none of this, so the weights are brought back before the disk hit is timed.
            mx.eval(model(mx.array([[1]]))[0, -1])
            elapsed, reused, source = ttft(service, model, prompt + (50 + i,))
            assert (reused, source) == (length, "disk"), (reused, source)
            hits.append(elapsed)
            store = service.interpreter.store
            from kvstate.effects import DiskKey
            from kvstate.interpreters.mlx import caches as mlx_caches
            start = time.perf_counter()
            caches = store.read_prefix(DiskKey("bench", prompt))
            mx.eval(mlx_caches.arrays_of(caches))
            restores.append(time.perf_counter() - start)
            path = str(store.prefix_path(DiskKey("bench", prompt)))
            if buffer is None or len(buffer) != os.path.getsize(path):
                buffer = np.empty(os.path.getsize(path), dtype=np.uint8)  # allocated once, reused
                read_whole(path, buffer)  # its pages faulted in before any read is timed
            raw_reads.append(fastest_read(path, buffer))
            start = time.perf_counter()
            piece = 1 << 30  # MLX shapes are 32-bit: land the same bytes on the device in 1 GiB pieces
            mx.eval([mx.array(buffer[i:i + piece]) for i in range(0, len(buffer), piece)])
            to_device.append(time.perf_counter() - start)
            service.close()
            progress(f"read {name} {length}: disk hit {hits[-1] * 1000:.1f} ms"
                     + (f", not moved {unmoved[-1] * 1000:.1f} ms" if unmoved else "")
                     + f", restore {restores[-1] * 1000:.1f} ms, raw read {raw_reads[-1] * 1000:.1f} ms"
                     + f", its bytes to the device {to_device[-1] * 1000:.1f} ms")
        out["rows"].append({"tokens": length, "disk_hit_s": statistics.median(hits[1:]),
                            "disk_hit_unmoved_s": statistics.median(unmoved[1:]) if unmoved else None,
                            "restore_s": statistics.median(restores[1:]),
                            "raw_read_s": statistics.median(raw_reads[1:]),
                            "raw_to_device_s": statistics.median(to_device[1:])})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1b,8b")
    parser.add_argument("--prompts", default="4096,16384,32768")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the figures as JSON into this folder")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU anyway (to check the script)")
    parser.add_argument("--phase", choices=["write", "read"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not on_gpu() and not args.allow_cpu:
        print(f"bench/gpu.py: MLX has no GPU here (default device {mx.default_device()}); "
              f"run it where MLX has a GPU (CUDA or Metal)")
        return
    lengths = [int(n) for n in args.prompts.split(",")]
    if args.phase:
        fingerprint_once()
        run = writer_phase if args.phase == "write" else reader_phase
        print(json.dumps(run(args.models, lengths, args.dir, args.repeat)))
        return
    results = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="kvstate-gpu-") as directory:
            def phase(which: str) -> dict:
                child = subprocess.run([sys.executable, __file__, "--phase", which, "--models", name, "--prompts",
                                        args.prompts, "--repeat", str(args.repeat), "--dir", directory]
                                       + (["--allow-cpu"] if args.allow_cpu else []),
                                       stdout=subprocess.PIPE, text=True)  # stderr: the progress lines
                if child.returncode != 0:
                    raise SystemExit(f"{which} phase of {name} failed (its stderr is above)")
                return json.loads(child.stdout.strip().splitlines()[-1])
            written, read = phase("write"), phase("read")
        for w, r in zip(written["rows"], read["rows"]):
            w.update(r)
        results.append(written)
        if args.out:  # each model's figures as soon as they are in, so a run cut short keeps them
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu.json"), "w") as f:
                json.dump(results, f, indent=1)
        print(f"\n{name}: {mx.default_device()}, bf16 random weights; decode step "
              f"{written['decode_step_s'] * 1000:.2f} ms, service decisions {written['decision_s_per_request'] * 1e6:.0f}"
              f" µs per request, median of {DECISION_REQUESTS} (mean {written['decision_s_mean'] * 1e6:.0f}; "
              f"{written['decision_s_per_request'] / written['decode_step_s']:.2%} of one step)")
        print(f"{'prompt':>7} {'KV MB':>8} {'miss ms':>9} {'RAM hit ms':>11} {'disk hit ms':>12} {'not moved':>10} "
              f"{'restore GB/s':>13} {'raw read GB/s':>14} {'to device GB/s':>15} {'spill GB/s':>11} {'raw write GB/s':>15}")
        for row in written["rows"]:
            gb = row["bytes"] / 1e9
            print(f"{row['tokens']:>7} {row['bytes'] / 1e6:>8.0f} {row['miss_s'] * 1000:>9.1f} "
                  f"{row['ram_hit_s'] * 1000:>11.2f} {row['disk_hit_s'] * 1000:>12.2f} "
                  f"{(row['disk_hit_unmoved_s'] or float('nan')) * 1000:>10.2f} "
                  f"{gb / row['restore_s']:>13.2f} {gb / row['raw_read_s']:>14.2f} {gb / row['raw_to_device_s']:>15.2f} "
                  f"{gb / row['spill_s']:>11.2f} "
                  f"{gb / row['raw_write_s']:>15.2f}")


if __name__ == "__main__":
    main()
