"""Pieces the reference agents share: environments, replay construction, logging,
progress, evaluation.

Nothing here imports torch; the agents do. Gymnasium (and MinAtar) are imported
inside the functions that make environments.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..buffers import BaseBuffer
from .replay import (  # noqa: F401 - re-exported: the agents import them from here
    REPLAYS,
    agent_replay,
    check_options,
    check_replay,
    make_replay,
    phases_due,
    samples_by,
    vector_steps,
)
from .resume import ActionLog

NETWORKS = ("auto", "mlp", "cnn")
EPISODES_CSV = "episodes.csv"
EVALUATIONS_CSV = "evaluations.csv"
CONFIG_JSON = "config.json"
SUMMARY_JSON = "summary.json"  # written when a run finishes: marks it complete
MINATAR_HINT = "pip install 'fastper[minatar]'"


def register_env(env_id: str) -> None:
    """Make ``env_id`` known to Gymnasium when its package registers ids only on request.

    MinAtar registers its ``MinAtar/<Game>-v0|v1`` ids only when
    ``minatar.gym.register_envs()`` is called; this calls it once. Other ids
    are left to Gymnasium.

    Raises:
        ImportError: a ``MinAtar/`` id without the minatar package (one line
            with the install command).
    """
    if not env_id.startswith("MinAtar/"):
        return
    try:
        import minatar.gym
    except ImportError as exc:
        raise ImportError(f"{env_id} needs the minatar package ({exc}): {MINATAR_HINT}") from exc
    import gymnasium as gym

    if env_id not in gym.registry:
        minatar.gym.register_envs()


def make_env(env_id: str) -> Any:
    """One environment, ``gymnasium.make(env_id)`` (MinAtar ids registered first)."""
    import gymnasium as gym

    register_env(env_id)
    return gym.make(env_id)


def make_vec_env(env_id: str, num_envs: int) -> Any:
    """``num_envs`` copies of ``env_id`` stepped in this process, with autoreset off.

    A Gymnasium ``SyncVectorEnv`` in ``AutoresetMode.DISABLED``: the
    :class:`Collector` resets an env right after its episode ends
    (``reset(options={"reset_mask": done})``), so no ``envs.step`` is spent
    on Gymnasium's reset row and every row is a transition. With
    ``num_envs=1`` this steps and resets one environment exactly as
    ``gymnasium.make`` would.
    """
    import gymnasium as gym
    from gymnasium.vector import AutoresetMode

    register_env(env_id)
    return gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": AutoresetMode.DISABLED},
    )


def resolve_network(network: str, obs_shape: tuple[int, ...], env_id: str) -> str:
    """``"mlp"`` or ``"cnn"``: the Q-network ``network`` asks for, given the observations.

    ``"auto"`` is a CNN for 3-D (height, width, channels) observations such as
    MinAtar's, an MLP otherwise.

    Raises:
        ValueError: an unknown ``network``, or ``"cnn"`` for observations that
            are not 3-D.
    """
    if network not in NETWORKS:
        raise ValueError(f"`network` must be one of {list(NETWORKS)}, got network={network!r}")
    shape = tuple(obs_shape)
    if network == "auto":
        return "cnn" if len(shape) == 3 else "mlp"
    if network == "cnn" and len(shape) != 3:
        raise ValueError(
            f"`network`='cnn' needs 3-D (height, width, channels) observations, got shape "
            f"{shape} for {env_id}; use network='mlp' or 'auto'"
        )
    return network


@dataclass
class RunResult:
    """What one training run produced.

    Attributes:
        steps: environment steps taken (all envs together).
        episode_end_steps: the step count at the end of each episode.
        returns: each episode's undiscounted return.
        wall_s: wall-clock seconds of the run (evaluations included).
        out_dir: where its files went, if anywhere.
        eval_steps: the step count at each evaluation.
        eval_returns: each evaluation's episode returns, ``eval_episodes`` of them.
        eval_lengths: each evaluation's episode lengths.
    """

    steps: int
    episode_end_steps: list[int] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    out_dir: str | None = None
    eval_steps: list[int] = field(default_factory=list)
    eval_returns: list[list[float]] = field(default_factory=list)
    eval_lengths: list[list[int]] = field(default_factory=list)


class RunLogger:
    """Writes ``config.json``, ``episodes.csv``, ``evaluations.csv`` and ``summary.json``.

    ``episodes.csv`` has one row per finished training episode: ``step``
    (environment steps so far, all envs together), ``episode``, ``return``,
    ``length``, ``wall_s``. ``evaluations.csv`` (only when the config's
    ``eval_every`` > 0) has one row per evaluation episode: ``step`` (training
    environment steps when the evaluation ran), ``episode`` (1 ..
    ``eval_episodes`` within that evaluation), ``return``, ``length``.
    TensorBoard scalars go to ``tb/`` when tensorboard is installed.
    ``summary.json`` (steps, episodes, evaluations, the last evaluation's mean
    return, wall time) marks the run as finished.

    ``resume`` (the ``run`` part of a checkpoint, see :mod:`.resume`) reopens
    the logs of a stopped run instead: each CSV file is cut back to the byte
    length recorded at the checkpoint and appended to, the wall clock goes on
    from the checkpoint's ``wall_s``, and TensorBoard events after its step
    are purged.
    """

    def __init__(
        self,
        out_dir: str | Path | None,
        config: Any,
        meta: Mapping[str, Any],
        resume: Mapping[str, Any] | None = None,
    ) -> None:
        self.out_dir = None if out_dir is None else Path(out_dir)
        self._t0 = time.perf_counter()
        self._file = None
        self._writer: Any = None
        self._eval_file = None
        self._eval_writer: Any = None
        self._tb: Any = None
        self.result = RunResult(0, out_dir=None if out_dir is None else str(out_dir))
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        evaluates = getattr(config, "eval_every", 0) > 0
        if resume is None:
            record = {"config": asdict(config), **dict(meta)}
            (self.out_dir / CONFIG_JSON).write_text(json.dumps(record, indent=2, sort_keys=True))
            (self.out_dir / SUMMARY_JSON).unlink(missing_ok=True)
            self._file = open(self.out_dir / EPISODES_CSV, "w", newline="")  # noqa: SIM115
            self._writer = csv.writer(self._file)
            self._writer.writerow(["step", "episode", "return", "length", "wall_s"])
            if evaluates:
                self._eval_file = open(self.out_dir / EVALUATIONS_CSV, "w", newline="")  # noqa: SIM115
                self._eval_writer = csv.writer(self._eval_file)
                self._eval_writer.writerow(["step", "episode", "return", "length"])
        else:  # cut the logs back to the checkpoint: rows written after it come again
            self._t0 -= float(resume["wall_s"])
            sizes = resume["csv_bytes"]
            self._file = self._reopen(EPISODES_CSV, sizes)
            self._writer = csv.writer(self._file)
            if evaluates:
                self._eval_file = self._reopen(EVALUATIONS_CSV, sizes)
                self._eval_writer = csv.writer(self._eval_file)
        try:  # optional: TensorBoard logging when it is installed
            from torch.utils.tensorboard import SummaryWriter

            # on resume, drop the events logged after the checkpoint's step
            purge = None if resume is None else int(resume["step"]) + 1
            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tb"), purge_step=purge)
        except Exception:  # noqa: BLE001 - tensorboard missing or broken: CSV only
            self._tb = None

    def _reopen(self, name: str, sizes: Mapping[str, int]) -> Any:
        """``name`` truncated to its length at the checkpoint, open for appending."""
        from .resume import ResumeError

        path = Path(str(self.out_dir)) / name
        size = int(sizes.get(name, -1))
        have = path.stat().st_size if path.exists() else -1
        if size < 0 or have < size:
            raise ResumeError(
                f"cannot resume {self.out_dir}: {name} has {max(have, 0)} bytes, fewer than the "
                f"{max(size, 0)} its checkpoint recorded (the log was replaced or cut)"
            )
        os.truncate(path, size)
        return open(path, "a", newline="")  # noqa: SIM115

    def csv_bytes(self) -> dict[str, int]:
        """The byte length of each CSV log now (they are flushed after every row)."""
        out = {}
        for name, f in ((EPISODES_CSV, self._file), (EVALUATIONS_CSV, self._eval_file)):
            if f is not None:
                f.flush()
                out[name] = os.fstat(f.fileno()).st_size
        return out

    def wall_s(self) -> float:
        """Seconds of the run so far, over all its sittings."""
        return time.perf_counter() - self._t0

    def episode(self, step: int, ret: float, length: int) -> None:
        res = self.result
        res.episode_end_steps.append(int(step))
        res.returns.append(float(ret))
        if self._writer is not None and self._file is not None:
            wall = time.perf_counter() - self._t0
            self._writer.writerow([step, len(res.returns), f"{ret:.6g}", length, f"{wall:.3f}"])
            self._file.flush()  # episodes are rare: keep the log readable while running
        if self._tb is not None:
            self._tb.add_scalar("episode/return", ret, step)

    def evaluation(self, step: int, returns: list[float], lengths: list[int]) -> None:
        """Record one evaluation: its episodes' returns and lengths, at training step ``step``."""
        res = self.result
        res.eval_steps.append(int(step))
        res.eval_returns.append([float(r) for r in returns])
        res.eval_lengths.append([int(n) for n in lengths])
        if self._eval_writer is not None and self._eval_file is not None:
            for k, (ret, length) in enumerate(zip(returns, lengths, strict=True), 1):
                self._eval_writer.writerow([step, k, f"{ret:.6g}", length])
            self._eval_file.flush()
        if self._tb is not None and returns:
            self._tb.add_scalar("eval/return", float(np.mean(returns)), step)

    def scalar(self, name: str, value: float, step: int) -> None:
        if self._tb is not None:
            self._tb.add_scalar(name, value, step)

    def abandon(self) -> None:
        """Close the logs without marking the run finished (no ``summary.json``)."""
        for f in (self._file, self._eval_file):
            if f is not None:
                f.close()
        self._file = self._eval_file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def close(self, steps: int) -> RunResult:
        self.result.steps = int(steps)
        self.result.wall_s = time.perf_counter() - self._t0
        for f in (self._file, self._eval_file):
            if f is not None:
                f.close()
        self._file = self._eval_file = None
        if self.out_dir is not None:
            res = self.result
            summary: dict[str, Any] = {
                "steps": res.steps,
                "episodes": len(res.returns),
                "evaluations": len(res.eval_steps),
                "wall_s": round(res.wall_s, 3),
            }
            if res.eval_returns:
                summary["eval_return"] = round(float(np.mean(res.eval_returns[-1])), 6)
            (self.out_dir / SUMMARY_JSON).write_text(json.dumps(summary, indent=2))
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        return self.result


