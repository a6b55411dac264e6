"""``kvstate serve`` against stock ``mlx_lm.server``: the same workloads, the same model directory, one run.

Each workload runs against a fresh server of each kind, started as a process on localhost, warmed
up with a short request of its own (twice: a miss, then a hit), and driven over HTTP with streamed chat completions (time to
first token is the time to the first content chunk). Stock gets ``--prompt-cache-bytes`` equal to kvstate's ``--ram-bytes`` and a
``--prompt-cache-size`` that never binds, so both hold the same RAM.

- ``chat``: S sessions of T turns, C sessions at a time; each turn adds the reply and a new user
  message (a session's first message opens with a document of ``--document-words`` words, if
  given: long conversations of short turns). Everything fits in RAM.
- ``agent``: one conversation of T steps, each appending a tool result to it.
- ``overflow``: the chat workload, round-robin over sessions, with RAM a quarter of the working set;
  kvstate has a disk tier behind it.
- ``restart``: ``--restart-turns`` turns of every session (default one less than ``--turns``), a
  server restart, then each session's next turn (the figures are of the turns after the restart);
  kvstate keeps a disk tier across the restart.
- ``edit``: S sessions each ask a long question, ask it again with its last words edited, and
  regenerate that answer (timed: the edit and the regenerate); with ``--architecture qwen3_next``
  this is what kvstate's chunk snapshots are for.
- ``burst``: S requests at once sharing a long system prompt nothing holds yet, each with its own
  question: how much of the shared prompt the later ones reuse while the first computes it.
- ``resume``: one generation of ``--resume-tokens`` tokens with an ``Idempotency-Key``, the server
  killed (SIGKILL) ``--kill-at`` of the way through (kvstate once its checkpoint nearest there is
  written, stock as long after its request), restarted, and the request sent again:
  the time from the first request to the retry's last token (restart included), for kvstate with
  ``--checkpoint-every`` (which resumes) and stock (which starts again), and kvstate's uninterrupted
  run of the same request; with whether the resumed text equals the uninterrupted one.

Each kind keeps the kernels compiled on first use in a folder of its own (``--jit-cache``): MLX's
own kernels, and on CUDA the driver's compute cache, where the kernels cuDNN builds for each new
attention shape end up. Both are kept on disk and a later process loads them instead of
compiling, so with one shared folder the server that runs second would be timed on kernels the
first compiled (on the H200 that made every first use of an attention shape look like a
kvstate stall of 0.4-0.9 s).

Prints, per workload and server, TTFT p50 and p99, output tokens per second and the cached prompt
tokens the server reported, then kvstate's figures as ratios of stock's, and the kernels each kind
compiled (those only one of them needed by name).

    python bench/serve.py [--geometry small|1b|8b] [--workloads chat,agent,overflow,restart]
    python bench/serve.py --workloads agent --rounds 4   # ABBA: each kind first half the time
    python bench/serve.py --workloads overflow,restart --document-words 400 --user-words 60
    python bench/serve.py --workloads resume [--resume-tokens 2000 --kill-at 1500 --checkpoint-every 256]
    python bench/serve.py --architecture qwen3_next --workloads edit --prefill-step-size 256 --snapshot-every 256
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

GEOMETRIES = {
    # a small llama, fast on a CPU, big enough that prefill dominates HTTP
    "small": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32),
    # the geometry of Llama 3.2 1B (16 layers, 2048 wide, 8 KV heads of 64), random weights, bf16
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    # the geometry of Llama 3.1 8B with its real context (prompts of 4,000-16,000 tokens fit)
    "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, max_position_embeddings=131072),
}
#: The same sizes for the hybrid reference (qwen3_next: gated-delta recurrent layers beside attention).
HYBRID_GEOMETRIES = {
    "small": dict(hidden_size=256, num_hidden_layers=8, intermediate_size=512, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, linear_num_value_heads=8, linear_num_key_heads=4,
                  linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=128,
                  shared_expert_intermediate_size=256, max_position_embeddings=32768),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=16,
               num_key_value_heads=2, head_dim=128, linear_num_value_heads=32, linear_num_key_heads=16,
               linear_key_head_dim=128, linear_value_head_dim=128, moe_intermediate_size=512,
               shared_expert_intermediate_size=512, max_position_embeddings=32768),
}
SYSTEM = ("You are a helpful assistant. Answer briefly and clearly. " * 12).strip()
WORDS = "the quick brown fox jumps over the lazy dog near the river bank and tells me about the weather".split()


def text(n_words: int, salt: int) -> str:
    return " ".join(WORDS[(salt * 7 + i) % len(WORDS)] for i in range(n_words))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def jit_environment(jit_cache: Path, kind: str) -> dict[str, str]:
    """The environment of a ``kind`` server whose kernels compiled on first use go to
    ``jit_cache/kind``: MLX's CUDA PTX (``MLX_PTX_CACHE_DIR``), its CPU shared libraries (under the
    temporary directory) and the CUDA driver's compute cache (``CUDA_CACHE_PATH``, where cuDNN's
    runtime-compiled attention kernels are kept). A later process loads them instead of compiling;
    one folder per kind, so neither server is timed on kernels the other compiled."""
    folder = jit_cache / kind
    for part in ("ptx", "tmp", "cuda"):
        (folder / part).mkdir(parents=True, exist_ok=True)
    return {**os.environ, "MLX_PTX_CACHE_DIR": str(folder / "ptx"), "TMPDIR": str(folder / "tmp"),
            "CUDA_CACHE_PATH": str(folder / "cuda")}


def compiled_kernels(folder: Path) -> list[str]:
    """The kernels a server kind compiled on first use: MLX's CUDA modules and CPU shared libraries
    by name, and the files of the CUDA driver's compute cache (named by hash)."""
    return sorted(str(path.relative_to(folder)) for pattern in ("ptx/**/*.ptx", "tmp/mlx/**/*.so", "cuda/**/*")
                  for path in folder.glob(pattern) if path.is_file())


