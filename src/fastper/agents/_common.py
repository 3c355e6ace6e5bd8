"""Pieces the reference agents share: replay construction, logging, progress.

Nothing here imports torch; the agents do.
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import schedules
from ..buffers import PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer, _Buffer
from ..storage import FieldLike

REPLAYS = ("uniform", "per", "rank")
EPISODES_CSV = "episodes.csv"
CONFIG_JSON = "config.json"
SUMMARY_JSON = "summary.json"  # written when a run finishes: marks it complete


def check_replay(replay: Any) -> None:
    if replay not in REPLAYS:
        raise ValueError(f"`replay` must be one of {list(REPLAYS)}, got replay={replay!r}")


def make_replay(
    replay: str,
    capacity: int,
    fields: Mapping[str, FieldLike],
    *,
    alpha: float | None,
    beta0: float | None,
    anneal_samples: int,
    n_step: int = 1,
    gamma: float = 0.99,
    eps: float = 1e-6,
    seed: int | None = None,
) -> _Buffer:
    """A replay buffer of kind ``replay`` ("uniform", "per" or "rank").

    ``alpha`` / ``beta0`` default to the paper's choices for the kind
    (proportional 0.6 / 0.4, rank-based 0.7 / 0.5); beta rises linearly from
    ``beta0`` to 1 over ``anneal_samples`` calls to ``sample`` and stays at 1.
    """
    check_replay(replay)
    common: dict[str, Any] = {"n_step": n_step, "gamma": gamma, "seed": seed, "eps": eps}
    if replay == "uniform":
        return ReplayBuffer(capacity, fields, **common)
    cls: type[_Buffer] = PrioritizedReplayBuffer if replay == "per" else RankBasedReplayBuffer
    a = cls._default_alpha if alpha is None else alpha
    b0 = cls._default_beta if beta0 is None else beta0
    beta = schedules.linear(b0, 1.0, max(1, int(anneal_samples)))
    return cls(capacity, fields, alpha=a, beta=beta, **common)


def agent_replay(cfg: Any, env: Any) -> _Buffer:
    """The replay buffer an agent config asks for, with fields from ``env``'s spaces.

    Beta is annealed over every ``sample`` call of the run: one per gradient
    step, ``gradient_steps`` per training phase, a phase every ``train_freq``
    environment steps after ``learning_starts``.
    """
    from ..spaces import fields_from_spaces

    phases = max(0, cfg.total_steps - cfg.learning_starts) // cfg.train_freq
    return make_replay(
        cfg.replay,
        cfg.buffer_size,
        fields_from_spaces(env.observation_space, env.action_space),
        alpha=cfg.alpha,
        beta0=cfg.beta0,
        anneal_samples=phases * cfg.gradient_steps,
        n_step=cfg.n_step,
        gamma=cfg.gamma,
        eps=cfg.priority_eps,
        seed=cfg.seed,
    )


@dataclass
class RunResult:
    """What one training run produced.

    Attributes:
        steps: environment steps taken.
        episode_end_steps: the step count at the end of each episode.
        returns: each episode's undiscounted return.
        wall_s: wall-clock seconds of the run.
        out_dir: where its files went, if anywhere.
    """

    steps: int
    episode_end_steps: list[int] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    out_dir: str | None = None


class RunLogger:
    """Writes ``config.json``, ``episodes.csv`` and, at the end, ``summary.json``.

    ``episodes.csv`` has one row per finished episode: ``step`` (environment
    steps so far), ``episode``, ``return``, ``length``, ``wall_s``. TensorBoard
    scalars go to ``tb/`` when tensorboard is installed. ``summary.json``
    (steps, episodes, wall time) marks the run as finished.
    """

    def __init__(self, out_dir: str | Path | None, config: Any, meta: Mapping[str, Any]) -> None:
        self.out_dir = None if out_dir is None else Path(out_dir)
        self._t0 = time.perf_counter()
        self._file = None
        self._writer: Any = None
        self._tb: Any = None
        self.result = RunResult(0, out_dir=None if out_dir is None else str(out_dir))
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"config": asdict(config), **dict(meta)}
        (self.out_dir / CONFIG_JSON).write_text(json.dumps(record, indent=2, sort_keys=True))
        self._file = open(self.out_dir / EPISODES_CSV, "w", newline="")  # noqa: SIM115
        self._writer = csv.writer(self._file)
        self._writer.writerow(["step", "episode", "return", "length", "wall_s"])
        try:  # optional: TensorBoard logging when it is installed
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tb"))
        except Exception:  # noqa: BLE001 - tensorboard missing or broken: CSV only
            self._tb = None

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

    def scalar(self, name: str, value: float, step: int) -> None:
        if self._tb is not None:
            self._tb.add_scalar(name, value, step)

    def close(self, steps: int) -> RunResult:
        self.result.steps = int(steps)
        self.result.wall_s = time.perf_counter() - self._t0
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.out_dir is not None:
            summary = {
                "steps": self.result.steps,
                "episodes": len(self.result.returns),
                "wall_s": round(self.result.wall_s, 3),
            }
            (self.out_dir / SUMMARY_JSON).write_text(json.dumps(summary, indent=2))
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        return self.result


class Progress:
    """A one-line progress bar on stderr: steps, rate, recent return."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.total = max(1, int(total))
        self.desc = desc
        self.enabled = enabled
        self._t0 = time.perf_counter()
        self._last = 0.0

    def update(self, step: int, returns: list[float], force: bool = False) -> None:
        """Redraw (at most twice a second unless ``force``) with the mean of the last 10 returns."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.5:
            return
        self._last = now
        frac = min(1.0, step / self.total)
        width = 24
        filled = int(frac * width)
        rate = step / max(now - self._t0, 1e-9)
        left = (self.total - step) / rate if rate > 0 else math.inf
        ret = f" return(10) {float(np.mean(returns[-10:])):8.1f}" if returns else ""
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(
            f"\r{self.desc} [{bar}] {step}/{self.total} {rate:6.0f} steps/s eta {left:5.0f}s{ret}"
        )
        if force:
            sys.stderr.write("\n")
        sys.stderr.flush()


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


def linear_epsilon(step: int, start: float, end: float, duration: int) -> float:
    """Exploration rate falling linearly from ``start`` to ``end`` over ``duration`` steps."""
    if duration <= 0 or step >= duration:
        return end
    return start + (end - start) * step / duration


class Collector:
    """Steps one environment, stores every transition, logs episodes and progress.

    Args:
        algo: agent name for the run's metadata and progress line.
        cfg: the agent's config (``env_id``, ``replay``, ``seed``, ``total_steps``).
        env: the environment; reset here with ``cfg.seed``.
        buffer: where each transition goes.
        out_dir, progress: see :class:`RunLogger` and :class:`Progress`.

    ``obs`` is the observation to act on; ``step(t, action)`` takes the
    action, writes ``obs, action, reward, next_obs, terminated, truncated``
    and resets the environment at an episode's end (a truncated episode
    bootstraps, a terminated one does not: the buffer keeps both flags).
    """

    def __init__(
        self,
        algo: str,
        cfg: Any,
        env: Any,
        buffer: _Buffer,
        out_dir: str | Path | None,
        progress: bool,
    ) -> None:
        self.cfg, self.env, self.buffer = cfg, env, buffer
        meta = {"algo": algo, "env_id": cfg.env_id, "replay": cfg.replay, "seed": cfg.seed}
        self.log = RunLogger(out_dir, cfg, meta)
        self._bar = Progress(cfg.total_steps, f"{algo} {cfg.replay} seed {cfg.seed}", progress)
        self.obs, _ = env.reset(seed=cfg.seed)
        env.action_space.seed(cfg.seed)
        self._return, self._length = 0.0, 0

    def step(self, t: int, action: Any) -> None:
        """Environment step ``t`` (1-based) with ``action``."""
        next_obs, reward, terminated, truncated, _ = self.env.step(action)
        self.buffer.add(
            {
                "obs": self.obs,
                "action": action,
                "reward": reward,
                "next_obs": next_obs,
                "terminated": terminated,
                "truncated": truncated,
            }
        )
        self._return += float(reward)
        self._length += 1
        self.obs = next_obs
        if terminated or truncated:
            self.log.episode(t, self._return, self._length)
            self.obs, _ = self.env.reset()
            self._return, self._length = 0.0, 0
        self._bar.update(t, self.log.result.returns)

    def close(self) -> RunResult:
        """Finish the progress line, close the environment and the logs."""
        total = self.cfg.total_steps
        self._bar.update(total, self.log.result.returns, force=True)
        self.env.close()
        return self.log.close(total)