class Progress:
    """Progress of one run on stderr, drawn with tqdm: steps, rate, time left, recent return.

    On a terminal it is a tqdm bar on line :attr:`position` below the cursor;
    a worker process of a pool takes its own line with :meth:`use_slot`, so
    parallel runs each keep a bar. Anywhere else (a log file, a pipe, CI) it
    writes plain lines in tqdm's format instead of redrawing one: one when the
    run starts, then whenever another :attr:`line_every_frac` of the steps is
    done or :attr:`line_every_s` seconds have passed since the last line
    (whichever comes first), and one at the end. tqdm is imported only when
    ``enabled``. Cost: :meth:`update` is O(1) (a clock read) except on redraws,
    at most every :attr:`redraw_s` seconds.

    Args:
        total: steps in the run (the bar's 100%).
        desc: what runs, e.g. ``"dqn per seed 0"``; starts every line.
        enabled: False draws nothing.
    """

    #: the terminal line of this process's bars (0: the cursor's line); see use_slot
    position: int = 0
    #: keep a finished bar on screen (one process) or clear it for the next run (pools)
    leave: bool = True
    #: redraw no more often than this (seconds)
    redraw_s: float = 0.5
    #: off a terminal: a line each time another this fraction of the steps is done ...
    line_every_frac: float = 0.1
    #: ... or this many seconds after the last line, whichever comes first
    line_every_s: float = 15.0

    _LINE = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} steps [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.total = max(1, int(total))
        self.desc = desc
        self.enabled = enabled
        self._t0 = time.perf_counter()
        self._last = -math.inf  # last redraw
        self._last_line = self._t0  # last plain line
        self._next_frac = self.line_every_frac
        self._line_step = -1  # step of the last plain line
        self._bar: Any = None
        if not enabled:
            return
        from tqdm import tqdm  # extra `agents`; a worker's lock is set by use_slot

        if self.draws_bars():
            self._bar = tqdm(
                total=self.total, desc=desc, unit="step", file=sys.stderr,
                position=self.position, leave=self.leave, dynamic_ncols=True,
                mininterval=self.redraw_s, smoothing=0.1,
            )  # fmt: skip
        else:
            self._line(0, [])

    @staticmethod
    def draws_bars() -> bool:
        """Whether progress is drawn as bars: stderr is a terminal with a width.

        A pseudo-terminal that reports 0 columns gets plain lines (tqdm would
        draw nothing there).
        """
        if not sys.stderr.isatty():
            return False
        import os

        try:
            return os.get_terminal_size(sys.stderr.fileno()).columns > 0
        except (OSError, ValueError):  # a terminal without a size: let tqdm guess
            return True

    @classmethod
    def use_slot(cls, slot: int, lock: Any | None = None) -> None:
        """Draw this process's bars on terminal line ``slot``, cleared when a run ends.

        Called once in each worker process of a pool (``slot`` = 0 .. workers - 1),
        with a multiprocessing lock shared by the pool so bars are not drawn over
        each other (``tqdm.set_lock``).
        """
        cls.position = int(slot)
        cls.leave = False
        if lock is not None:
            from tqdm import tqdm

            tqdm.set_lock(lock)

    def update(self, step: int, returns: list[float], force: bool = False) -> None:
        """Show ``step`` with the mean of the last 10 ``returns``.

        Redraws at most every :attr:`redraw_s` seconds unless ``force``;
        ``force`` is the run's last call: it draws the final state and ends the
        bar (later calls draw nothing).
        """
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.redraw_s:
            return
        self._last = now
        step = min(int(step), self.total)
        if self._bar is not None:
            self._bar.set_postfix_str(self._recent(returns), refresh=False)
            self._bar.update(step - self._bar.n)
            if force:
                self._bar.close()
        else:
            frac = step / self.total
            due = frac >= self._next_frac or now - self._last_line >= self.line_every_s
            if (force and step != self._line_step) or due:
                self._line(step, returns)
                self._last_line = now
                done = math.floor(frac / self.line_every_frac + 1e-9)
                self._next_frac = (done + 1) * self.line_every_frac
        if force:
            self.enabled = False

    @staticmethod
    def _recent(returns: list[float]) -> str:
        return f"return(10) {float(np.mean(returns[-10:])):.1f}" if returns else ""

    def _line(self, step: int, returns: list[float]) -> None:
        from tqdm import tqdm

        text = tqdm.format_meter(
            step, self.total, time.perf_counter() - self._t0, prefix=self.desc, unit="step",
            postfix=self._recent(returns) or None, bar_format=self._LINE,
        )  # fmt: skip
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        self._line_step = step


def check_config(cfg: Any, positive: tuple[str, ...], fractions: tuple[str, ...] = ()) -> None:
    """Clear errors for hyperparameters out of range (called from ``__post_init__``)."""
    check_replay(cfg.replay)
    for name in positive:
        value = getattr(cfg, name)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"`{name}` must be > 0, got {name}={value!r}")
    for name in fractions:
        value = getattr(cfg, name)
        if not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ValueError(f"`{name}` must be in [0, 1], got {name}={value!r}")
    hidden = getattr(cfg, "hidden", ())
    if not isinstance(hidden, tuple | list) or not all(
        isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in hidden
    ):
        raise ValueError(
            "`hidden` must be a tuple of positive layer widths, e.g. hidden=(64, 64), "
            f"got hidden={hidden!r}"
        )
    if cfg.learning_starts < 0 or cfg.n_step < 1 or cfg.seed < 0:
        raise ValueError(
            "`learning_starts` and `seed` must be >= 0 and `n_step` >= 1, got "
            f"learning_starts={cfg.learning_starts}, seed={cfg.seed}, n_step={cfg.n_step}"
        )
    for name, low in (("num_envs", 1), ("eval_every", 0), ("eval_max_steps", 1)):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"`{name}` must be an integer >= {low}, got {name}={value!r}")
    every = getattr(cfg, "checkpoint_every", 0)
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ValueError(
            f"`checkpoint_every` must be an integer >= 0, got checkpoint_every={every!r}"
        )
    if cfg.total_steps < cfg.num_envs:
        raise ValueError(
            "`total_steps` must be >= num_envs (it counts the steps of all envs together), "
            f"got total_steps={cfg.total_steps}, num_envs={cfg.num_envs}"
        )
    episodes = cfg.eval_episodes
    if not isinstance(episodes, int) or isinstance(episodes, bool) or episodes < 0:
        raise ValueError(f"`eval_episodes` must be an integer >= 0, got eval_episodes={episodes!r}")
    if cfg.eval_every > 0 and episodes < 1:
        raise ValueError(
            "`eval_episodes` must be >= 1 when eval_every > 0 (set eval_every=0 to turn "
            f"evaluation off), got eval_episodes={episodes}, eval_every={cfg.eval_every}"
        )
    network = getattr(cfg, "network", "auto")
    if network not in NETWORKS:
        raise ValueError(f"`network` must be one of {list(NETWORKS)}, got network={network!r}")
    check_options(cfg)


