"""Which chunk snapshots of a hybrid or recurrent model are worth keeping: kvstate's rule against
Marconi's, through the core's own decisions on the bundled conversation trace.

A model with recurrent layers serves a prefix only where a snapshot of those layers' state is held
(the attention layers' blocks alone cannot rebuild it). A server can take one at every chunk of a
prefill; each costs the recurrent state's bytes, however few tokens it saves. The rules replayed,
each through the same service (the simulator, state in blocks of one trace block, 512 tokens; a
chunk is a block), at several RAM sizes and eviction policies:

- ``ends``: only the state at the prompt's last full block (what a server keeps at a segment's end);
- ``every``: a snapshot at every chunk, all offered to the policy;
- ``bytes``: every chunk offered as a chunk, kept where it holds no more bytes than the attention
  state of the tokens it saves over the snapshot before it (``core/tiers.py``,
  ``snapshot_worth_keeping``; ``snapshot_admission="bytes"``), the ends as ``ends``;
- ``kvstate``: every chunk offered as a chunk (``snapshot_admission="reuse"``, the default): one a held
  prefix goes past, so that a branch point lies there or beyond, is kept as any snapshot; any other is
  a guess, kept only where worth its bytes and in free RAM;
- ``marconi``: Marconi's admission (Pan et al., MLSys'25): besides the end, one snapshot, at the
  prompt's branch point, where it leaves the longest prefix it shares with a prompt seen before
  (rounded down to the chunk). Marconi finds branch points in its cache's tree; this finds them in
  every prompt seen, a superset, so it misses none Marconi could take.

Prints, per model, policy and capacity (a fraction of the trace's working set of attention blocks),
each rule's token hit ratio (prompt tokens served from kept state) and the states of the layers that
cannot be cut it held at the end (snapshots, or a recurrent model's whole entries).

    python bench/snapshots.py [--models qwen3-next-80b-a3b,mamba-2.8b] [--requests 4000]
        [--capacities 1%,3%,10%] [--policies lru,gdsf]
"""

from __future__ import annotations

import argparse
from typing import Iterable

from kvstate.interpreters.lab.replay import replay, replay_service
from kvstate.interpreters.lab.runs import block_bytes
from kvstate.interpreters.lab.sweep import parse_capacity
from kvstate.interpreters.lab.traces import Trace, TraceRequest, mooncake
from kvstate.interpreters.traces import bundled
from kvstate.models.catalogue import model_spec

RULES = ("ends", "every", "bytes", "kvstate", "marconi")


class BranchPoints:
    """The longest prefix each prompt shares with a prompt seen before it (every prefix remembered)."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, ...]] = set()
        self._branch: dict[int, int] = {}

    def branch(self, request: TraceRequest) -> int:
        key = id(request)
        if key not in self._branch:
            blocks, shared = request.blocks, 0
            while shared < len(blocks) and blocks[:shared + 1] in self._seen:
                shared += 1
            self._branch[key] = shared
            self._seen.update(blocks[:end] for end in range(1, len(blocks) + 1))
        return self._branch[key]


def offers(rule: str, trace: Trace):
    """The chunk offers of ``rule`` (the replay's ``chunk_offers``), or None for none."""
    if rule == "ends":
        return None
    if rule in ("every", "bytes", "kvstate"):
        chunk = rule != "every"

        def every(request: TraceRequest, kept: tuple, reused: int) -> Iterable[tuple[int, bool]]:
            return [(end, chunk) for end in range(reused + 1, len(kept))]
        return every
    points = BranchPoints()
    for request in trace.requests:  # in arrival order, as the replay meets them
        points.branch(request)

    def at_branch(request: TraceRequest, kept: tuple, reused: int) -> Iterable[tuple[int, bool]]:
        branch = points.branch(request)
        return [(branch, False)] if reused < branch < len(kept) else []
    return at_branch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-next-80b-a3b,mamba-2.8b")
    parser.add_argument("--requests", type=int, default=4000, help="the trace's first N requests")
    parser.add_argument("--capacities", default="1%,3%,10%")
    parser.add_argument("--policies", default="lru,gdsf")
    args = parser.parse_args()
    full = mooncake(bundled())
    trace = Trace(full.name, full.requests[:args.requests])
    print(f"{trace.name}: {len(trace.requests)} requests, {trace.unique_blocks} unique blocks of 512 tokens")
    print(f"{'model':20}{'policy':8}{'capacity':>10}" + "".join(f"{rule:>18}" for rule in RULES))
    for name in args.models.split(","):
        spec = model_spec(name)
        for policy in args.policies.split(","):
            for text in args.capacities.split(","):
                capacity = parse_capacity(text, "blocks", trace, spec)
                # A recurrent model's blocks hold no bytes: its RAM is counted in snapshots of its state.
                ram = capacity.nbytes if block_bytes(spec) else max(1, capacity.blocks // 16) * spec.fixed_bytes
                cells = []
                for rule in RULES:
                    service = replay_service(spec, ram_bytes=ram, policy=policy, block_tokens=1,
                                             refuse_past_context=False,
                                             snapshot_admission="bytes" if rule == "bytes" else "reuse")
                    outcome = replay(trace.requests, service, chunk_offers=offers(rule, trace))
                    states = sum(1 for e in service.state.entries.values() if not e.is_block)
                    cells.append(f"{outcome.token_hit_ratio:.4f} ({states:>4})")
                label = text if block_bytes(spec) else f"{ram / 2**30:.1f}GiB"
                print(f"{name:20}{policy:8}{label:>10}" + "".join(f"{cell:>18}" for cell in cells), flush=True)
    print("each cell: token hit ratio (states of the layers that cannot be cut held at the end)")


if __name__ == "__main__":
    main()
