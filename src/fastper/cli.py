"""The ``fastper`` command: ``bench`` and ``inspect``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

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
    print(f"checkpoint:   {args.checkpoint}")
    print(f"format:       v{meta['format_version']} (written by fastper {meta['fastper_version']})")
    print(f"buffer:       {meta['buffer']}, capacity {meta['capacity']}, {st['size']} stored")
    print(
        "fields:       "
        + ", ".join(f"{n} {tuple(f['shape'])} {f['dtype']}" for n, f in meta["fields"])
    )
    print(f"settings:     {json.dumps(meta['settings'], sort_keys=True)}")
    print(f"alpha:        {st['alpha']} ({json.dumps(meta['alpha_schedule'])})")
    print(f"beta:         {json.dumps(meta['beta_schedule'])}")
    print(
        f"state:        cursor {st['cursor']}, added {st['total_added']}, step {st['step']}, "
        f"max priority {st['max_priority']}, stale updates {st['stale_updates']}, "
        f"n-step pending {st['n_pending']}"
    )
    print("arrays:")
    for a in meta["arrays"]:
        print(f"  {a['name']:<28} {a['dtype']:<6} {tuple(a['shape'])}")
    if args.verify:
        print("checksum:     ok")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
