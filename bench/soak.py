"""A soak of ``kvstate serve`` with kills: concurrent ``openai`` clients for minutes, the server killed
(SIGKILL) at random moments and restarted on the same directory, every answer checked.

The workload: conversations of several turns, each sent by three tenants (``cache_salt``) with the
same messages, so a state that crossed tenants would show. Every turn's messages carry the reference
replies of the turns before, so every prompt is known in advance, and each turn's reference reply
is stock ``mlx_lm.server``'s greedy answer, computed first on a server of its own. Half the requests
carry an ``Idempotency-Key`` (the server runs with ``--checkpoint-every``): a request cut by a kill
is sent again with the same key once the server is back, and resumes from its checkpoint.

Checked and reported:

- wrong answers: a reply whose text is not the reference's (goal 0);
- cross-tenant hits: a reply whose cached tokens exceed the longest prefix its own tenant has sent
  before (prompt and reply, tokenized) (goal 0);
- durable state lost: saved files a restart rejected (goal 0: a killed writer leaves a temp file,
  never a damaged file under a real name);
- temp files left after the last, clean stop (goal 0);
- requests served, requests cut by a kill and sent again, resumes, kills survived.

    python bench/soak.py [--minutes 3] [--clients 6] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

TENANTS = ("tenant-a", "tenant-b", "tenant-c")
TOPICS = ("the sea", "a mountain", "the city at night", "an old library", "a river journey", "a garden",
          "the desert", "a winter market")
MAX_TOKENS = 24


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A server process on a free port; ``kvstate serve`` or stock ``mlx_lm.server``."""

    def __init__(self, command: list[str], log: Path):
        import openai

        self.port = free_port()
        self.process = subprocess.Popen([*command, "--port", str(self.port)], stdout=open(log, "a"),
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    break
            except OSError:
                if self.process.poll() is not None:
                    raise SystemExit(f"the server did not start; see {log}")
                time.sleep(0.2)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0,
                                    timeout=120)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=120)


def conversations(turns: int) -> list[list[str]]:
    """Each conversation's user messages."""
    return [[f"Tell me about {topic}." if t == 0 else f"And what comes after that, part {t}?"
             for t in range(turns)] for topic in TOPICS]


def messages_of(users: list[str], replies: list[str], turn: int) -> list[dict]:
    """The messages of turn ``turn``: every earlier user message with its reference reply, then this one."""
    out = [{"role": "system", "content": "You are a storyteller. Answer briefly."}]
    for t in range(turn):
        out += [{"role": "user", "content": users[t]}, {"role": "assistant", "content": replies[t]}]
    return out + [{"role": "user", "content": users[turn]}]