def linear_epsilon(step: int, start: float, end: float, duration: int) -> float:
    """Exploration rate falling linearly from ``start`` to ``end`` over ``duration`` steps."""
    if duration <= 0 or step >= duration:
        return end
    return start + (end - start) * step / duration


def eval_seed(run_seed: int, evaluation: int, episode: int) -> int:
    """The reset seed of episode ``episode`` (0-based) of evaluation ``evaluation`` (0-based).

    Derived from the run's seed alone (a numpy ``SeedSequence`` of the three
    numbers), so evaluations repeat exactly; the seeds lie in [2^31, 2^32),
    apart from the training envs' seeds ``seed + i`` (for seeds below 2^31 -
    num_envs).
    """
    state = np.random.SeedSequence([0xE7A1, run_seed, evaluation, episode]).generate_state(1)
    return 2**31 + int(state[0]) % 2**31


def run_episodes(
    env: Any, policy: Callable[[np.ndarray], np.ndarray], seeds: list[int], max_steps: int
) -> tuple[list[float], list[int]]:
    """Play one episode per seed in ``env``; returns (returns, lengths). O(total length).

    ``policy`` maps a batch of observations (here one row) to one action per
    row. An episode ends when the environment ends it (its own time limit
    included) or after ``max_steps`` steps, whichever comes first.
    """
    returns, lengths = [], []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        ret, length, done = 0.0, 0, False
        while not done and length < max_steps:
            action = policy(np.asarray(obs)[None])[0]
            obs, reward, terminated, truncated, _ = env.step(action)
            ret += float(reward)
            length += 1
            done = bool(terminated or truncated)
        returns.append(ret)
        lengths.append(length)
    return returns, lengths


