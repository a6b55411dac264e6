"""The ``kvstate`` command."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import attrs

from kvstate.core.policies import POLICIES
from kvstate.interpreters.sizes import size_argument
from kvstate.models.catalogue import CATALOGUE


def positive_int(text: str) -> int:
    """A count of at least 1 (``--limit``, ``--requests``, ``--sessions``, ``--turns``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _version() -> str:
    from kvstate import __version__
    return __version__


def _read_trace(args: argparse.Namespace, command: str):
    """The trace ``args`` names (the bundled one by default), cut to ``--limit``; None, with a
    one-line message, for one that cannot be read or holds no requests."""
    from kvstate.interpreters.lab import traces
    from kvstate.interpreters.traces import bundled

    path = args.trace or str(bundled())
    try:
        trace = traces.read(path)
    except (OSError, traces.TraceFormatError, UnicodeDecodeError) as error:
        print(f"kvstate {command}: cannot read the trace: {error}", file=sys.stderr)
        return None
    if args.trace is None:
        print(f"no trace given: replaying the bundled Mooncake conversation trace ({path})")
    if args.limit is not None:
        trace = traces.Trace(trace.name, trace.requests[:args.limit])
    if not trace.requests:
        print(f"kvstate {command}: {path} holds no requests", file=sys.stderr)
        return None
    return trace


def _replay(args: argparse.Namespace) -> int:
    from kvstate.interpreters.lab.replay import replay, replay_service
    from kvstate.interpreters.simulator import CostModel

    trace = _read_trace(args, "replay")
    if trace is None:
        return 2
    service = replay_service(args.model, ram_bytes=args.ram, disk_bytes=args.disk, kv_budget_bytes=args.budget,
                             policy=args.policy, **({"block_tokens": 1} if args.blocks else {}))

    def progress(done: int) -> None:
        if done % 1000 == 0:
            print(f"  ... {done} requests", file=sys.stderr, flush=True)

    result = replay(trace.requests, service, progress=progress)
    service.close()
    cost = CostModel()
    print(f"model {args.model}, policy {args.policy}, {'blocks' if args.blocks else 'whole prefixes'}, "
          f"RAM {args.ram / (1 << 30):.1f} GiB"
          + (f", disk {args.disk / (1 << 30):.1f} GiB" if args.disk is not None else ", no disk tier"))
    print(f"requests            {result.requests} ({result.refused} refused)")
    print(f"request hit rate    {result.request_hit_rate:.4f}")
    print(f"token hit ratio     {result.token_hit_ratio:.4f}  ({result.reused_tokens} of {result.prompt_tokens} "
          f"prompt tokens reused)")
    print(f"prefill seconds     {result.prefill_seconds(cost):.1f} estimated, "
          f"{result.prefill_seconds_saved(cost):.1f} saved")
    print(f"replay speed        {result.requests / result.seconds:.0f} requests/s through the service")
    print("report:")
    for field in attrs.fields(type(result.report)):
        print(f"  {field.name:24} {getattr(result.report, field.name)}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from kvstate.interpreters.lab import sweep as lab
    from kvstate.interpreters.lab import traces
    from kvstate.interpreters.lab.blocks import BLOCK_POLICIES
    from kvstate.interpreters.lab.runs import PREFIX_POLICIES, PolicyNotAtGranularity, block_bytes, ceiling
    from kvstate.models.catalogue import model_spec

    if args.synthetic:
        trace = traces.SYNTHETIC[args.synthetic](args.requests, seed=args.seed)
        print(f"replaying {trace.name}: {len(trace.requests)} generated requests")
        if args.limit is not None:
            trace = traces.Trace(trace.name, trace.requests[:args.limit])
    else:
        trace = _read_trace(args, "simulate")
        if trace is None:
            return 2
    model = model_spec(args.model)
    if args.recommend:
        return _recommend(args, trace, model)
    known = BLOCK_POLICIES if args.granularity == "block" else PREFIX_POLICIES
    policies = _policies(args, known, f"available at {args.granularity} granularity")
    if policies is None:
        return 2
    try:
        capacities = [lab.parse_capacity(c, args.unit, trace, model) for c in args.capacity.split(",")]
    except lab.BadCapacity as error:
        print(f"kvstate simulate: {error}", file=sys.stderr)
        return 2
    fractions = [c.label for c in capacities if c.unit == "working set"]
    if args.granularity == "prefix" and fractions and not block_bytes(model):
        print(f"kvstate simulate: {model.name}'s state does not grow with the prompt, so a fraction of the "
              f"working set ({', '.join(fractions)}) is no size at prefix granularity; give sizes, e.g. "
              f"--capacity 1GB,10GB", file=sys.stderr)
        return 2
    print(f"{len(trace.requests)} requests, {trace.block_accesses} block accesses, {trace.unique_blocks} unique "
          f"blocks; {args.granularity} granularity, model {model.name}, "
          + (f"disk tier {args.disk / 1e9:.1f} GB" if args.disk else "no disk tier"))
    try:
        rows = lab.sweep(trace, policies, capacities, args.granularity, model, disk_bytes=args.disk,
                         processes=args.processes, progress=sys.stderr.isatty() or args.progress, ray=args.ray)
    except (PolicyNotAtGranularity, lab.RayUnavailable) as error:
        print(f"kvstate simulate: {error}", file=sys.stderr)
        return 2
    most = ceiling(trace, args.granularity, model)
    print(lab.table(rows, most))
    if args.json:
        lab.write_json(rows, args.json)
        print(f"wrote {len(rows)} rows to {args.json}")
    if args.plot:
        lab.plot(rows, most, args.plot, f"{trace.name}: {args.granularity} granularity, {model.name}")
        print(f"wrote the plot to {args.plot}")
    return 0


def _policies(args: argparse.Namespace, known, what: str) -> list[str] | None:
    """The policies ``--policy`` names (all of ``known`` by default); None, with a message, for one not
    among them."""
    policies = [p.strip().lower() for p in (args.policy or ",".join(known)).split(",") if p.strip()]
    unknown = [p for p in policies if p not in known]
    if unknown:
        print(f"kvstate simulate: {', '.join(unknown)} not {what}; choose from: {', '.join(known)}",
              file=sys.stderr)
        return None
    return policies


def _recommend(args: argparse.Namespace, trace, model) -> int:
    """``kvstate simulate --recommend``: the setting of ``kvstate serve`` with the most token hits in
    the limits, from a replay of every candidate (:mod:`~kvstate.interpreters.lab.recommend`)."""
    from kvstate.interpreters.lab import recommend
    from kvstate.interpreters.lab.runs import PREFIX_POLICIES

    if args.ram_limit is None:
        print("kvstate simulate: --recommend needs --ram-limit SIZE, the most RAM the server may keep state "
              "in (e.g. 64GiB)", file=sys.stderr)
        return 2
    policies = _policies(args, PREFIX_POLICIES, "a policy of kvstate serve")
    if policies is None:
        return 2
    settings = recommend.candidates(args.ram_limit, args.disk_limit, policies)
    print(f"{len(trace.requests)} requests over {recommend.trace_hours(trace):.2f} h, model {model.name}: "
          f"{len(settings)} settings, each replayed through the service")
    scored = recommend.score_all(trace, settings, model, processes=args.processes,
                                 progress=sys.stderr.isatty() or args.progress)
    try:
        chosen = recommend.best(scored, args.write_limit)
    except recommend.NoSettingFits as error:
        print(f"kvstate simulate: {error}", file=sys.stderr)
        return 2
    belady = recommend.belady_headroom(trace, chosen.setting.ram_bytes, model)
    print(recommend.table(scored, chosen, args.write_limit))
    print(f"recommended: {chosen.setting.describe()}: token hit ratio {chosen.token_hit_ratio:.4f}; Belady's in "
          f"the same RAM {belady:.4f} (headroom {max(0.0, belady - chosen.token_hit_ratio):.4f})")
    print(f"  kvstate serve {chosen.setting.flags()}")
    if args.plot:
        recommend.plot(scored, chosen, belady, args.plot, f"{trace.name}: settings of kvstate serve, {model.name}")
        print(f"wrote the plot to {args.plot}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvstate.interpreters.demo import run_demo
    run_demo(args.model, seed=args.seed, sessions=args.sessions, turns=args.turns)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstate", description="kvstate: the KV-cache state service for LLM inference on MLX.")
    parser.add_argument("--version", action="version", version=f"kvstate {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    replay = commands.add_parser(
        "replay", help="replay a Mooncake trace through the service on the simulator and print the report",
        description="Replay a Mooncake JSONL trace through the service facade on the simulator interpreter: "
                    "every request is admitted, acquires its longest reusable prefix, prefills the rest, "
                    "publishes its prompt state and is released.")
    replay.add_argument("trace", nargs="?",
                        help="Mooncake or kvstate JSONL trace (default: the bundled conversation trace)")
    replay.add_argument("--model", default="llama-3.1-8b", choices=sorted(CATALOGUE),
                        help="model geometry for bytes (default llama-3.1-8b)")
    replay.add_argument("--ram", type=size_argument, default=size_argument("384GiB"),
                        help="RAM for kept prefixes (default 384GiB, about 3M tokens of llama-3.1-8b)")
    replay.add_argument("--disk", type=size_argument, default=None, help="disk tier capacity (default: none)")
    replay.add_argument("--budget", type=size_argument, default=None, help="KV budget for admitted requests")
    replay.add_argument("--policy", default="lru", choices=list(POLICIES), help="eviction policy (default lru)")
    replay.add_argument("--limit", type=positive_int, default=None, help="replay only the first N requests")
    replay.add_argument("--blocks", action="store_true",
                        help="keep state in blocks, one a trace block (as kvstate serve keeps it in 256-token "
                             "blocks), instead of whole prefixes")
    replay.set_defaults(run=_replay)
    simulate = commands.add_parser(
        "simulate", help="the eviction lab: sweep policies and capacities over a trace",
        description="Replay a trace through block caches (as paged engines keep KV) or through the service "
                    "itself (whole prefixes, as the MLX interpreter keeps them) for every policy at every "
                    "capacity, in parallel processes; print a table, and optionally write JSON and a plot.")
    simulate.add_argument("trace", nargs="?",
                          help="Mooncake or kvstate JSONL trace (default: the bundled conversation trace)")
    simulate.add_argument("--policy", help="comma-separated: lru, fifo, lfu, s3fifo, sieve, gdsf, arc, belady "
                                           "(default: every one the granularity has)")
    simulate.add_argument("--capacity", default="1%,3%,10%,30%,100%",
                          help="comma-separated: counts in --unit (1000, 1e6, 3M, 512K), sizes (20GB, 8GiB) or "
                               "fractions of the trace's working set (10%% or 0.1x); default 1%%,3%%,10%%,30%%,100%%")
    simulate.add_argument("--unit", choices=["blocks", "tokens", "bytes"], default="blocks",
                          help="what plain capacity numbers count (default blocks of 512 tokens)")
    simulate.add_argument("--granularity", choices=["block", "prefix"], default="block")
    simulate.add_argument("--model", default="llama-3.1-8b", choices=sorted(CATALOGUE),
                          help="geometry for bytes and the cost model (default llama-3.1-8b)")
    simulate.add_argument("--disk", type=size_argument, default=None, help="a disk tier behind RAM, e.g. 2TB")
    simulate.add_argument("--synthetic", choices=["chat", "agent", "rag"],
                          help="generate a workload instead of reading a trace")
    simulate.add_argument("--requests", type=positive_int, default=5000, help="requests to generate (default 5000)")
    simulate.add_argument("--seed", type=int, default=0, help="seed of the generated workload")
    simulate.add_argument("--limit", type=positive_int, default=None, help="replay only the first N requests")
    simulate.add_argument("--processes", type=int, default=None, help="parallel runs (default: one per core)")
    simulate.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                          help="run the sweep's cells on a Ray cluster (ray://host:10001, host:6379 or auto); "
                               "without ADDRESS a local Ray, or the cluster RAY_ADDRESS names "
                               "(pip install 'kvstate[ray]')")
    simulate.add_argument("--recommend", action="store_true",
                          help="instead of the sweep: replay the trace at every setting of kvstate serve (RAM up "
                               "to --ram-limit, each policy, a disk tier of --disk-limit and each write rule) "
                               "and print the one with the most token hits within the limits")
    simulate.add_argument("--ram-limit", type=size_argument, default=None, help="with --recommend: the most RAM")
    simulate.add_argument("--disk-limit", type=size_argument, default=None,
                          help="with --recommend: the disk tier's size (default: no disk tier)")
    simulate.add_argument("--write-limit", type=size_argument, default=None,
                          help="with --recommend: the most bytes written to disk per hour of the trace")
    simulate.add_argument("--progress", action="store_true", help="show the progress bar even when not a tty")
    simulate.add_argument("--json", default="kvstate-lab.json",
                          help="write the rows as JSON here (default kvstate-lab.json; '' for none)")
    simulate.add_argument("--plot", default="kvstate-lab.png",
                          help="write a PNG plot of hit ratio against capacity here (default kvstate-lab.png; '' "
                               "for none)")
    simulate.set_defaults(run=_simulate)
    demo = commands.add_parser(
        "demo", help="the reference scheduler on a tiny model over a seeded multi-turn chat, with a disk tier",
        description="Run the reference scheduler (kvstate embedded in an mlx-lm loop) on a tiny random-weight "
                    "model over a seeded multi-turn chat, with the disk tier in a temporary directory; print per "
                    "turn the reused tokens and time to first token, then the hit rate and the service report.")
    demo.add_argument("--model", default="llama", choices=["llama", "gemma3_text", "qwen3_next", "mamba"])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--sessions", type=positive_int, default=3)
    demo.add_argument("--turns", type=positive_int, default=4)
    demo.set_defaults(run=_demo)
    commands.add_parser(
        "serve", add_help=False,
        help="mlx-lm's OpenAI-compatible server with kvstate as its prompt cache (kvstate serve --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # the rest is kvstate's serving flags and mlx_lm.server's own
        from kvstate.interpreters.serving.serve import main as serve
        return serve(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        print("\nname a command, for example: kvstate simulate", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader (head, less) went away: stop quietly, as Unix tools do
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
