"""The console script and the trace replay (the README's main job)."""

import json
import subprocess
import sys

import pytest

from kvstate.interpreters.sizes import size_argument
from kvstate.interpreters.lab.traces import BLOCK_TOKENS, TraceFormatError, TraceRequest, mooncake
from kvstate.interpreters.lab.replay import replay, replay_service
from kvstate.interpreters.traces import bundled


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", *args], capture_output=True, text=True)


def test_version_and_usage():
    import kvstate
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"kvstate {kvstate.__version__}"
    bare = run_cli()
    assert bare.returncode == 2 and "usage: kvstate" in bare.stderr and "replay" in bare.stderr


def test_sizes():
    assert size_argument("384GiB") == 384 << 30
    assert size_argument("2T") == 2 << 40 and size_argument("500MB") == 500 * 10**6 and size_argument("17") == 17


def test_malformed_trace_lines_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}) + "\n"
                    + '{"timestamp": 1}\n')
    with pytest.raises(TraceFormatError, match="bad.jsonl:2"):
        mooncake(path)


def test_unbounded_replay_reuses_every_shared_leading_block():
    """With room for everything, each request reuses exactly the leading blocks a request before it had."""
    requests = mooncake(bundled()).requests[:300]
    result = replay(requests, replay_service("llama-3.2-1b", ram_bytes=1 << 60))
    expected_blocks = expected_tokens = 0
    seen: list[tuple[int, ...]] = []
    for request in requests:
        best = 0
        for earlier in seen:
            n = 0
            for x, y in zip(earlier, request.blocks):
                if x != y:
                    break
                n += 1
            best = max(best, n)
        expected_blocks += best
        expected_tokens += min(best * BLOCK_TOKENS, request.input_length)
        seen.append(request.blocks)
    assert result.block_hits == expected_blocks and result.reused_tokens == expected_tokens
    assert result.requests == 300 and result.report.live_requests == 0 and result.report.projected_bytes == 0


def test_state_that_cannot_be_cut_back_is_kept_at_the_last_full_block_and_reused_exactly():
    """A hybrid model's caches serve only the exact prefix they cover: each request keeps its state at
    its last full block (the trace's last block is usually partial, and the next turn's differs), and
    reuses the longest such kept prefix, never a cut-back longer one."""
    short = TraceRequest(0.0, BLOCK_TOKENS // 2, 10, (7,))  # one partial block: nothing to keep
    requests = (short,) + mooncake(bundled()).requests[:300]
    result = replay(requests, replay_service("qwen3-next-80b-a3b", ram_bytes=1 << 60))
    kept: set[tuple[int, ...]] = set()
    expected_blocks = expected_tokens = 0
    for request in requests:
        best = max((len(k) for k in kept if request.blocks[:len(k)] == k), default=0)
        expected_blocks += best
        expected_tokens += min(best * BLOCK_TOKENS, request.input_length)
        aligned = request.blocks if request.input_length % BLOCK_TOKENS == 0 else request.blocks[:-1]
        if aligned and best <= len(aligned):
            kept.add(aligned)
    assert 0 < expected_blocks  # the trace's turns do reuse what the turn before kept
    assert result.block_hits == expected_blocks and result.reused_tokens == expected_tokens
    trimmable = replay(requests, replay_service("llama-3.2-1b", ram_bytes=1 << 60))
    assert result.block_hits < trimmable.block_hits  # cut-back attention state serves more prefixes


def test_a_kv_budget_refuses_what_can_never_fit_and_counts_it():
    """Under a budget smaller than some requests' projection, those are refused, the rest replay."""
    requests = mooncake(bundled()).requests[:200]
    spec = replay_service("llama-3.2-1b", ram_bytes=1 << 60).config.model
    budget = spec.bytes_for(8)  # eight 512-token blocks
    result = replay(requests, replay_service("llama-3.2-1b", ram_bytes=1 << 60, kv_budget_bytes=budget))
    too_long = sum(1 for r in requests if len(r.blocks) + 1 + -(-r.output_length // BLOCK_TOKENS) > 8)
    assert 0 < too_long < len(requests)
    assert result.refused == too_long and result.requests == len(requests) - too_long
    assert result.report.live_requests == 0


def test_main_job_runs_on_the_bundled_trace():
    done = run_cli("replay", "--limit", "200")
    assert done.returncode == 0, done.stderr
    assert "bundled Mooncake conversation trace" in done.stdout
    assert "token hit ratio" in done.stdout and "requests            200" in done.stdout


#: Each bad input as a new user would try it, and what the message must say ({dir}: a fresh folder;
#: binary, malformed and empty traces are written there).
BAD_INPUTS = {
    "missing": (["replay", "{dir}/nope.jsonl"], "cannot read"),
    "binary": (["replay", "{dir}/binary.jsonl"], "cannot read"),
    "malformed": (["replay", "{dir}/malformed.jsonl"], "cannot read"),
    "directory": (["replay", "{dir}"], "cannot read"),
    "empty": (["replay", "{dir}/empty.jsonl"], "no requests"),
    "limit -1": (["replay", "--limit", "-1"], "at least 1"),
    "limit 0": (["replay", "--limit", "0"], "at least 1"),
    "limit -5": (["replay", "--limit", "-5"], "at least 1"),
    "simulate binary": (["simulate", "{dir}/binary.jsonl", "--json", "", "--plot", ""], "cannot read"),
    "simulate empty": (["simulate", "{dir}/empty.jsonl", "--json", "", "--plot", ""], "no requests"),
    "requests 0": (["simulate", "--synthetic", "chat", "--requests", "0"], "at least 1"),
    "requests -5": (["simulate", "--synthetic", "chat", "--requests", "-5"], "at least 1"),
    "sessions 0": (["demo", "--sessions", "0"], "at least 1"),
    "turns 0": (["demo", "--turns", "0"], "at least 1"),
    "sessions -1": (["demo", "--sessions", "-1"], "at least 1"),
    "fraction of a fixed-size state": (["simulate", "--granularity", "prefix", "--model", "mamba-2.8b",
                                        "--capacity", "10%"], "give sizes"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_at_the_command_line_is_a_message_not_a_traceback(case, tmp_path):
    """Every bad input says what is wrong, exits 2, and prints no report as if it had run."""
    (tmp_path / "binary.jsonl").write_bytes(b"\x00\x01\xff\xfegarbage")
    (tmp_path / "malformed.jsonl").write_text("{not json\n")
    (tmp_path / "empty.jsonl").write_text("")
    argv, said = BAD_INPUTS[case]
    result = run_cli(*[arg.replace("{dir}", str(tmp_path)) for arg in argv])
    assert result.returncode == 2, result.stdout + result.stderr
    assert said in result.stderr and "Traceback" not in result.stderr
    assert "report:" not in result.stdout and "hit rate" not in result.stdout