class Collector:
    """Steps ``num_envs`` environments together, stores transitions, logs, evaluates.

    Args:
        algo: agent name for the run's metadata and progress line.
        cfg: the agent's config (``env_id``, ``replay``, ``seed``,
            ``total_steps``, ``num_envs``, ``eval_every``, ``eval_episodes``,
            ``eval_max_steps``).
        envs: a vector env from :func:`make_vec_env` (autoreset off); env
            ``i`` is reset here with seed ``cfg.seed + i``.
        buffer: where the transitions go, one stream per env (``n_envs``).
        out_dir, progress: see :class:`RunLogger` and :class:`Progress`.

    ``obs`` is the batch of observations to act on (row ``i``: env ``i``);
    ``step(t, actions)`` takes one action per env and adds the rows ``obs,
    action, reward, next_obs, terminated, truncated`` (row ``i`` = env ``i``:
    the buffer keeps an n-step window per env). An env whose episode ended
    is reset at once, so every row is a transition (a truncated episode
    bootstraps, a terminated one does not: the buffer keeps both flags), and
    its return is logged with ``t``, the environment steps of all envs so far.

    Evaluation (``cfg.eval_every`` > 0): :meth:`maybe_evaluate` plays
    ``eval_episodes`` episodes with the given policy in a separate
    environment, reset with :func:`eval_seed` seeds, after every
    ``eval_every`` environment steps and at the end of the run. It uses
    neither the training envs nor any generator of training, so a run
    trains the same with or without it.

    Checkpoints (``cfg.checkpoint_every`` > 0 and ``out_dir``): the collector
    records every action it steps the envs with; :meth:`checkpoint` writes
    the buffer and the run state (the agent's :class:`.resume.AgentParts`
    and counters given by the agent, the rest its own). ``saved`` (from
    :func:`.resume.read`) rebuilds a stopped run: the envs are reset with the
    run's seeds and replayed through the recorded actions (checked against
    the saved observations), the logs reopened at their recorded lengths.
    """

    def __init__(
        self,
        algo: str,
        cfg: Any,
        envs: Any,
        buffer: BaseBuffer,
        out_dir: str | Path | None,
        progress: bool,
        saved: Any = None,
    ) -> None:
        from . import resume

        self.algo = algo
        self.cfg, self.envs, self.buffer = cfg, envs, buffer
        self.num_envs = int(cfg.num_envs)
        self.out_dir = None if out_dir is None else Path(out_dir)
        run = None if saved is None else saved.meta
        if self.out_dir is not None and saved is None:
            resume.clear(self.out_dir)  # a fresh start leaves no old checkpoint to resume
        meta = {"algo": algo, "env_id": cfg.env_id, "replay": cfg.replay, "seed": cfg.seed}
        self.log = RunLogger(out_dir, cfg, meta, resume=run)
        self.total = vector_steps(cfg) * self.num_envs
        self._bar = Progress(self.total, f"{algo} {cfg.replay} seed {cfg.seed}", progress)
        self.obs, _ = envs.reset(seed=cfg.seed)  # env i: seed + i
        envs.single_action_space.seed(cfg.seed)
        self.steps = 0
        self._returns = np.zeros(self.num_envs)
        self._lengths = np.zeros(self.num_envs, dtype=np.int64)
        self.eval_env = make_env(cfg.env_id) if cfg.eval_every > 0 else None
        self._last_eval = -1
        # every action given to the training envs, to rebuild them on resume (see resume)
        self.checkpoint_every = int(getattr(cfg, "checkpoint_every", 0))
        self._record = self.out_dir is not None and self.checkpoint_every > 0
        self._actions = ActionLog(vector_steps(cfg), envs.single_action_space)
        self.replay_s = 0.0
        if saved is not None:
            try:
                self._restore(saved)
            except BaseException:  # refused: close what was opened, write nothing
                if self.eval_env is not None:
                    self.eval_env.close()
                self.log.abandon()
                raise

    @property
    def iteration(self) -> int:
        """Vector steps taken so far (``steps // num_envs``)."""
        return self.steps // self.num_envs

    def checkpoint_state(
        self, agent: Any, counters: Mapping[str, Any], final: bool
    ) -> dict[str, Any]:
        """The run state a checkpoint holds besides the buffer (see :func:`.resume.collector_state`)."""
        from .resume import collector_state

        return collector_state(self, agent, counters, final)

    def checkpoint(self, agent: Any, counters: Mapping[str, Any], final: bool = False) -> None:
        """Write a checkpoint now (nothing without an output directory or with checkpoints off)."""
        if not self._record or self.out_dir is None:
            return
        from . import resume

        resume.write(
            self.out_dir, self.steps, self.checkpoint_state(agent, counters, final), self.buffer
        )

    def maybe_checkpoint(self, agent: Any, counters: Mapping[str, Any]) -> None:
        """Checkpoint if the last vector step passed a multiple of ``checkpoint_every`` steps."""
        from .resume import checkpoint_due

        if checkpoint_due(self.steps, self.num_envs, self.checkpoint_every):
            self.checkpoint(agent, counters)

    def _restore(self, saved: Any) -> None:
        from .resume import restore_collector

        restore_collector(self, saved)

    def random_actions(self) -> np.ndarray:
        """One uniformly random action per env, from the action space seeded with ``cfg.seed``."""
        space = self.envs.single_action_space
        return np.stack([np.asarray(space.sample()) for _ in range(self.num_envs)])

    def step(self, t: int, actions: Any) -> None:
        """One step of every env with ``actions``; ``t`` counts env steps after it (all envs)."""
        next_obs, rewards, terminated, truncated, _ = self.envs.step(actions)
        self.steps = t
        if self._record:
            self._actions.record(self.iteration - 1, np.asarray(actions))
        self.buffer.add(
            {
                "obs": self.obs,
                "action": actions,
                "reward": rewards,
                "next_obs": next_obs,
                "terminated": terminated,
                "truncated": truncated,
            }
        )
        self._returns += rewards
        self._lengths += 1
        self.obs = next_obs
        done = np.logical_or(terminated, truncated)
        if done.any():
            for i in np.flatnonzero(done):
                self.log.episode(t, float(self._returns[i]), int(self._lengths[i]))
            self._returns[done] = 0.0
            self._lengths[done] = 0
            self.obs, _ = self.envs.reset(options={"reset_mask": done})
        self._bar.update(t, self.log.result.returns)

    def maybe_evaluate(
        self, t: int, policy: Callable[[np.ndarray], np.ndarray], final: bool = False
    ) -> None:
        """Evaluate ``policy`` if step ``t`` passed a multiple of ``eval_every`` or ``final``.

        One evaluation per step count at most; ``final`` forces one at the
        run's last step unless one just ran there.
        """
        every = self.cfg.eval_every
        if self.eval_env is None or t == self._last_eval:
            return
        if not final and t // every == (t - self.num_envs) // every:
            return
        k = len(self.log.result.eval_steps)
        seeds = [eval_seed(self.cfg.seed, k, j) for j in range(self.cfg.eval_episodes)]
        returns, lengths = run_episodes(self.eval_env, policy, seeds, self.cfg.eval_max_steps)
        self.log.evaluation(t, returns, lengths)
        self._last_eval = t

    def close(self) -> RunResult:
        """Finish the progress line, close the environments and the logs."""
        self._bar.update(self.steps, self.log.result.returns, force=True)
        self.envs.close()
        if self.eval_env is not None:
            self.eval_env.close()
        return self.log.close(self.steps)
