"""Sweep policies x capacities over one trace, in parallel processes or on a Ray cluster; rows for the
table, JSON and plot.

Each cell (policy x capacity) is one replay, independent of the others. Locally the cells run in a
process pool (forked, so the trace is shared, not copied); with ``ray`` they run as Ray tasks, the
trace put once in the cluster's object store. The rows are the same either way.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from typing import Any, Callable, Iterator, Sequence

import attrs
from tqdm import tqdm

from kvstate.interpreters.lab.runs import block_bytes, run_blocks, run_prefixes
from kvstate.interpreters.lab.traces import BLOCK_TOKENS, Trace
from kvstate.interpreters.lab.replay import Outcome
from kvstate.interpreters.simulator import CostModel
from kvstate.interpreters.sizes import BYTE_UNITS, COUNT_LETTERS, BadQuantity, split_quantity
from kvstate.models.spec import ModelSpec


class BadCapacity(ValueError):
    """A capacity that is not a count, a size or a fraction of the working set."""


@attrs.frozen
class Capacity:
    """One capacity of a sweep: as written, and in blocks and bytes for the model."""

    label: str
    value: float
    unit: str
    blocks: int
    nbytes: int


def parse_capacity(text: str, unit: str, trace: Trace, model: ModelSpec) -> Capacity:
    """``1000`` or ``1e3`` (in ``unit``), ``3M`` / ``512K`` (counts), ``20GB`` / ``8GiB`` (bytes), ``10%`` or
    ``0.1x`` (a fraction of the trace's working set: its unique blocks)."""
    per_block = block_bytes(model)
    try:
        digits, number, suffix = split_quantity(text)
    except BadQuantity:
        raise BadCapacity(f"not a capacity: {text!r} (try 1000, 3M, 20GB or 10%)") from None
    if suffix in ("%", "x"):
        fraction = number / 100 if suffix == "%" else number
        blocks = int(fraction * trace.unique_blocks)
        return Capacity(text, fraction, "working set", blocks, blocks * per_block)
    if suffix in BYTE_UNITS:
        nbytes = int(number * BYTE_UNITS[suffix])
        return Capacity(text, number, "bytes", nbytes // per_block if per_block else 0, nbytes)
    if suffix not in COUNT_LETTERS:
        raise BadCapacity(f"unknown suffix in {text!r}: counts take K, M, G, T; sizes KB, MB, GB, GiB, ...")
    count = number * COUNT_LETTERS[suffix]
    if count != int(count):
        raise BadCapacity(f"{text!r} is not a whole number of {unit}; a fraction of the working set is "
                          f"written {number * 100:g}% or {number:g}x")
    if unit == "blocks":
        blocks = int(count)
    elif unit == "tokens":
        blocks = int(count // BLOCK_TOKENS)
    else:
        return Capacity(text, count, unit, int(count // per_block) if per_block else 0, int(count))
    return Capacity(text, count, unit, blocks, blocks * per_block)


@attrs.frozen
class Row:
    """One (policy, capacity) of a sweep, as the JSON record lists it."""

    policy: str
    capacity: str
    capacity_blocks: int
    capacity_bytes: int
    unit: str
    granularity: str
    requests: int
    request_hit_rate: float
    token_hit_ratio: float
    block_hit_ratio: float
    disk_bytes_written: int
    disk_bytes_read: int
    #: Bytes written per byte read back (None: written, never read): the disk tier's wear per use.
    write_amplification: float | None
    prefill_seconds_saved: float
    seconds: float


class RayUnavailable(RuntimeError):
    """A sweep asked for Ray where the ``ray`` package is not installed."""


_SHARED: tuple | None = None  # (function, trace) for the forked workers of :func:`forked_map`


def run_cell(trace: Trace, job: tuple) -> tuple[int, Outcome]:
    """One cell of a sweep: ``job`` is (index, granularity, policy, capacity, disk bytes, model)."""
    index, granularity, policy, capacity, disk, model = job
    if granularity == "block":
        disk_blocks = None if disk is None else disk // max(block_bytes(model), 1)
        return index, run_blocks(trace, policy, capacity.blocks, disk_blocks, model)
    return index, run_prefixes(trace, policy, capacity.nbytes, disk, model)


def _call_shared(job: tuple) -> Any:
    function, trace = _SHARED
    return function(trace, job)


def forked_map(function: Callable[[Trace, Any], Any], trace: Trace, jobs: Sequence, workers: int) -> Iterator:
    """``function(trace, job)`` for each of ``jobs``, in the order they finish: in ``workers`` forked
    processes (the trace shared with them, not copied) where there are several and the platform
    forks, else here, one after another."""
    global _SHARED
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        _SHARED = (function, trace)
        try:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                yield from pool.imap_unordered(_call_shared, jobs)
        finally:
            _SHARED = None
    else:
        for job in jobs:
            yield function(trace, job)


def _on_ray(trace: Trace, jobs: list, address: str, done) -> None:
    """Run ``jobs`` as Ray tasks (connecting to ``address``, or starting a local Ray where it is
    empty and none is running), calling ``done(index, outcome)`` as each finishes."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable("sweeps on Ray need the ray package: pip install 'kvstate[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False)
    cell = ray.remote(run_cell)
    shared = ray.put(trace)
    pending = [cell.remote(shared, job) for job in jobs]
    while pending:
        finished, pending = ray.wait(pending, num_returns=1)
        done(*ray.get(finished[0]))


def sweep(trace: Trace, policies: Sequence[str], capacities: Sequence[Capacity], granularity: str,
          model: ModelSpec, disk_bytes: int | None = None, cost: CostModel | None = None,
          processes: int | None = None, progress: bool = True, ray: str | None = None) -> list[Row]:
    """Every policy at every capacity; rows in (policy, capacity) order. ``ray``: run the cells on
    the Ray cluster at this address ("" for a local Ray, or the one ``RAY_ADDRESS`` names)."""
    cost = cost or CostModel()
    jobs = [(i, granularity, policy, capacity, disk_bytes, model)
            for i, (policy, capacity) in enumerate((p, c) for p in policies for c in capacities)]
    outcomes: dict[int, Outcome] = {}
    workers = min(len(jobs), processes or os.cpu_count() or 1)
    # tqdm shows the rate and the time left; off, it draws nothing
    bar = tqdm(total=len(jobs), unit="run", desc="  sweep", file=sys.stderr, disable=not progress)

    def done(index: int, outcome: Outcome) -> None:
        outcomes[index] = outcome
        bar.update()
    with bar:
        if ray is not None:
            _on_ray(trace, jobs, ray, done)
        else:
            for index, outcome in forked_map(run_cell, trace, jobs, workers):
                done(index, outcome)
    rows = []
    for index, _, policy, capacity, _, _ in jobs:
        o = outcomes[index]
        rows.append(Row(policy, capacity.label, capacity.blocks, capacity.nbytes, capacity.unit, granularity,
                        o.requests, o.request_hit_rate, o.token_hit_ratio, o.block_hit_ratio, o.disk_bytes_written,
                        o.disk_bytes_read, o.write_amplification, o.prefill_seconds_saved(cost), o.seconds))
    return rows


def table(rows: Sequence[Row], ceiling: Outcome) -> str:
    """The terminal table: policy x capacity, with the unbounded ceiling last."""
    head = (f"{'policy':8} {'capacity':>12} {'req hit':>8} {'token hit':>10} {'block hit':>10} "
            f"{'disk written':>13} {'disk read':>11} {'wr/rd':>7} {'prefill s saved':>16}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.policy:8} {r.capacity:>12} {r.request_hit_rate:>8.4f} {r.token_hit_ratio:>10.4f} "
                     f"{r.block_hit_ratio:>10.4f} {human_size(r.disk_bytes_written):>13} {human_size(r.disk_bytes_read):>11} "
                     f"{_ratio(r.write_amplification):>7} {r.prefill_seconds_saved:>16.1f}")
    lines.append(f"{'(unbounded)':21} {ceiling.request_hit_rate:>8.4f} {ceiling.token_hit_ratio:>10.4f} "
                 f"{ceiling.block_hit_ratio:>10.4f}")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}"


def human_size(nbytes: float) -> str:
    """``nbytes`` in decimal units, to one decimal: 1.2 GB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return str(nbytes)


def write_json(rows: Sequence[Row], path: str) -> None:
    with open(path, "w", encoding="utf-8") as out:
        json.dump([attrs.asdict(r) for r in rows], out, indent=1)


def plot(rows: Sequence[Row], ceiling: Outcome, path: str, title: str) -> None:
    """Hit ratio against capacity per policy (token-weighted and block), the unbounded maximum dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    markers, dashes = "osD^v<>Px*", ["-", "--", "-.", ":"]
    for axis, field, maximum, label in ((axes[0], "token_hit_ratio", ceiling.token_hit_ratio, "token hit ratio"),
                                        (axes[1], "block_hit_ratio", ceiling.block_hit_ratio, "block hit ratio")):
        for n, policy in enumerate(dict.fromkeys(r.policy for r in rows)):
            points = sorted((r.capacity_blocks * BLOCK_TOKENS, getattr(r, field)) for r in rows if r.policy == policy)
            # each policy its own marker, dash and size, so lines that coincide stay visible
            axis.plot([x for x, _ in points], [y for _, y in points], marker=markers[n % len(markers)],
                      linestyle=dashes[n % len(dashes)], markersize=9 - (n % 4) * 1.5, fillstyle="none",
                      label=policy)
        axis.axhline(maximum, linestyle="--", color="black", label=f"unbounded {maximum:.4f}")
        axis.set_xscale("log")
        axis.set_xlabel("capacity (tokens)")
        axis.set_ylabel(label)
        axis.set_ylim(0, 1)
        axis.grid(True, alpha=0.3)
    handles, labels = axes[1].get_legend_handles_labels()
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0, 0.86, 1))
    figure.legend(handles, labels, loc="center right", fontsize=8)  # beside the axes: never over the data
    figure.savefig(path, dpi=110)
    plt.close(figure)
