"""Running agents over replay schemes and seeds, one after another or in processes.

Layout of an output directory: ``OUT/<algo>-<env>-<replay>/seed-<k>/`` holds
``config.json``, ``episodes.csv``, ``evaluations.csv`` and ``summary.json`` of
one run (see ``_common.RunLogger``), and ``checkpoints/`` while it runs
(``checkpoint_every``; see :mod:`fastper.agents.resume`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ALGOS = ("dqn", "sac")


def config_class(algo: str) -> type[Any]:
    """The hyperparameter dataclass of ``algo`` (imports torch)."""
    if algo == "dqn":
        from .dqn import DQNConfig

        return DQNConfig
    if algo == "sac":
        from .sac import SACConfig

        return SACConfig
    raise ValueError(f"`algo` must be one of {list(ALGOS)}, got algo={algo!r}")


class SettingsError(ValueError):
    """A bad setting or environment, found before anything is written or trained."""


_MISSING = object()

#: How ``--set`` values of each annotation are read (see :func:`parse_overrides`).
_EXPECTS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "tuple[int, ...]": "hidden layer widths: one positive integer per layer",
}


def _example(name: str, kind: str, default: Any) -> str:
    if kind.startswith("tuple"):
        return f"--set {name}=64,64 (two layers of 64) or --set {name}=64 (one)"
    if default is None or default is dataclasses.MISSING:
        return f"--set {name}=0.5"
    return f"--set {name}={str(default).lower() if isinstance(default, bool) else default}"


def _coerce(name: str, kind: str, default: Any, text: str) -> Any:
    """``text`` read as a value of the field annotation ``kind``; ValueError if it is not one."""
    raw = text.strip()
    try:
        value: Any = ast.literal_eval(raw)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        value = raw
    optional = kind.replace(" ", "").endswith("|None")
    base = kind.split("|")[0].strip()
    if optional and (value is None or raw.lower() in ("none", "null")):
        return None
    ok: Any = _MISSING
    if base == "str":
        ok = value if isinstance(value, str) else raw
    elif base == "bool":
        if isinstance(value, bool):
            ok = value
        elif raw.lower() in ("true", "yes", "on", "1"):
            ok = True
        elif raw.lower() in ("false", "no", "off", "0"):
            ok = False
    elif base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            ok = value
        elif isinstance(value, float) and value.is_integer():  # 1e5
            ok = int(value)
    elif base == "float":
        if isinstance(value, int | float) and not isinstance(value, bool):
            ok = float(value)
    elif base.startswith("tuple"):
        if isinstance(value, int) and not isinstance(value, bool):
            value = (value,)  # hidden=64: one layer of 64
        if isinstance(value, tuple | list) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
        ):
            ok = tuple(value)
    else:  # an annotation this parser does not know: the literal as written
        ok = value
    if ok is _MISSING:
        expects = _EXPECTS.get(base, base) + (" or none" if optional else "")
        raise SettingsError(
            f"`--set {name}` takes {expects}, got {raw!r}; e.g. {_example(name, base, default)}"
        )
    return ok


def parse_overrides(cls: type[Any], pairs: Sequence[str]) -> dict[str, Any]:
    """``["lr=3e-4", "hidden=64,64"]`` -> typed values for fields of ``cls``.

    Each value is read as its field's type: integers (``1e5`` too), numbers,
    ``true`` / ``false``, ``none`` where the field allows it, strings as
    written, and layer widths (``hidden``) as comma-separated integers
    (``64,64``, ``(64, 64)``; ``64`` is one layer). Raises :class:`SettingsError`
    (a ValueError) for a pair without ``=``, an unknown field or a value of
    the wrong type, with the accepted form in the message.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise SettingsError(
                f"`--set` must look like name=value, got {pair!r}; e.g. --set lr=0.0005"
            )
        name, text = pair.split("=", 1)
        name = name.strip().replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SettingsError(
                f"`--set` must name a field of {cls.__name__} ({', '.join(sorted(fields))}), "
                f"got {name!r}{hint}"
            )
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        out[name] = _coerce(name, str(f.type), default, text)
    return out