class RequestFailed(SystemExit):
    """A request the server did not serve (any answer but 200): the run stops, since a refusal that
    came back fast would count as a fast answer."""


class Server:
    #: Flags both kinds get (``--prefill-step-size``), and kvstate's own (``--snapshot-every``).
    both_flags: list[str] = []
    kvstate_flags: list[str] = []

    def __init__(self, kind: str, model: Path, ram_bytes: int, disk: Path | None, log: Path, jit_cache: Path,
                 extra: list[str] | None = None):
        self.port = free_port()
        if kind == "kvstate":
            command = [sys.executable, "-m", "kvstate.interpreters.cli", "serve", "--ram-bytes", str(ram_bytes)]
            if disk is not None:
                command += ["--disk-dir", str(disk), "--disk-bytes", str(64 * ram_bytes)]
        else:
            command = [sys.executable, "-m", "mlx_lm", "server", "--prompt-cache-bytes", str(ram_bytes),
                       "--prompt-cache-size", "100000"]
        command += Server.both_flags + (Server.kvstate_flags if kind == "kvstate" else []) + (extra or [])
        self.process = subprocess.Popen([*command, "--model", str(model), "--port", str(self.port)],
                                        stdout=open(log, "a"), stderr=subprocess.STDOUT,
                                        env=jit_environment(jit_cache, kind))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                if self.process.poll() is not None:
                    break
                time.sleep(0.3)
        raise SystemExit(f"the {kind} server did not start; see {log}")

    def warm_up(self, batch: int = 0, words: int = 150) -> None:
        """A short request of its own, twice (a miss, then a hit), before anything is timed: kernels
        compiled on first use are not in the figures. With ``batch``, then ``batch`` requests of
        ``words`` words at once, so the shapes of a concurrent round are compiled too."""
        for _ in range(2):
            self.chat([{"role": "system", "content": "warm up"}, {"role": "user", "content": "hello"}], 4)
        if batch:
            with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                list(pool.map(lambda n: self.chat([{"role": "system", "content": "warm up"},
                                                   {"role": "user", "content": text(words, 10_000 + n)}], 4),
                              range(batch)))

    def chat(self, messages: list[dict], max_tokens: int, headers: dict | None = None) -> dict:
        """One streamed chat completion: TTFT, tokens out, seconds, cached tokens, the reply."""
        body = json.dumps({"model": "default_model", "messages": messages, "max_tokens": max_tokens,
                           "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}})
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json",
                                                                  **(headers or {})})
        response = connection.getresponse()
        if response.status != 200:  # a refusal is no figure: the run fails, saying why
            raise RequestFailed(f"the server answered {response.status}: {response.read()[:500].decode(errors='replace')}")
        first, pieces, usage = None, [], {}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    pieces.append(content)
            usage = chunk.get("usage") or usage
        end = time.perf_counter()
        connection.close()
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"ttft": (first or end) - start, "tokens": usage.get("completion_tokens", 0), "seconds": end - start,
                "cached": cached, "prompt": usage.get("prompt_tokens", 0), "reply": "".join(pieces)}

    def written_checkpoints(self) -> float:
        """kvstate's ``kvstate_checkpoints_written_total`` now (0 where the server does not answer it)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as reply:
                for line in reply.read().decode().splitlines():
                    if line.startswith("kvstate_checkpoints_written_total "):
                        return float(line.split()[1])
        except OSError:
            pass
        return 0.0

    def kill_when(self, due) -> threading.Thread:
        """Kill the server (SIGKILL) as soon as ``due()`` holds, polled every 10 ms on a thread of its own
        (the generation runs ahead of the stream the client reads)."""
        def watch() -> None:
            while self.process.poll() is None:
                if due():
                    self.process.kill()
                    return
                time.sleep(0.01)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        return watcher

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()


def conversation_turns(server: Server, sessions: int, turns: int, concurrency: int, user_words: int,
                       max_tokens: int, round_robin: bool = False, skip: int = 0, histories=None,
                       document_words: int = 0) -> list[dict]:
    """Run ``turns`` turns of ``sessions`` chats; the records of turns from ``skip`` on. A session's
    first message opens with a document of ``document_words`` words of its own."""
    histories = histories if histories is not None else [[{"role": "system", "content": SYSTEM}]
                                                         for _ in range(sessions)]
    records: list[dict] = []

    def turn(s: int, t: int) -> dict:
        history = histories[s]
        message = text(user_words, s * 100 + t)
        if document_words and len(history) == 1:  # the session's first message: its document, then it
            message = text(document_words, 10_000 + s) + "\n\n" + message
        history.append({"role": "user", "content": message})
        result = server.chat(history, max_tokens)
        history.append({"role": "assistant", "content": result["reply"]})
        return result
    if round_robin:  # every session's turn t before any session's turn t + 1: the working set cycles
        for t in range(turns):
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                done = list(pool.map(lambda s: turn(s, t), range(sessions)))
            if t >= skip:
                records += done
        return records

    def whole(s: int) -> list[dict]:
        return [turn(s, t) for t in range(turns)]
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for session in pool.map(whole, range(sessions)):
            records += session[skip:]
    return records


def agent_steps(server: Server, steps: int, tool_words: int, max_tokens: int) -> list[dict]:
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text(40, 1)}]
    records = []
    for step in range(steps):
        result = server.chat(history, max_tokens)
        records.append(result)
        history += [{"role": "assistant", "content": result["reply"]},
                    {"role": "user", "content": "Tool result: " + text(tool_words, step + 5)}]
    return records


def edits(server: Server, sessions: int, user_words: int, max_tokens: int) -> list[dict]:
    """Each session asks a long question, then asks it again with its last words edited, then
    regenerates that answer: the records of the edit and the regenerate (what reuses a prefix that
    ends inside the last message)."""
    records = []
    for s in range(sessions):
        system = {"role": "system", "content": SYSTEM}
        question = text(user_words, 500 + s)
        server.chat([system, {"role": "user", "content": question + " What follows?"}], max_tokens)
        edited = [system, {"role": "user", "content": question + " Who stays until the night?"}]
        records.append(server.chat(edited, max_tokens))
        records.append(server.chat(edited, max_tokens))  # a regenerate of the edited question
    return records


def summary(records: list[dict]) -> dict:
    ttfts = sorted(r["ttft"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    return {"requests": len(records), "ttft_p50": statistics.median(ttfts), "ttfts": [r["ttft"] for r in records],
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "tok_per_s": tokens / seconds if seconds else 0.0, "cached": sum(r["cached"] for r in records),
            "prompt_tokens": [min(r["prompt"] for r in records), max(r["prompt"] for r in records)]}


def run_workload(name: str, kind: str, model: Path, args, work: Path, round_: int = 0) -> dict:
    """One server of ``kind`` through workload ``name`` (its ``round_``-th run: a log and a disk of its own)."""
    run = f"{kind}-{name}" + (f"-{round_}" if round_ else "")
    log = work / f"{run}.log"
    disk = work / f"disk-{run}" if kind == "kvstate" and name in ("overflow", "restart") else None
    ram = args.ram_bytes
    if name == "overflow":
        ram = args.overflow_ram_bytes
    server = Server(kind, model, ram, disk, log, args.jit_cache)
    server.warm_up(args.warm_up_batch, args.user_words)
    try:
        if name == "chat":
            records = conversation_turns(server, args.sessions, args.turns, args.concurrency, args.user_words,
                                         args.max_tokens, document_words=args.document_words)
        elif name == "agent":
            records = agent_steps(server, args.turns * 2, args.tool_words, args.max_tokens)
        elif name == "overflow":
            records = conversation_turns(server, args.sessions * 2, args.turns, args.concurrency, args.user_words,
                                         args.max_tokens, round_robin=True, skip=1,
                                         document_words=args.document_words)
        elif name == "edit":
            records = edits(server, args.sessions, args.user_words, args.max_tokens)
        elif name == "burst":
            shared = {"role": "system", "content": " ".join([SYSTEM] * 4)}
            prompts = [[shared, {"role": "user", "content": text(20, n)}] for n in range(args.sessions)]
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                records = list(pool.map(lambda messages: server.chat(messages, args.max_tokens), prompts))
        else:  # restart
            histories = [[{"role": "system", "content": SYSTEM}] for _ in range(args.sessions)]
            before = args.restart_turns if args.restart_turns is not None else max(1, args.turns - 1)
            conversation_turns(server, args.sessions, before, args.concurrency, args.user_words, args.max_tokens,
                               histories=histories, document_words=args.document_words)
            server.stop()
            server = Server(kind, model, ram, disk, log, args.jit_cache)
            server.warm_up(args.warm_up_batch, args.user_words)
            records = conversation_turns(server, args.sessions, 1, args.concurrency, args.user_words,
                                         args.max_tokens, histories=histories)
    finally:
        server.stop()
    return summary(records)


def run_rounds(name: str, model: Path, args, work: Path) -> tuple[dict, list[float]]:
    """Workload ``name`` on ``--rounds`` servers of each kind, the kind that runs first alternating
    (a host's drift, or a page cache the first server warmed, favours neither): each kind's figures
    as the median of its rounds, and each round's TTFT p50 ratio."""
    runs: dict[str, list[dict]] = {"kvstate": [], "stock": []}
    for round_ in range(args.rounds):
        order = ("kvstate", "stock") if round_ % 2 == 0 else ("stock", "kvstate")
        for kind in order:
            runs[kind].append(run_workload(name, kind, model, args, work, round_))
    ratios = [ours["ttft_p50"] / theirs["ttft_p50"] for ours, theirs in zip(runs["kvstate"], runs["stock"])]
    return {kind: _median_row(rows) for kind, rows in runs.items()}, ratios


def _median_row(rows: list[dict]) -> dict:
    """Each figure of ``rows`` (one a round) as its median over the rounds (the TTFTs, all of them)."""
    row = {key: statistics.median(row[key] for row in rows) for key in rows[0] if key not in ("ttfts", "prompt_tokens")}
    row["requests"], row["cached"] = round(row["requests"]), round(row["cached"])
    row["ttfts"] = [ttft for each in rows for ttft in each["ttfts"]]
    row["prompt_tokens"] = [min(each["prompt_tokens"][0] for each in rows), max(each["prompt_tokens"][1] for each in rows)]
    return row


def resume_run(kind: str, model: Path, args, work: Path, kill_after: float | None = None,
               uninterrupted: bool = False) -> dict:
    """One long generation with a client key, run once uninterrupted, or killed, restarted and sent
    again: kvstate once the checkpoint nearest ``--kill-at`` of the way is written, stock
    ``kill_after`` seconds after the request (when kvstate was killed). Seconds from the first
    request to the last token, the restart's share, the retry's, and the text."""
    log = work / f"{kind}-resume.log"
    disk = work / f"disk-{kind}-resume-{uninterrupted}" if kind == "kvstate" else None
    extra = ["--checkpoint-every", str(args.checkpoint_every)] if kind == "kvstate" else []
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text(args.user_words, 7)}]
    headers = {"Idempotency-Key": f"bench-resume-{kind}"}
    server = Server(kind, model, args.ram_bytes, disk, log, args.jit_cache, extra)
    server.warm_up()
    try:
        start = time.perf_counter()
        if uninterrupted:
            reply = server.chat(messages, args.resume_tokens, headers)
            return {"total": time.perf_counter() - start, "restart": 0.0, "retry": 0.0, "reply": reply["reply"],
                    "tokens": reply["tokens"], "seconds": reply["seconds"], "ttft": reply["ttft"]}
        if kind == "kvstate":
            needed = max(1, round(args.kill_at * args.resume_tokens / args.checkpoint_every))
            watcher = server.kill_when(lambda: server.written_checkpoints() >= needed)
        else:
            watcher = server.kill_when(lambda: time.perf_counter() - start >= kill_after)
        try:
            server.chat(messages, args.resume_tokens, headers)
        except (OSError, http.client.HTTPException):
            pass  # the connection went with the server
        watcher.join()
        killed = time.perf_counter() - start
        restarted = time.perf_counter()
        server = Server(kind, model, args.ram_bytes, disk, log, args.jit_cache, extra)
        retried = time.perf_counter()
        reply = server.chat(messages, args.resume_tokens, headers)
        end = time.perf_counter()
        resumed = re.findall(r"resumed after (\d+) tokens", log.read_text()) if kind == "kvstate" else []
        return {"total": end - start, "restart": retried - restarted, "retry": end - retried, "reply": reply["reply"],
                "tokens": reply["tokens"], "killed_at": killed, "resumed_after": int(resumed[-1]) if resumed else 0}
    finally:
        server.stop()


