"""Settings for ``kvstate serve`` chosen from a trace of its own traffic (``kvstate simulate --recommend``).

Every candidate setting (a RAM size up to the RAM limit, each of the service's policies, no disk
tier or one of the disk limit's size, and with a disk tier each write rule: every kept entry, or
only once it sits idle) replays the trace through the service's own decisions, whole prefixes on
the simulator, as ``kvstate replay`` does. The recommendation is the candidate with the highest
token hit ratio among those within the limits (RAM, and bytes written per hour of the trace's
time); of equals, the one with the least RAM, then the fewest bytes written. Belady's policy (which
evicts the block used furthest in the future, knowing the whole trace) at the recommended RAM,
with no disk tier, is the headroom: what no online policy at that size can beat in RAM.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import attrs
from tqdm import tqdm

from kvstate.interpreters.lab.replay import Outcome
from kvstate.interpreters.lab.runs import PREFIX_POLICIES, block_bytes, run_blocks, run_prefixes
from kvstate.interpreters.lab.sweep import forked_map, human_size
from kvstate.interpreters.lab.traces import Trace
from kvstate.models.spec import ModelSpec

#: The RAM sizes tried, as shares of the RAM limit.
RAM_SHARES = (0.125, 0.25, 0.5, 1.0)
#: The write rules tried with a disk tier: seconds an entry sits idle before it is written (None:
#: written when kept, as ``kvstate serve`` does by default).
IDLE_RULES = (None, 30.0, 120.0)


class NoSettingFits(ValueError):
    """No candidate setting stays within the limits given."""


@attrs.frozen
class Setting:
    """One candidate: what ``kvstate serve`` would be started with."""

    ram_bytes: int
    policy: str
    disk_bytes: int | None = None
    write_idle_after: float | None = None

    def flags(self) -> str:
        """The ``kvstate serve`` flags of this setting."""
        out = f"--ram-bytes {self.ram_bytes} --policy {self.policy}"
        if self.disk_bytes is not None:
            out += f" --disk-dir DIR --disk-bytes {self.disk_bytes}"
            if self.write_idle_after is not None:
                out += f" --disk-write-idle {self.write_idle_after:g}"
        return out

    def describe(self) -> str:
        disk = "no disk" if self.disk_bytes is None else f"disk {human_size(self.disk_bytes)}, " + (
            "written when kept" if self.write_idle_after is None else f"written after {self.write_idle_after:g} s idle")
        return f"RAM {human_size(self.ram_bytes)}, {self.policy}, {disk}"


@attrs.frozen
class Scored:
    """A setting and what its replay measured."""

    setting: Setting
    token_hit_ratio: float
    request_hit_rate: float
    disk_bytes_written: int
    written_per_hour: float


def candidates(ram_limit: int, disk_limit: int | None, policies: Sequence[str] = PREFIX_POLICIES) -> list[Setting]:
    """Every setting tried under the limits, smallest RAM first."""
    sizes = sorted({max(1, int(ram_limit * share)) for share in RAM_SHARES})
    disks: list[tuple[int | None, float | None]] = [(None, None)]
    if disk_limit is not None:
        disks += [(disk_limit, rule) for rule in IDLE_RULES]
    return [Setting(ram, policy, disk, rule) for ram in sizes for policy in policies for disk, rule in disks]


def trace_hours(trace: Trace) -> float:
    """The trace's span from its first arrival to its last, in hours (at least a second's worth)."""
    if not trace.requests:
        return 1 / 3600
    return max(trace.requests[-1].arrival - trace.requests[0].arrival, 1.0) / 3600


def score(trace: Trace, setting: Setting, model: ModelSpec) -> Scored:
    """Replay ``trace`` through the service at ``setting``."""
    options = {} if setting.write_idle_after is None else {"write_idle_after": setting.write_idle_after}
    outcome: Outcome = run_prefixes(trace, setting.policy, setting.ram_bytes, setting.disk_bytes, model, **options)
    return Scored(setting, outcome.token_hit_ratio, outcome.request_hit_rate, outcome.disk_bytes_written,
                  outcome.disk_bytes_written / trace_hours(trace))


def within(scored: Scored, write_limit_per_hour: int | None) -> bool:
    return write_limit_per_hour is None or scored.written_per_hour <= write_limit_per_hour


def best(scored: Sequence[Scored], write_limit_per_hour: int | None) -> Scored:
    """The highest token hit ratio within the write limit; of equals, the least RAM, then the fewest
    bytes written. :class:`NoSettingFits` where none is within it."""
    fitting = [s for s in scored if within(s, write_limit_per_hour)]
    if not fitting:
        raise NoSettingFits(f"every setting tried writes more than {human_size(write_limit_per_hour or 0)} an hour; "
                            f"raise --write-limit, or try without --disk-limit")
    return max(fitting, key=lambda s: (s.token_hit_ratio, -s.setting.ram_bytes, -s.disk_bytes_written))


def belady_headroom(trace: Trace, ram_bytes: int, model: ModelSpec) -> float:
    """The token hit ratio of Belady's policy on 512-token blocks in ``ram_bytes`` of RAM."""
    blocks = ram_bytes // max(block_bytes(model), 1)
    return run_blocks(trace, "belady", blocks, None, model).token_hit_ratio


