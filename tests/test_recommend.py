"""``kvstate simulate --recommend``: every candidate setting replayed through the service, and the one
with the most token hits within the limits chosen, held to a brute force over the same candidates."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstate.interpreters.lab import recommend, traces
from kvstate.interpreters.lab.replay import replay, replay_service
from kvstate.interpreters.lab.runs import PREFIX_POLICIES
from kvstate.models.catalogue import model_spec

MODEL = model_spec("llama-3.2-1b")


@pytest.fixture(scope="module")
def trace():
    return traces.chat(300, seed=4)


def test_the_candidates_are_every_ram_share_policy_and_disk_rule():
    settings = recommend.candidates(8 << 30, 100 << 30, ["lru", "gdsf"])
    rams = sorted({s.ram_bytes for s in settings})
    assert rams == [1 << 30, 2 << 30, 4 << 30, 8 << 30]
    assert len(settings) == 4 * 2 * (1 + len(recommend.IDLE_RULES))
    assert all(s.write_idle_after is None for s in settings if s.disk_bytes is None)
    assert {s.disk_bytes for s in recommend.candidates(8 << 30, None)} == {None}
    assert {s.policy for s in recommend.candidates(8 << 30, None)} == set(PREFIX_POLICIES)


@pytest.mark.parametrize("write_limit", [None, 0, 1 << 30])
def test_the_recommendation_is_the_most_token_hits_within_the_write_limit(trace, write_limit):
    ram_limit = traces_working_set(trace) // 4
    settings = recommend.candidates(ram_limit, ram_limit * 4, ["lru", "fifo", "gdsf"])
    chosen = recommend.best(recommend.score_all(trace, settings, MODEL, processes=1, progress=False), write_limit)
    # The brute force: each candidate replayed on a service of its own, the best kept by hand.
    hours = max(trace.requests[-1].arrival - trace.requests[0].arrival, 1.0) / 3600
    best = None
    for setting in settings:
        options = {} if setting.write_idle_after is None else {"write_idle_after": setting.write_idle_after}
        outcome = replay(trace.requests, replay_service(MODEL, refuse_past_context=False,
                                                        ram_bytes=setting.ram_bytes, disk_bytes=setting.disk_bytes,
                                                        policy=setting.policy, **options))
        if write_limit is not None and outcome.disk_bytes_written / hours > write_limit:
            continue
        key = (outcome.token_hit_ratio, -setting.ram_bytes, -outcome.disk_bytes_written)
        if best is None or key > best[0]:
            best = (key, setting)
    assert chosen.setting == best[1]
    if write_limit == 0:
        assert chosen.disk_bytes_written == 0


def traces_working_set(trace) -> int:
    """The bytes of every distinct block the trace names, at ``MODEL``'s geometry."""
    from kvstate.interpreters.lab.runs import block_bytes
    return trace.unique_blocks * block_bytes(MODEL)


def test_the_command_prints_the_flags_to_start_the_server_with_and_plots(tmp_path):
    path = tmp_path / "trace.jsonl"
    with open(path, "w") as out:
        for request in traces.chat(120, seed=2).requests:
            out.write(f'{{"timestamp": {int(request.arrival * 1000)}, "input_length": {request.input_length}, '
                      f'"output_length": {request.output_length}, "hash_ids": {list(request.blocks)}}}\n')
    command = [sys.executable, "-m", "kvstate.interpreters.cli", "simulate", str(path), "--model", "llama-3.2-1b",
               "--recommend", "--policy", "lru,s3fifo", "--processes", "1"]
    done = subprocess.run(command + ["--ram-limit", "4GiB", "--disk-limit", "32GiB", "--plot",
                                     str(tmp_path / "plot.png")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "recommended: RAM" in done.stdout and "Belady's in the same RAM" in done.stdout
    assert "kvstate serve --ram-bytes" in done.stdout and (tmp_path / "plot.png").stat().st_size > 0
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--recommend needs --ram-limit" in refused.stderr


def test_of_equal_hits_the_least_ram_then_the_fewest_writes_is_chosen():
    def scored(ram, written, hits=0.5, disk=None):
        return recommend.Scored(recommend.Setting(ram, "lru", disk), hits, 0.9, written, float(written))
    small_quiet, small_loud, large = scored(1 << 30, 0), scored(1 << 30, 10, disk=1 << 40), scored(2 << 30, 0)
    assert recommend.best([large, small_loud, small_quiet], None) is small_quiet
    assert recommend.best([large, small_loud], None) is small_loud
    assert recommend.best([large, small_loud, scored(4 << 30, 0, hits=0.6)], None).setting.ram_bytes == 4 << 30
    with pytest.raises(recommend.NoSettingFits, match="raise --write-limit"):
        recommend.best([small_loud], 5)