def print_resume(rows: dict) -> None:
    resumed, stock, whole = rows["kvstate"], rows["stock"], rows["uninterrupted"]
    print(f"{'resume':10}{'run':24}{'total s':>9}{'restart s':>11}{'retry s':>9}{'tokens':>8}")
    for name, row in (("kvstate, resumed", resumed), ("stock, started again", stock),
                      ("kvstate, uninterrupted", whole)):
        print(f"{'':10}{name:24}{row['total']:>9.2f}{row['restart']:>11.2f}{row['retry']:>9.2f}{row['tokens']:>8}")
    print(f"{'':10}kvstate killed {resumed['killed_at']:.2f} s after its request, once its checkpoint near "
          f"{resumed['resumed_after']} tokens was written (stock as long after its own), and resumed after "
          f"{resumed['resumed_after']} tokens")
    print(f"{'':10}{'ratio':24}kvstate resumed / stock {resumed['total'] / stock['total']:.2f}x, / uninterrupted "
          f"{resumed['total'] / whole['total']:.2f}x; retry alone / stock's {resumed['retry'] / stock['retry']:.2f}x; "
          f"resumed text equals the uninterrupted text: {'yes' if resumed['reply'] == whole['reply'] else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="small",
                        help="small (CPU), or the Llama 3.2 1B or Llama 3.1 8B geometry, random weights in bf16")
    parser.add_argument("--workloads", default="chat,agent,overflow,restart,burst")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--warm-up-batch", type=int, default=0,
                        help="after the warm-up requests, this many at once (0: none), on both servers")
    parser.add_argument("--resume-tokens", type=int, default=2000, help="the resume workload's generation")
    parser.add_argument("--kill-at", type=float, default=0.75,
                        help="how far through the generation kvstate is killed: once its checkpoint nearest "
                             "this share of --resume-tokens is written (stock as long after its request)")
    parser.add_argument("--checkpoint-every", type=int, default=256, help="kvstate's --checkpoint-every")
    parser.add_argument("--restart-turns", type=int, default=None,
                        help="turns of each session before the restart (default: --turns minus one)")
    parser.add_argument("--user-words", type=int, default=150)
    parser.add_argument("--document-words", type=int, default=0,
                        help="a document of this many words opens each chat session (long context, short turns)")
    parser.add_argument("--tool-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ram-bytes", type=int, default=4 << 30)
    parser.add_argument("--overflow-ram-bytes", type=int, default=None,
                        help="RAM for the overflow workload (default: a quarter of its working set)")
    parser.add_argument("--architecture", default="llama", choices=["llama", "qwen3_next"],
                        help="the reference architecture (qwen3_next: recurrent layers beside attention)")
    parser.add_argument("--prefill-step-size", type=int, default=None,
                        help="both servers' prefill chunk (default: mlx-lm's)")
    parser.add_argument("--snapshot-every", type=int, default=None,
                        help="kvstate's chunk snapshots of a hybrid model (default: kvstate's)")
    parser.add_argument("--kvstate-flags", default="",
                        help="more flags for kvstate's server, as one string (e.g. \"--block-tokens 0\": whole prompts)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run each workload this many times a kind, the first server alternating "
                             "(kvstate, stock, stock, kvstate, ...): each kind's figures are the median "
                             "of its rounds, and each round's TTFT p50 ratio is printed")
    parser.add_argument("--json", default=None, help="write the figures here too")
    parser.add_argument("--logs", default=None, help="keep the servers' logs in this directory")
    parser.add_argument("--jit-cache", type=Path, default=None,
                        help="keep each kind's compiled MLX kernels in DIR/kvstate and DIR/stock, across runs "
                             "(default: empty folders for this run, so each kind compiles its own once)")
    args = parser.parse_args()
    if args.architecture != "llama" and args.geometry not in HYBRID_GEOMETRIES:
        parser.error(f"--architecture {args.architecture} has the geometries {sorted(HYBRID_GEOMETRIES)}")

    import mlx.core as mx

    from kvstate.models.model_dir import save_model_dir
    from kvstate.models.reference import build

    work = Path(tempfile.mkdtemp(prefix="kvstate-bench-serve-"))
    args.jit_cache = (args.jit_cache or work / "jit").resolve()
    dtype = mx.float32 if args.geometry == "small" else mx.bfloat16
    geometry = GEOMETRIES[args.geometry] if args.architecture == "llama" else HYBRID_GEOMETRIES[args.geometry]
    model_dir = save_model_dir(work / "model", args.architecture, seed=1, dtype=dtype, **geometry)
    if args.prefill_step_size is not None:
        Server.both_flags = ["--prefill-step-size", str(args.prefill_step_size)]
    if args.snapshot_every is not None:
        Server.kvstate_flags = ["--snapshot-every", str(args.snapshot_every)]
    Server.kvstate_flags += args.kvstate_flags.split()
    if args.overflow_ram_bytes is None:
        model, _ = build(args.architecture, vocab_size=512, dtype=dtype, **geometry)
        from kvstate.models.mlx_adapter import spec_from_model
        per_token = spec_from_model(model, "bench").bytes_for(1000) / 1000
        words_per_session = (len(SYSTEM.split()) + args.document_words
                             + args.turns * (args.user_words + args.max_tokens))
        working_set = int(args.sessions * 2 * words_per_session * 1.5 * per_token)  # about 1.5 tokens a word
        args.overflow_ram_bytes = max(1 << 20, working_set // 4)
    rows, round_ratios = {}, {}
    try:
        for name in args.workloads.split(","):
            if name == "resume":
                whole = resume_run("kvstate", model_dir, args, work, uninterrupted=True)
                resumed = resume_run("kvstate", model_dir, args, work)
                rows[name] = {"kvstate": resumed, "uninterrupted": whole,
                              "stock": resume_run("stock", model_dir, args, work, resumed["killed_at"])}
                continue
            rows[name], round_ratios[name] = run_rounds(name, model_dir, args, work)
    except BaseException:
        keep_logs(work, args.logs)  # a failed run's logs say why: keep them where asked, and the folder
        raise
    print(f"geometry {args.geometry}, {mx.default_device()}, sessions {args.sessions}, turns {args.turns}, "
          f"concurrency {args.concurrency}, RAM {args.ram_bytes >> 20} MiB (overflow {args.overflow_ram_bytes >> 20} "
          f"MiB), document {args.document_words} words, user turns {args.user_words} words")
    if any(name != "resume" for name in rows):
        print(f"{'workload':10}{'server':9}{'requests':>9}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'tok/s':>9}"
              f"{'cached':>9}{'prompts (tokens)':>18}")
    for name, kinds in rows.items():
        if name == "resume":
            print_resume(kinds)
            continue
        for kind, row in kinds.items():
            print(f"{name:10}{kind:9}{row['requests']:>9}{row['ttft_p50'] * 1e3:>13.1f}{row['ttft_p99'] * 1e3:>13.1f}"
                  f"{row['tok_per_s']:>9.1f}{row['cached']:>9}{'%d-%d' % tuple(row['prompt_tokens']):>18}")
        ours, stock = kinds["kvstate"], kinds["stock"]
        print(f"{'':10}{'ratio':9}{'':>9}{ours['ttft_p50'] / stock['ttft_p50']:>12.2f}x"
              f"{ours['ttft_p99'] / stock['ttft_p99']:>12.2f}x{ours['tok_per_s'] / max(stock['tok_per_s'], 1e-9):>8.2f}x")
        if len(round_ratios.get(name, ())) > 1:
            print(f"{'':10}{'rounds':9}{'':>9}  TTFT p50 ratio of each: "
                  + ", ".join(f"{ratio:.2f}x" for ratio in round_ratios[name]))
    kernels = {kind: compiled_kernels(args.jit_cache / kind) for kind in ("kvstate", "stock")}
    driver = {kind: sum(name.startswith("cuda/") for name in names) for kind, names in kernels.items()}
    print(f"kernels compiled on first use, kept in {args.jit_cache}: kvstate {len(kernels['kvstate'])} "
          f"({driver['kvstate']} in the CUDA driver's cache), stock {len(kernels['stock'])} ({driver['stock']})")
    for kind, other in (("kvstate", "stock"), ("stock", "kvstate")):
        for name in sorted(set(kernels[kind]) - set(kernels[other])):
            if not name.startswith("cuda/"):  # the driver's files are named by hash: counted, not listed
                print(f"  only {kind}: {name}")
    if args.json:
        rows["compiled_kernels"] = {kind: sorted(names) for kind, names in kernels.items()}
        rows["round_ratios"] = round_ratios
        Path(args.json).write_text(json.dumps(rows, indent=1))
    keep_logs(work, args.logs)
    shutil.rmtree(work, ignore_errors=True)


def keep_logs(work: Path, logs: str | None) -> None:
    """Copy the servers' logs from ``work`` to ``logs`` (nothing without one)."""
    if logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.log"):
            shutil.copy(log, Path(logs) / log.name)


if __name__ == "__main__":
    main()