def _indexed_score(trace: Trace, job: tuple[int, Setting, ModelSpec]) -> tuple[int, Scored]:
    index, setting, model = job
    return index, score(trace, setting, model)


def score_all(trace: Trace, settings: Sequence[Setting], model: ModelSpec, processes: int | None = None,
              progress: bool = True) -> list[Scored]:
    """Each setting replayed, in forked processes where there are cores; in the settings' order."""
    workers = min(len(settings), processes or os.cpu_count() or 1)
    out: list[Scored | None] = [None] * len(settings)
    jobs = [(index, setting, model) for index, setting in enumerate(settings)]
    with tqdm(total=len(settings), unit="run", desc="  recommend", file=sys.stderr, disable=not progress) as bar:
        for index, scored in forked_map(_indexed_score, trace, jobs, workers):
            out[index] = scored
            bar.update()
    return out


def table(scored: Sequence[Scored], chosen: Scored, write_limit_per_hour: int | None, most: int = 12) -> str:
    """The best settings first (``most`` of them), the chosen one marked, those over the limit so noted."""
    head = f"{'':2}{'setting':62} {'token hit':>10} {'req hit':>8} {'written/h':>11}"
    lines = [head, "-" * len(head)]
    ranked = sorted(scored, key=lambda s: (-s.token_hit_ratio, s.setting.ram_bytes, s.disk_bytes_written))
    for s in ranked[:most]:
        mark = "* " if s is chosen else "  "
        over = "" if within(s, write_limit_per_hour) else "  (over the write limit)"
        lines.append(f"{mark}{s.setting.describe():62} {s.token_hit_ratio:>10.4f} {s.request_hit_rate:>8.4f} "
                     f"{human_size(int(s.written_per_hour)):>11}{over}")
    return "\n".join(lines)


def plot(scored: Sequence[Scored], chosen: Scored, belady: float, path: str, title: str) -> None:
    """Token hit ratio against RAM, a line per policy and disk rule, Belady's at the chosen RAM dashed and
    the chosen setting circled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 5))
    groups: dict[tuple, list[Scored]] = {}
    for s in scored:
        groups.setdefault((s.setting.policy, s.setting.disk_bytes, s.setting.write_idle_after), []).append(s)
    for n, ((policy, disk, rule), members) in enumerate(groups.items()):
        points = sorted((s.setting.ram_bytes, s.token_hit_ratio) for s in members)
        label = policy + ("" if disk is None else (", disk" if rule is None else f", disk idle {rule:g} s"))
        axis.plot([x for x, _ in points], [y for _, y in points], marker="osD^v<>Px*"[n % 10],
                  linestyle=["-", "--", "-.", ":"][n % 4], fillstyle="none", label=label)
    axis.axhline(belady, linestyle="--", color="black", label=f"Belady at the chosen RAM {belady:.4f}")
    axis.plot([chosen.setting.ram_bytes], [chosen.token_hit_ratio], "o", markersize=16, fillstyle="none",
              color="red", label="recommended")
    axis.set_xscale("log")
    axis.set_xlabel("RAM (bytes)")
    axis.set_ylabel("token hit ratio")
    axis.grid(True, alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0, 0.72, 1))
    figure.legend(loc="center right", fontsize=7)
    figure.savefig(path, dpi=110)
    plt.close(figure)