def check_env(algo: str, env_id: str, network: str = "auto") -> None:
    """Make ``env_id`` once and check that ``algo`` can train on it.

    Raises :class:`SettingsError` with one line saying what to do when the id
    is unknown, its dependencies are missing (MinAtar ids: the install
    command), or its spaces do not suit ``algo`` (DQN: Discrete actions, and
    observations that fit ``network``: any Box for the MLP, 3-D for the CNN;
    SAC: Box actions and flat observations).
    """
    try:
        import gymnasium as gym
        from gymnasium import error as gym_error
    except ImportError as exc:
        raise SettingsError(
            f"training needs gymnasium ({exc}): pip install 'fastper[agents]'"
        ) from exc
    from ..spaces import fields_from_spaces
    from ._common import register_env, resolve_network

    try:
        register_env(env_id)
    except ImportError as exc:
        raise SettingsError(" ".join(str(exc).split())) from exc
    try:
        env: Any = gym.make(env_id)
    except (gym_error.Error, ImportError) as exc:
        why = " ".join(str(exc).split())
        raise SettingsError(
            f"cannot make environment {env_id!r}: {why} (--env takes a registered Gymnasium "
            "id such as CartPole-v1, Pendulum-v1 or MinAtar/Breakout-v1; list them with "
            "python -c 'import gymnasium; gymnasium.pprint_registry()')"
        ) from exc
    try:
        action = type(env.action_space).__name__
        need, other = ("Discrete", "sac") if algo == "dqn" else ("Box", "dqn")
        if action != need:
            raise SettingsError(
                f"{algo.upper()} needs a {need} action space, got {env.action_space} for "
                f"{env_id}; choose another --env or use `fastper train {other}`"
            )
        shape = getattr(env.observation_space, "shape", None)
        if shape is None:
            raise SettingsError(
                f"{algo.upper()} needs a Box observation space, got "
                f"{env.observation_space} for {env_id}; choose another --env"
            )
        if algo == "dqn":
            try:
                resolve_network(network, tuple(shape), env_id)
            except ValueError as exc:
                raise SettingsError(str(exc)) from exc
        elif len(shape) != 1:
            raise SettingsError(
                f"SAC needs flat (1-D Box) observations, got {env.observation_space} for "
                f"{env_id}; image observations are for `fastper train dqn` (its CNN)"
            )
        try:
            fields_from_spaces(env.observation_space, env.action_space)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"cannot store transitions of {env_id}: {exc}") from exc
    finally:
        env.close()


def _check_device(text: str) -> None:
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise SettingsError(
            f"`device` must be a torch device such as cpu or cuda:0, got device={text!r}"
        ) from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SettingsError(
            f"device={text!r} but torch sees no CUDA GPU here; use --set device=cpu"
        )


