"""The ``fastper`` command: ``bench``, ``inspect``, ``train``, ``plot``, ``compare``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import __version__


def _peers_script() -> Path | None:
    """benchmarks/peers.py of the source checkout this package runs from, if any."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
    return script if script.is_file() else None


def _bench(args: argparse.Namespace) -> int:
    from . import _bench

    if args.peers:
        script = _peers_script()
        if script is None:
            print(
                "fastper bench --peers: the peer benchmark lives in the source checkout "
                "(benchmarks/peers.py); install fastper from a clone with "
                "`pip install -e '.[bench]'` and run it there",
                file=sys.stderr,
            )
            return 2
        cmd = [sys.executable, str(script), *args.peer_args]
        return subprocess.call(cmd, cwd=script.parent.parent)

    if args.workloads:
        pairs = _bench.run_workloads(args.capacity, args.batch_size, calls=max(10, args.calls // 3))
        print(_bench.format_workloads(pairs, args.capacity, args.batch_size))
        return 0
    timings = _bench.run(args.capacity, args.batch_size, args.kind, args.calls, args.seed)
    print(_bench.format_table(timings, args.capacity, args.kind))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .checkpoint import read_metadata
    from .errors import CheckpointError

    try:
        meta = read_metadata(args.checkpoint, verify=args.verify)
    except (CheckpointError, OSError) as exc:
        print(f"fastper inspect: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(meta, indent=2, sort_keys=True))
        return 0
    st = meta["state"]
    settings, buf, writer = st["settings"], st["buffer"], st["writer"]
    nstep = st.get("nstep") or {}
    print(f"checkpoint:   {args.checkpoint}")
    print(f"format:       v{meta['format_version']} (written by fastper {meta['fastper_version']})")
    print(
        f"buffer:       {st['kind']} (sampling: {buf['scheme']}), capacity "
        f"{settings['capacity']}, {writer['size']} stored"
    )
    print(
        "fields:       "
        + ", ".join(f"{n} {tuple(f['shape'])} {f['dtype']}" for n, f in settings["fields"])
    )
    rest = {k: v for k, v in settings.items() if k not in ("capacity", "fields")}
    print(f"settings:     {json.dumps(rest, sort_keys=True)}")
    print(f"alpha:        {st['sampler'].get('alpha')} ({json.dumps(st['schedules']['alpha'])})")
    print(f"beta:         {json.dumps(st['schedules']['beta'])}")
    pending = "-" if not nstep else f"{len(nstep.get('stream_ids', []) or [])} stream(s)"
    print(
        f"state:        cursor {writer['cursor']}, added {writer['total_added']}, step "
        f"{buf['step']}, max priority ever {buf['max_priority_ever']}, stale updates "
        f"{buf['stale_updates']}, n-step {pending}"
    )
    print("arrays:")
    for a in meta["arrays"]:
        print(f"  {a['name']:<28} {a['dtype']:<6} {tuple(a['shape'])}")
    if args.verify:
        print("checksum:     ok")
    return 0


def _agents_missing(cmd: str, exc: ImportError) -> int:
    print(f"fastper {cmd}: {exc} (pip install 'fastper[agents]')", file=sys.stderr)
    return 2


def _train(args: argparse.Namespace) -> int:
    try:
        from .agents.runner import config_class, parse_overrides, train_many

        cls = config_class(args.algo)
    except ImportError as exc:
        return _agents_missing("train", exc)
    try:
        overrides = parse_overrides(cls, args.set)
    except ValueError as exc:
        print(f"fastper train: {exc}", file=sys.stderr)
        return 2
    seeds = list(range(args.seed_offset, args.seed_offset + args.seeds))
    env = args.env or overrides.pop("env_id", None) or cls().env_id
    try:
        results = train_many(
            args.algo, env, args.replay, seeds, args.steps, args.out,
            overrides=overrides, workers=args.workers, progress=not args.quiet,
            threads=args.threads,
        )  # fmt: skip
    except (ValueError, TypeError) as exc:
        print(f"fastper train: {exc}", file=sys.stderr)
        return 2
    print(f"runs written under {args.out}:")
    for replay, seed, last, episodes, wall in results:
        print(f"  {args.algo} {replay:<8} seed {seed:<3} last-10 return {last:9.2f}  "
              f"{episodes:5d} episodes  {wall:6.0f} s")  # fmt: skip
    return 0


def _load_groups(cmd: str, dirs: Sequence[str], include_unfinished: bool) -> Any:
    from .agents.analysis import find_runs, group_runs

    try:
        return group_runs(find_runs(dirs, include_unfinished))
    except ValueError as exc:
        print(f"fastper {cmd}: {exc}", file=sys.stderr)
        return None


def _plot(args: argparse.Namespace) -> int:
    from .agents.analysis import plot

    groups = _load_groups("plot", args.dirs, args.include_unfinished)
    if groups is None:
        return 1
    try:
        out = plot(groups, args.output, args.window, args.title)
    except ImportError as exc:
        print(f"fastper plot: needs matplotlib ({exc}): pip install matplotlib", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from .agents.analysis import compare_table

    groups = _load_groups("compare", args.dirs, args.include_unfinished)
    if groups is None:
        return 1
    print(compare_table(groups, args.threshold, args.window))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastper", description="Fast, exact prioritized experience replay."
    )
    parser.add_argument("--version", action="version", version=f"fastper {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="time add / sample / update on a filled buffer")
    bench.add_argument("--capacity", type=int, default=2**20, help="buffer capacity (default 2^20)")
    bench.add_argument(
        "--batch-size", type=int, default=256, help="sample batch size (default 256)"
    )
    bench.add_argument(
        "--kind",
        choices=["uniform", "proportional", "rank"],
        default="proportional",
        help="buffer kind (default proportional)",
    )
    bench.add_argument("--calls", type=int, default=300, help="timed calls per op (default 300)")
    bench.add_argument(
        "--workloads",
        action="store_true",
        help="time the loops of real runs beside their references: an alpha schedule, each "
        "buffer kind (full, half full), n-step and vector-env adds",
    )
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--peers",
        action="store_true",
        help="run the side-by-side benchmark against cpprb / Tianshou / TorchRL "
        "(benchmarks/peers.py; needs a source checkout and the `bench` extra)",
    )
    bench.add_argument(
        "peer_args",
        nargs=argparse.REMAINDER,
        help="with --peers: arguments for benchmarks/peers.py (e.g. --quick)",
    )
    bench.set_defaults(func=_bench)
    insp = sub.add_parser("inspect", help="print a checkpoint's metadata without loading its data")
    insp.add_argument("checkpoint", help="path to a checkpoint written by buffer.save")
    insp.add_argument("--verify", action="store_true", help="also verify the whole-file checksum")
    insp.add_argument("--json", action="store_true", help="print the raw header as JSON")
    insp.set_defaults(func=_inspect)

    train = sub.add_parser(
        "train",
        help="train a reference agent (Double DQN or SAC) with some replay schemes and seeds",
        description="Train Double DQN or SAC; each (replay, seed) run writes "
        "OUT/<algo>-<env>-<replay>/seed-<k>/{config.json,episodes.csv} "
        "(and TensorBoard logs if tensorboard is installed). Needs the `agents` extra.",
    )
    train.add_argument("algo", choices=["dqn", "sac"])
    train.add_argument(
        "--env", default=None, help="Gymnasium id (default CartPole-v1 / Pendulum-v1)"
    )
    train.add_argument(
        "--replay", nargs="+", choices=["uniform", "per", "rank"], default=["per"],
        help="replay scheme(s): uniform, per (proportional), rank (default per)",
    )  # fmt: skip
    train.add_argument(
        "--seeds", type=int, default=1, help="number of seeds per scheme (default 1)"
    )
    train.add_argument("--seed-offset", type=int, default=0, help="first seed (default 0)")
    train.add_argument("--steps", type=int, default=None, help="environment steps per run")
    train.add_argument("--out", default="runs", help="output directory (default ./runs)")
    train.add_argument(
        "--workers", type=int, default=1,
        help="processes running seeds in parallel (default 1: one after another)",
    )  # fmt: skip
    train.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE",
        help="override a hyperparameter, e.g. --set lr=5e-4 --set 'hidden=(64,64)'",
    )  # fmt: skip
    train.add_argument(
        "--threads", type=int, default=None,
        help="torch threads per run (default: CPU cores / workers)",
    )  # fmt: skip
    train.add_argument("--quiet", action="store_true", help="no progress output")
    train.set_defaults(func=_train)

    plot = sub.add_parser(
        "plot", help="learning curves: mean and 95%% CI across seeds, one line per scheme"
    )
    plot.add_argument("dirs", nargs="+", help="directories holding runs (searched recursively)")
    plot.add_argument("-o", "--output", default="curve.png", help="image file (default curve.png)")
    plot.add_argument(
        "--window", type=int, default=20, help="episodes averaged per point (default 20)"
    )
    plot.add_argument("--title", default=None)
    plot.add_argument(
        "--include-unfinished", action="store_true",
        help="also use runs without summary.json (still running, killed, or logged before run summaries existed)",
    )  # fmt: skip
    plot.set_defaults(func=_plot)

    comp = sub.add_parser(
        "compare",
        help="table of final return, area under the curve and steps to threshold, with CIs",
    )
    comp.add_argument("dirs", nargs="+", help="directories holding runs (searched recursively)")
    comp.add_argument(
        "--threshold", type=float, default=None,
        help="return threshold (default: the environment's reward_threshold, e.g. 475 for CartPole-v1)",
    )  # fmt: skip
    comp.add_argument(
        "--window", type=int, default=20,
        help="episodes in the moving average for curves and the threshold (default 20)",
    )  # fmt: skip
    comp.add_argument(
        "--include-unfinished", action="store_true",
        help="also use runs without summary.json (still running, killed, or logged before run summaries existed)",
    )  # fmt: skip
    comp.set_defaults(func=_compare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