def ask(server: Server, messages: list[dict], tenant: str, key: str | None = None):
    extra = {"extra_headers": {"Idempotency-Key": key}} if key else {}
    reply = server.client.chat.completions.create(model="default_model", messages=messages, max_tokens=MAX_TOKENS,
                                                  temperature=0.0, extra_body={"cache_salt": tenant}, **extra)
    cached = getattr(reply.usage.prompt_tokens_details, "cached_tokens", 0) or 0
    return reply.choices[0].message.content, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kill-every", type=float, default=8.0, help="mean seconds between kills")
    args = parser.parse_args()

    import openai
    from mlx_lm import load

    from kvstate.core.tokens import common_prefix
    from kvstate.models.model_dir import save_model_dir

    work = Path(tempfile.mkdtemp(prefix="kvstate-soak-"))
    model = save_model_dir(work / "model", "llama", seed=3)
    _, tokenizer = load(str(model))
    users = conversations(args.turns)

    # The reference: stock's greedy replies, each turn carrying the reference replies before it.
    stock = Server([sys.executable, "-m", "mlx_lm", "server", "--model", str(model)], work / "stock.log")
    references: list[list[str]] = []
    try:
        for conversation in users:
            replies: list[str] = []
            for turn in range(args.turns):
                replies.append(ask(stock, messages_of(conversation, replies, turn), "reference")[0])
            references.append(replies)
    finally:
        stock.stop()

    disk = work / "disk"
    command = [sys.executable, "-m", "kvstate.interpreters.cli", "serve", "--model", str(model), "--ram-bytes",
               "2MiB", "--disk-dir", str(disk), "--disk-bytes", "64MiB", "--checkpoint-every", "8"]
    log = work / "kvstate.log"
    lock = threading.Lock()
    state = {"server": Server(command, log), "up": threading.Event()}
    state["up"].set()
    counts = {"served": 0, "wrong": 0, "cross_tenant": 0, "cut_and_sent_again": 0, "kills": 0}
    sent: dict[str, list[list[int]]] = {tenant: [] for tenant in TENANTS}  # what each tenant's requests held
    stop_at = time.monotonic() + args.minutes * 60

    def client(number: int) -> None:
        rng = random.Random(args.seed * 1000 + number)
        while time.monotonic() < stop_at:
            c, tenant = rng.randrange(len(users)), rng.choice(TENANTS)
            turn = rng.randrange(args.turns)
            messages = messages_of(users[c], references[c], turn)
            key = f"{tenant}-{c}-{turn}-{number}-{rng.randrange(1 << 30)}" if rng.random() < 0.5 else None
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            with lock:  # what this request may leave kept for its tenant, from the moment it is sent
                mine = len(sent[tenant])
                sent[tenant].append(list(prompt) + tokenizer.encode(references[c][turn], add_special_tokens=False))
            cut = False
            while time.monotonic() < stop_at + 120:
                state["up"].wait()
                server = state["server"]
                try:
                    text, cached = ask(server, messages, tenant, key)
                except (openai.APIConnectionError, openai.APIStatusError):
                    with lock:
                        counts["cut_and_sent_again"] += 1
                    cut = True
                    state["up"].wait()
                    continue
                break
            else:
                return
            with lock:
                counts["served"] += 1
                if text != references[c][turn]:
                    counts["wrong"] += 1
                    print(f"WRONG: conversation {c} turn {turn} ({tenant}): {text!r} != {references[c][turn]!r}",
                          flush=True)
                # the most its own tenant's other requests (before it, or beside it) can have left kept
                own = max((common_prefix(tuple(prompt), tuple(before)) for n, before in enumerate(sent[tenant])
                            if n != mine), default=0)
                if cut:  # its own attempt before the kill may have kept its prompt (and a checkpoint resumes it)
                    own = len(prompt)
                if cached > own:
                    counts["cross_tenant"] += 1
                    print(f"CROSS-TENANT: {tenant} got {cached} cached tokens, its own requests hold {own}",
                          flush=True)

    def killer() -> None:
        rng = random.Random(args.seed)
        while True:
            pause = rng.expovariate(1 / args.kill_every)
            if time.monotonic() + pause >= stop_at:
                return
            time.sleep(pause)
            state["up"].clear()
            state["server"].process.kill()
            state["server"].process.wait()
            counts["kills"] += 1
            state["server"] = Server(command, log)
            state["up"].set()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(args.clients)]
    threads.append(threading.Thread(target=killer))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    server = state["server"]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30).read().decode()
    server.stop()
    text = log.read_text()
    rejected = sum(int(n) for n in re.findall(r"; (\d+) files rejected", text))
    resumes = len(re.findall(r"resumed after \d+ tokens", text))
    temp_left = [p.name for p in disk.rglob("*") if ".tmp-" in p.name]
    print(f"soak of {args.minutes:g} min, {args.clients} clients, {len(TENANTS)} tenants, seed {args.seed}: "
          f"{counts['served']} requests served, {counts['kills']} kills survived, "
          f"{counts['cut_and_sent_again']} requests cut by a kill and sent again, {resumes} resumed from a "
          f"checkpoint")
    print(f"wrong answers {counts['wrong']} (goal 0), cross-tenant hits {counts['cross_tenant']} (goal 0), "
          f"saved files rejected at a restart {rejected} (goal 0), temp files left {len(temp_left)} (goal 0)")
    print("since the last restart: " + ", ".join(f"{line.split()[0]} {line.split()[1]}" for line in metrics.splitlines()
                                                  if line.split()[0] in ("kvstate_hits_total", "kvstate_misses_total",
                                                                         "kvstate_restores_total")))
    shutil.rmtree(work, ignore_errors=True)
    failed = counts["wrong"] or counts["cross_tenant"] or rejected or temp_left
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