def plan_runs(
    algo: str,
    env_id: str,
    replays: Sequence[str],
    seeds: Sequence[int],
    steps: int | None,
    overrides: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The checked settings of every (replay, seed) run, seed-major.

    Builds each run's config and makes the environment once, so that a bad
    setting or environment raises :class:`SettingsError` before anything is
    written.
    """
    try:
        cls = config_class(algo)
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc
    jobs = []
    cfg: Any = None
    for seed in seeds:  # seed-major, so an interrupted sweep stays balanced across schemes
        for replay in replays:
            settings = dict(overrides or {})
            settings.update(env_id=env_id, replay=replay, seed=int(seed))
            if steps is not None:
                settings["total_steps"] = int(steps)
            try:
                cfg = cls(**settings)
            except (TypeError, ValueError) as exc:
                raise SettingsError(str(exc)) from exc
            jobs.append(settings)
    if cfg is not None:
        _check_device(str(cfg.device))
        check_env(algo, env_id, getattr(cfg, "network", "auto"))
    return jobs


def run_dir(out: str | Path, algo: str, env_id: str, replay: str, seed: int) -> Path:
    safe_env = env_id.replace("/", "_")
    return Path(out) / f"{algo}-{safe_env}-{replay}" / f"seed-{seed}"


def _train_one(
    algo: str,
    settings: dict[str, Any],
    out: str,
    progress: bool,
    threads: int,
    resume: tuple[bool, int | None] = (False, None),
) -> tuple[str, int, float, int, float]:
    """One run (in this process or a pool's): (replay, seed, last-10 return, episodes, s).

    ``progress`` is the run's own bar or lines on stderr (see ``_common.Progress``).
    ``resume``: (continue from the run's checkpoint, the torch threads it ran
    with, used instead of ``threads`` so that it continues bit for bit).
    """
    import torch

    again, saved_threads = resume
    torch.set_num_threads(saved_threads if again and saved_threads else threads)
    cls = config_class(algo)
    cfg = cls(**settings)
    path = run_dir(out, algo, cfg.env_id, cfg.replay, cfg.seed)
    if algo == "dqn":
        from .dqn import train as train_dqn

        res = train_dqn(cfg, out_dir=path, progress=progress, resume=again)
    else:
        from .sac import train as train_sac

        res = train_sac(cfg, out_dir=path, progress=progress, resume=again)
    return _outcome(cfg, res.returns, res.wall_s)


def _outcome(
    cfg: Any, returns: Sequence[float], wall_s: float
) -> tuple[str, int, float, int, float]:
    tail = returns[-10:]
    last = sum(tail) / len(tail) if tail else float("nan")
    return cfg.replay, cfg.seed, last, len(returns), wall_s


def plan_resume(
    algo: str, jobs: Sequence[dict[str, Any]], out: str | Path, threads: int | None
) -> tuple[list[tuple[bool, int | None]], dict[int, tuple[str, int, float, int, float]]]:
    """How ``--resume`` takes up each planned run: (per run: continue?, its threads; finished ones).

    A run with a checkpoint continues from it (with the torch threads it ran
    with, unless ``threads`` is given); a finished one (final checkpoint and
    ``summary.json``) is not run again, its results are read back; one
    without a checkpoint (never started, or stopped before its first
    checkpoint) starts from the beginning. Every checkpoint is read and checked (config, digests) first.

    Raises:
        SettingsError: no run under ``out`` has a checkpoint, or one's config
            differs from the command's, or one is damaged.
    """
    from ._common import SUMMARY_JSON
    from .resume import ResumeError, latest, verify

    cls = config_class(algo)
    plan: list[tuple[bool, int | None]] = []
    finished: dict[int, tuple[str, int, float, int, float]] = {}
    problems = []
    for i, settings in enumerate(jobs):
        cfg = cls(**settings)
        path = run_dir(out, algo, cfg.env_id, cfg.replay, cfg.seed)
        if latest(path) is None:
            plan.append((False, None))
            continue
        try:
            saved = verify(path, algo, cfg)
        except ResumeError as exc:
            problems.append(str(exc))
            plan.append((False, None))
            continue
        plan.append((True, None if threads is not None else saved.meta.get("torch_threads")))
        if saved.final and (path / SUMMARY_JSON).exists():
            col = saved.state["collector"]
            returns = [float(x) for x in col["episode_returns"]]
            finished[i] = _outcome(cfg, returns, float(saved.meta["wall_s"]))
    if problems:
        raise SettingsError("; ".join(problems))
    if not any(again for again, _ in plan):
        raise SettingsError(
            f"--resume: no run under {out} has a checkpoint to continue (looked in "
            f"{run_dir(out, algo, jobs[0]['env_id'], jobs[0]['replay'], jobs[0]['seed'])}"
            + (" and the others" if len(jobs) > 1 else "")
            + "); check --out and the other options, or start the runs without --resume"
        )
    return plan, finished


def train_many(
    algo: str,
    env_id: str,
    replays: Sequence[str],
    seeds: Sequence[int],
    steps: int | None,
    out: str | Path,
    overrides: dict[str, Any] | None = None,
    workers: int = 1,
    progress: bool = True,
    threads: int | None = None,
    resume: bool = False,
) -> list[tuple[str, int, float, int, float]]:
    """Train ``algo`` for every (replay, seed); returns (replay, seed, last-10 return, episodes, s).

    With ``resume``, runs continue from their checkpoints bit for bit and
    finished ones are not run again (see :func:`plan_resume`).

    With ``workers > 1`` runs go to that many processes (spawned; never more
    than there are runs). Each run uses ``threads`` torch threads (default
    ``cpu_count // workers``). With ``progress``, stderr says at once what
    runs where, then each process shows the progress of the run it is on: on a
    terminal a tqdm bar on a line of its own, elsewhere (logs, CI) a plain
    line per run at its start, every 10% of its steps or 15 s, and at its end
    (see ``_common.Progress``); a pool adds a line as each run finishes.
    """
    jobs = plan_runs(algo, env_id, replays, seeds, steps, overrides)
    out = Path(out)
    plan: list[tuple[bool, int | None]] = [(False, None)] * len(jobs)
    finished: dict[int, tuple[str, int, float, int, float]] = {}
    if resume:
        plan, finished = plan_resume(algo, jobs, out, threads)
    # directories this call creates: removed again if a failure leaves them empty
    fresh = _new_dirs(out)
    for s in jobs:
        path = run_dir(out.absolute(), algo, s["env_id"], s["replay"], s["seed"])
        fresh += [d for d in (path, path.parent) if not d.exists()]
    out.mkdir(parents=True, exist_ok=True)
    try:
        todo = [i for i in range(len(jobs)) if i not in finished]
        if progress and finished:
            _say(f"--resume: {len(finished)} run(s) had finished already", None, False)
        results = _run_jobs(
            algo, [jobs[i] for i in todo], replays, out, workers, progress, threads,
            [plan[i] for i in todo],
        )  # fmt: skip
        order = {r: i for i, r in enumerate(replays)}
        return sorted([*results, *finished.values()], key=lambda r: (order[r[0]], r[1]))
    except BaseException:
        _remove_empty(fresh)
        raise


def _new_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet."""
    out = []
    p = path.absolute()
    while not p.exists() and p.parent != p:
        out.append(p)
        p = p.parent
    return out


def _remove_empty(dirs: Sequence[Path]) -> None:
    """Remove those of ``dirs`` that are empty, deepest first; keep everything else."""
    for d in sorted(set(dirs), key=lambda p: len(p.absolute().parts), reverse=True):
        try:
            d.rmdir()
        except OSError:  # not empty (a run wrote something: keep it), or never made
            pass


def _run_jobs(
    algo: str,
    jobs: list[dict[str, Any]],
    replays: Sequence[str],
    out: Path,
    workers: int,
    progress: bool,
    threads: int | None,
    plan: Sequence[tuple[bool, int | None]] | None = None,
) -> list[tuple[str, int, float, int, float]]:
    """Run ``jobs`` here (one worker) or in a pool of spawned processes; results in plan order.

    A pool's processes each take a terminal line for their bars (a slot from a
    queue, in the pool's initializer) and share one lock for drawing. If a run
    fails, runs not yet started are cancelled and the error is raised.
    """
    results: list[tuple[str, int, float, int, float]] = []
    if not jobs:
        return results
    plan = list(plan) if plan is not None else [(False, None)] * len(jobs)
    t0 = time.perf_counter()
    workers = max(1, min(workers, len(jobs)))
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // workers)
    order = {r: i for i, r in enumerate(replays)}
    from ._common import Progress  # numpy and fastper only

    tty = Progress.draws_bars()
    if progress:
        where = "one after another" if workers == 1 else f"in {workers} processes"
        how = "a bar per run" if tty else "a line per run every 10% of its steps or 15 s"
        _say(f"training {len(jobs)} run(s) of {algo} {where}; progress: {how}", None, tty)
    if workers == 1:
        for s, again in zip(jobs, plan, strict=True):
            results.append(_train_one(*_job_args(algo, s, out, progress, threads, again)))
        return sorted(results, key=lambda r: (order[r[0]], r[1]))
    ctx = multiprocessing.get_context("spawn")
    lock = ctx.RLock()  # tqdm's own lock is made in the default (fork) context: not shareable
    slots = ctx.Queue()
    for slot in range(workers):
        slots.put(slot)
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(slots, lock)
    ) as pool:
        futures = [
            pool.submit(_train_one, *_job_args(algo, s, out, progress, threads, again))
            for s, again in zip(jobs, plan, strict=True)
        ]
        try:
            for done, fut in enumerate(as_completed(futures), 1):
                r = fut.result()
                results.append(r)
                if progress:
                    _say(
                        f"[{done}/{len(jobs)} {time.perf_counter() - t0:6.0f}s] {algo} {r[0]} "
                        f"seed {r[1]}: last-10 return {r[2]:.1f} over {r[3]} episodes ({r[4]:.0f}s)",
                        lock,
                        tty,
                    )
        except BaseException:
            for fut in futures:  # do not start what is still queued
                fut.cancel()
            raise
    return sorted(results, key=lambda r: (order[r[0]], r[1]))


def _job_args(
    algo: str,
    settings: dict[str, Any],
    out: Path,
    progress: bool,
    threads: int,
    resume: tuple[bool, int | None],
) -> tuple[Any, ...]:
    """The arguments of :func:`_train_one` for one run (``resume`` only when it resumes)."""
    args: tuple[Any, ...] = (algo, settings, str(out), progress, threads)
    return (*args, resume) if resume[0] else args


def _init_worker(slots: Any, lock: Any) -> None:
    """Pool initializer: this process's terminal line for bars, and the shared drawing lock."""
    import queue

    from ._common import Progress

    try:
        slot = int(slots.get(timeout=10))
    except queue.Empty:  # more processes than slots (a replaced worker): share line 0
        slot = 0
    Progress.use_slot(slot, lock)


def _say(message: str, lock: Any | None, tty: bool) -> None:
    """One line on stderr from the main process, under the workers' bars' lock."""
    # on a terminal, clear what a bar drew on this line first
    text = ("\r\x1b[K" if tty else "") + message + "\n"
    if lock is None:
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    with lock:
        sys.stderr.write(text)
        sys.stderr.flush()
