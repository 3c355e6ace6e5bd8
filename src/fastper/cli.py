"""The ``fastper`` command: ``bench``, ``inspect``, ``warmup``, ``train``, ``plot``, ``compare``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import __version__, warmup
from .errors import EXTRAS, MissingExtraError, install_hint, missing_extra


class UsageError(Exception):
    """A mistake on the command line: ``main`` prints it as one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block) and a pointer to ``--help``."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _integer(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, written ``1048576``, ``1_000_000``,
    ``1e6`` (a whole number in scientific notation, up to 2^53), ``2^20`` or ``2**20``."""

    def parse(text: str) -> int:
        t = text.strip().replace("**", "^")
        try:
            if "^" in t:
                base, exp = (int(x) for x in t.split("^", 1))
                if not 0 <= exp <= 64:
                    raise ValueError
                value = base**exp
            elif "e" in t.lower() and not t.lower().startswith(("0x", "-0x")):
                number = float(t)
                if not (number.is_integer() and abs(number) <= 2**53):
                    raise ValueError
                value = int(number)
            else:
                value = int(t)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number such as 1000, 1e6 or 2^20, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _peers_script() -> Path | None:
    """benchmarks/peers.py of the source checkout this package runs from, if any."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
    return script if script.is_file() else None


#: defaults of the bench options, which mean nothing with --peers (its options follow --peers)
_BENCH_DEFAULTS: dict[str, Any] = {
    "capacity": 2**20,
    "batch_size": 256,
    "kind": "proportional",
    "calls": 300,
    "workloads": False,
    "seed": 0,
}


def _bench(args: argparse.Namespace) -> int:
    from . import _bench

    if args.peers:
        given = [
            "--" + name.replace("_", "-")
            for name, default in _BENCH_DEFAULTS.items()
            if getattr(args, name) != default
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to "
                "--peers: everything after --peers goes "
                "to benchmarks/peers.py (see `fastper bench --peers --help`), e.g. "
                "fastper bench --peers --capacities 2^16 --batches 256"
            )
        script = _peers_script()
        if script is None:
            raise UsageError(
                "the peer benchmark lives in the source checkout (benchmarks/peers.py); "
                "install fastper from a clone with `pip install -e '.[bench]'` and run it there"
            )
        cmd = [sys.executable, str(script), *args.peer_args]
        env = dict(os.environ, FASTPER_PEERS_PROG="fastper bench --peers")
        return subprocess.call(cmd, cwd=script.parent.parent, env=env)

    if args.workloads:
        if args.capacity < _bench.MIN_WORKLOAD_CAPACITY:
            raise UsageError(
                f"--workloads needs --capacity >= {_bench.MIN_WORKLOAD_CAPACITY}, "
                f"got {args.capacity}"
            )
        pairs = _bench.run_workloads(args.capacity, args.batch_size, calls=max(10, args.calls // 3))
        print(_bench.format_workloads(pairs, args.capacity, args.batch_size))
        return 0
    timings = _bench.run(args.capacity, args.batch_size, args.kind, args.calls, args.seed)
    print(_bench.format_table(timings, args.capacity, args.kind))
    return 0


def _warmup(args: argparse.Namespace) -> int:
    return warmup.run(args)


def _inspect(args: argparse.Namespace) -> int:
    from .checkpoint import read_metadata
    from .errors import CheckpointError

    try:
        meta = read_metadata(args.checkpoint, verify=args.verify)
    except (CheckpointError, OSError) as exc:
        print(f"fastper inspect: error: {exc}", file=sys.stderr)
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


#: what each command imports beyond numpy and numba: (the extra, its modules)
NEEDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "train": ("agents", ("torch", "gymnasium", "tqdm")),
    "plot": ("agents", ("matplotlib", "scipy")),
    "compare": ("agents", ("scipy",)),
}


def check_extra(what: str, extra: str, modules: Sequence[str]) -> None:
    """Import the modules of ``extra`` that ``what`` needs, before it runs anything
    (it would import them anyway); one line saying what to install if one fails.

    Raises:
        MissingExtraError: one line naming ``what``, the modules missing (or the
            first that fails to import, with its error) and the pip command that
            installs the extra.
    """
    missing: list[str] = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] != module:
                raise missing_extra(what, exc, extra, module) from exc  # one of its own deps
            missing.append(module)
        except ImportError as exc:  # installed, but broken
            raise missing_extra(what, exc, extra, module) from exc
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise MissingExtraError(
            f"{what} needs the {extra} extra ({', '.join(missing)} {verb} not installed): "
            f"{install_hint(extra)}",
            name=missing[0],
            extra=extra,
        )


def _optional_import_error(exc: BaseException) -> ImportError | None:
    """The error in ``exc``'s chain that names an optional dependency, if any: a
    :class:`MissingExtraError`, or an ImportError of a module of :data:`EXTRAS`."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MissingExtraError):
            return e
        if isinstance(e, ImportError) and (e.name or "").split(".")[0] in EXTRAS:
            return e
        e = e.__cause__ or e.__context__
    return None


def _train(args: argparse.Namespace) -> int:
    if args.env is not None and args.env.startswith("MinAtar/"):
        check_extra(f"fastper train --env {args.env}", "minatar", ("minatar",))
    out = Path(args.out)
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"--out must be a directory, got {args.out!r} ({existing} is a file)")
    from .agents.resume import ResumeError
    from .agents.runner import SettingsError, config_class, parse_overrides, train_many

    cls = config_class(args.algo)
    try:
        overrides = parse_overrides(cls, args.set)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    for name, option in (("seed", "--seed-offset N (and --seeds K)"), ("replay", "--replay")):
        if name in overrides:
            raise UsageError(f"`--set {name}` is not read (each run sets it): use {option}")
    for name, option, value in (
        ("env_id", "--env", args.env),
        ("total_steps", "--steps", args.steps),
        ("num_envs", "--num-envs", args.num_envs),
    ):
        if name in overrides and value is not None and overrides[name] != value:
            raise UsageError(
                f"`--set {name}={overrides[name]}` and `{option} {value}` disagree; give one"
            )
    if args.num_envs is not None:
        overrides["num_envs"] = args.num_envs
    seeds = list(range(args.seed_offset, args.seed_offset + args.seeds))
    env = args.env or overrides.pop("env_id", None) or cls().env_id
    overrides.pop("env_id", None)
    try:
        results = train_many(
            args.algo, env, args.replay, seeds, args.steps, out,
            overrides=overrides, workers=args.workers, progress=not args.quiet,
            threads=args.threads, resume=args.resume,
        )  # fmt: skip
    except SettingsError as exc:  # found before anything was written
        raise UsageError(str(exc)) from exc
    except ResumeError as exc:  # found while rebuilding a run (an env that does not replay)
        print(f"fastper train: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    print(f"runs written under {args.out}:")
    for replay, seed, last, episodes, wall in results:
        print(f"  {args.algo} {replay:<8} seed {seed:<3} last-10 return {last:9.2f}  "
              f"{episodes:5d} episodes  {wall:6.0f} s")  # fmt: skip
    return 0


#: `--returns` of plot and compare (agents.analysis.RETURNS)
RETURNS_CHOICES = ("eval", "train")


def _load_groups(cmd: str, dirs: Sequence[str], include_unfinished: bool) -> Any:
    from .agents.analysis import find_runs, group_runs

    try:
        return group_runs(find_runs(dirs, include_unfinished))
    except ValueError as exc:
        print(f"fastper {cmd}: error: {exc}", file=sys.stderr)
        return None


def _image_formats() -> set[str]:
    from matplotlib.figure import Figure  # the agents extra: checked before the command runs

    return set(Figure().canvas.get_supported_filetypes())


def _check_image(option: str, path: str, formats: set[str]) -> None:
    if Path(path).suffix.lstrip(".").lower() not in formats:
        raise UsageError(
            f"{option} must end in an image type matplotlib writes "
            f"({', '.join(sorted(formats))}), got {path!r}; e.g. {option} curve.png"
        )


def _plot(args: argparse.Namespace) -> int:
    formats = _image_formats()
    _check_image("-o/--output", args.output, formats)
    profile = args.profile
    if profile == "":  # --profile without a file: next to the curves
        out = Path(args.output)
        profile = str(out.with_name(f"{out.stem}-profile{out.suffix}"))
    if profile is not None:
        _check_image("--profile", profile, formats)
    from .agents.analysis import choose_returns, plot, plot_profile

    groups = _load_groups("plot", args.dirs, args.include_unfinished)
    if groups is None:
        return 1
    try:
        used = choose_returns([r for g in groups for r in g.runs], args.returns)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    out = plot(groups, args.output, args.window, args.title, used.kind)
    print(f"wrote {out}; {used.note}")
    if profile is not None:
        print(
            f"wrote {plot_profile(groups, profile, used.kind, title=args.title)} (performance profile)"
        )
    return 0


def _compare(args: argparse.Namespace) -> int:
    from .agents.analysis import compare_table

    groups = _load_groups("compare", args.dirs, args.include_unfinished)
    if groups is None:
        return 1
    try:
        table = compare_table(groups, args.threshold, args.window, args.returns)
    except ValueError as exc:  # --returns eval without evaluations
        raise UsageError(str(exc)) from exc
    print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fastper",
        description="Fast, exact prioritized experience replay. Subcommands: bench (time the "
        "buffers), inspect (read a checkpoint's header), warmup (compile the kernels ahead of "
        "use), train (reference agents), plot and "
        "compare (their runs). `fastper SUBCOMMAND --help` says what each does and writes. "
        "A mistake on the command line exits with status 2 and one line saying what to change; "
        "so does a command whose extra is not installed (train, plot and compare need "
        '`pip install "fastper[agents]"`), with one line naming the extra.',
    )
    parser.add_argument("--version", action="version", version=f"fastper {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    bench = sub.add_parser(
        "bench",
        help="time add / sample / update on a filled buffer",
        description="Fill a buffer of --capacity CartPole-like transitions (after checking "
        "on a small one that it samples the right distribution) and time its add, sample, "
        "update_priorities and learner step (sample + update); prints a table of median and "
        "p90 microseconds to stdout and writes no files. --workloads times the loops of real "
        "runs beside their references instead. --peers runs the side-by-side benchmark "
        "against cpprb, Tianshou and TorchRL (benchmarks/peers.py, source checkout and the "
        "`bench` extra): everything after --peers is its options (`fastper bench --peers "
        "--help`, e.g. --quick or --out DIR); it writes peers.{csv,md,png,json} to "
        "benchmarks/results (--quick: benchmarks/results/quick). With none of the peer "
        "libraries installed it refuses (exit status 2, nothing run or written: "
        "pip install 'fastper[bench]'); with some, it measures those and writes only if at "
        "least one peer was measured, so committed results are never replaced by a table "
        "of n/a.",
    )
    bench.add_argument(
        "--capacity", type=_integer(1), default=2**20,
        help="buffer capacity, >= 1; 2^k accepted (default 2^20)",
    )  # fmt: skip
    bench.add_argument(
        "--batch-size", type=_integer(1), default=256, help="sample batch size (default 256)"
    )
    bench.add_argument(
        "--kind",
        choices=["uniform", "proportional", "rank"],
        default="proportional",
        help="buffer kind (default proportional)",
    )
    bench.add_argument(
        "--calls", type=_integer(1), default=300, help="timed calls per op (default 300)"
    )
    bench.add_argument(
        "--workloads",
        action="store_true",
        help="time the loops of real runs beside their references: an alpha schedule, each "
        "buffer kind (full, half full), n-step and vector-env adds",
    )
    bench.add_argument("--seed", type=_integer(0), default=0, help="random seed (default 0)")
    bench.add_argument(
        "--peers",
        action="store_true",
        help="run benchmarks/peers.py instead, with every argument after --peers "
        "(e.g. fastper bench --peers --quick --out /tmp/peers); refuses, writing nothing, "
        "when no peer library is installed",
    )
    bench.set_defaults(func=_bench, peer_args=[], **_BENCH_DEFAULTS)

    insp = sub.add_parser(
        "inspect",
        help="print a checkpoint's metadata without loading its data",
        description="Read the header of a checkpoint written by buffer.save (format, buffer "
        "kind, fields, settings, schedules, cursor, arrays) without loading its data, and "
        "print it to stdout (--json: the raw header). --verify also checks the whole file's "
        "checksum. Writes nothing; exits 1 if the file is not a readable checkpoint.",
    )
    insp.add_argument("checkpoint", help="path to a checkpoint written by buffer.save")
    insp.add_argument("--verify", action="store_true", help="also verify the whole-file checksum")
    insp.add_argument("--json", action="store_true", help="print the raw header as JSON")
    insp.set_defaults(func=_inspect)

    warm = sub.add_parser(
        "warmup",
        help="compile the numba kernels into the on-disk cache",
        description=warmup.DESCRIPTION,
    )
    warmup.add_arguments(warm)
    warm.set_defaults(func=_warmup)

    train = sub.add_parser(
        "train",
        help="train a reference agent (Double DQN or SAC) with some replay schemes and seeds",
        description="Train Double DQN or SAC; each (replay, seed) run writes "
        "OUT/<algo>-<env>-<replay>/seed-<k>/ (config.json, episodes.csv, evaluations.csv, "
        "summary.json; TensorBoard logs too if tensorboard is installed). episodes.csv has "
        "the training episodes; evaluations.csv (step,episode,return,length) has "
        "eval_episodes greedy (DQN) or deterministic (SAC) episodes on a separate env every "
        "eval_every steps and at the end (--set eval_every=0 turns it off). MinAtar ids "
        "(e.g. --env MinAtar/Breakout-v1, DQN with a CNN) need the `minatar` extra. The "
        "options, the environment (made once) and every --set value are checked before "
        "anything is written, and a run that fails leaves no empty directories behind. "
        "Each run checkpoints itself (networks, optimisers, replay buffer, generators, "
        "logs) into its checkpoints/ every checkpoint_every env steps (default 25000; "
        "--set checkpoint_every=0: never) and at its end; the same command with --resume "
        "continues stopped runs exactly where their last checkpoint left them. "
        "Needs the `agents` extra.",
    )
    train.add_argument(
        "algo", choices=["dqn", "sac"], help="dqn (discrete actions) or sac (continuous)"
    )
    train.add_argument(
        "--env", default=None,
        help="Gymnasium id (default CartPole-v1 for dqn, Pendulum-v1 for sac)",
    )  # fmt: skip
    train.add_argument(
        "--replay", nargs="+", choices=["uniform", "per", "rank"], default=["per"],
        help="replay scheme(s): uniform, per (proportional), rank (default per)",
    )  # fmt: skip
    train.add_argument(
        "--seeds", type=_integer(1), default=1, help="number of seeds per scheme (default 1)"
    )
    train.add_argument("--seed-offset", type=_integer(0), default=0, help="first seed (default 0)")
    train.add_argument(
        "--steps", type=_integer(1), default=None,
        help="environment steps per run, all envs together (default: the config's total_steps)",
    )  # fmt: skip
    train.add_argument(
        "--num-envs", type=_integer(1), default=None,
        help="envs each run steps together (a Gymnasium sync vector env, one n-step stream "
        "per env); --steps, learning_starts and train_freq count the steps of all of them "
        "(default 1)",
    )  # fmt: skip
    train.add_argument("--out", default="runs", help="output directory (default ./runs)")
    train.add_argument(
        "--workers", type=_integer(1), default=1,
        help="processes running seeds in parallel (default 1: one after another)",
    )  # fmt: skip
    train.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE",
        help="override a field of the agent's config (DQNConfig / SACConfig in "
        "fastper.agents), read as that field's type: numbers (lr=5e-4, total_steps=1e5), "
        "true/false (dueling=true), none (alpha=none), strings (device=cuda:0) and layer "
        "widths as comma-separated integers (hidden=64,64 is two layers of 64, hidden=64 "
        "one). Repeatable. The seed and the replay scheme come from --seed-offset / --seeds "
        "and --replay.",
    )  # fmt: skip
    train.add_argument(
        "--threads", type=_integer(1), default=None,
        help="torch threads per run (default: CPU cores / workers)",
    )  # fmt: skip
    train.add_argument(
        "--resume", action="store_true",
        help="continue the runs of this command under --out from their checkpoints, bit for "
        "bit as if never stopped (give the same options as the first time); runs that "
        "finished are not run again, runs without a checkpoint start over. Runs "
        "checkpoint every checkpoint_every env steps (--set checkpoint_every=N, 0: never) "
        "and at their end, into <run>/checkpoints/",
    )  # fmt: skip
    train.add_argument("--quiet", action="store_true", help="no progress output")
    train.set_defaults(func=_train)

    returns_help = (
        "which returns: eval (greedy evaluations, evaluations.csv) or train (training "
        "episodes, behaviour policy); default eval when every run has evaluations, else train"
    )
    plot = sub.add_parser(
        "plot",
        help="learning curves across seeds, one colour per scheme; a performance profile too",
        description="Read the runs found under DIRS and draw one learning curve per replay "
        "scheme, n (seeds) in its legend: the mean across seeds with its 95% bootstrap band "
        "(the interval compare uses), and each seed's own curve when there are fewer than 5 "
        "seeds; the "
        "y-axis follows the curves drawn. Curves are evaluation returns when every run has "
        "evaluations.csv, else training returns smoothed over --window episodes (--returns "
        "picks; the output says which). It writes the image to -o/--output (default "
        "curve.png; its folder is created) and, with --profile, the performance profile of the final "
        "returns (rliable when installed: pip install 'fastper[stats]'). Exits 1 if no "
        "finished run is found.",
    )
    plot.add_argument("dirs", nargs="+", help="directories holding runs (searched recursively)")
    plot.add_argument(
        "-o", "--output", default="curve.png",
        help="image file; its suffix picks the format (default curve.png)",
    )  # fmt: skip
    plot.add_argument(
        "--window", type=_integer(1), default=20,
        help="training episodes averaged per point (default 20)",
    )  # fmt: skip
    plot.add_argument("--returns", choices=RETURNS_CHOICES, default=None, help=returns_help)
    plot.add_argument(
        "--profile", nargs="?", const="", default=None, metavar="FILE",
        help="also write the performance profile of final returns (fraction of runs above "
        "each return, 95%% band) to FILE (default: OUTPUT's name + -profile)",
    )  # fmt: skip
    plot.add_argument("--title", default=None)
    plot.add_argument(
        "--include-unfinished", action="store_true",
        help="also use runs without summary.json (still running, killed, or logged before run summaries existed)",
    )  # fmt: skip
    plot.set_defaults(func=_plot)

    comp = sub.add_parser(
        "compare",
        help="table per scheme: n, final return (mean, IQM), AUC, steps to threshold, with CIs",
        description="Read the runs found under DIRS and print to stdout a markdown table, "
        "one row per replay scheme: n (seeds), final return as mean and as interquartile mean "
        "(IQM) and area under the learning curve, each with a 95% percentile bootstrap "
        "interval over seeds (fixed seed; the IQM's from rliable when installed, "
        'pip install "fastper[stats]", else scipy), and steps until the curve reaches '
        "--threshold; notes below say "
        "which returns and which library were used, and flag intervals from fewer than 5 "
        "seeds. Writes nothing; exits 1 if no finished run is found.",
    )
    comp.add_argument("dirs", nargs="+", help="directories holding runs (searched recursively)")
    comp.add_argument(
        "--threshold", type=float, default=None,
        help="return threshold (default: the environment's reward_threshold, e.g. 475 for CartPole-v1)",
    )  # fmt: skip
    comp.add_argument(
        "--window", type=_integer(1), default=20,
        help="training episodes in the moving average for curves and the threshold (default 20)",
    )  # fmt: skip
    comp.add_argument("--returns", choices=RETURNS_CHOICES, default=None, help=returns_help)
    comp.add_argument(
        "--include-unfinished", action="store_true",
        help="also use runs without summary.json (still running, killed, or logged before run summaries existed)",
    )  # fmt: skip
    comp.set_defaults(func=_compare)
    return parser


def _split_peers(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``bench ... --peers REST``: (the arguments up to --peers, REST for peers.py)."""
    if argv[:1] == ["bench"] and "--peers" in argv:
        i = argv.index("--peers")
        rest = argv[i + 1 :]
        return argv[: i + 1], rest[1:] if rest[:1] == ["--"] else rest
    return argv, None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fastper`` command; returns its exit status (2: a mistake on the command line)."""
    argv, peer_args = _split_peers(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        hint = (
            "; options of the peer benchmark go after --peers, e.g. fastper bench --peers --quick"
            if args.command == "bench"
            else ""
        )
        prog = f"fastper {args.command}"
        print(
            f"{prog}: error: unrecognized arguments: {' '.join(extra)}{hint} (see `{prog} --help`)",
            file=sys.stderr,
        )
        return 2
    if peer_args is not None:
        args.peer_args = peer_args
    try:
        need = NEEDS.get(args.command)
        if need is not None:
            check_extra(f"fastper {args.command}", *need)
        status = int(args.func(args))
        sys.stdout.flush()  # a reader gone away shows here, not at exit
        return status
    except UsageError as exc:
        message = " ".join(str(exc).split())
        print(f"fastper {args.command}: error: {message}", file=sys.stderr)
        return 2
    except ImportError as exc:  # an optional module, found but failing, or one deeper down
        found = _optional_import_error(exc)
        if found is None:
            raise  # not an optional dependency: a fault worth its traceback
        message = str(found if isinstance(found, MissingExtraError)
                      else missing_extra(f"fastper {args.command}", found))  # fmt: skip
        print(" ".join(message.split()), file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`fastper compare DIR | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing left to flush at exit
        return 141  # as a shell reports a command ended by SIGPIPE (128 + 13)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
