"""Checkpoints of training runs, and resuming them bit for bit.

A run with ``checkpoint_every`` > 0 and an output directory writes, every
``checkpoint_every`` environment steps and at its end,
``<run>/checkpoints/step-<N>/`` with two files, both in fastper's pickle-free
checkpoint format (:mod:`fastper.checkpoint`: JSON header, raw numeric
arrays, SHA-256 digests, nothing unpickled on reading):

``buffer.fpk``
    the replay buffer, by ``buffer.save`` (contents, priorities, n-step
    windows, beta schedule position, the buffer's own generator).
``run.fpk``
    everything else: the config, the counters (iteration, environment steps,
    gradient steps, episodes, the last evaluation), every network's and
    optimiser's state as arrays, torch's generator state, the state of each
    numpy generator (exploration, evaluation, the action space's), the
    episode and evaluation results so far, the byte lengths of the CSV logs,
    and every action the training envs have been given.

Environments cannot be saved, so they are rebuilt: Gymnasium environments are
deterministic given their reset seeds and actions, and the training envs get
their seeds once (``seed + i``) and are otherwise reset without one, so making
them again, resetting them with the same seeds and replaying the recorded
actions (resetting an env where its episode ended, as in training) brings
each to the exact state it had; the observation reached is compared with the
saved one and a mismatch is an error (the env is not deterministic). Replay
costs one env step per recorded step, O(steps so far): CartPole and MinAtar
steps take microseconds, so a million steps replay in well under a minute,
small beside the hours they took to train. The actions are stored in the
smallest integer type that holds a Discrete space's actions (one byte a step
for MinAtar), floats as they were given.

Floating-point sums can depend on torch's thread count, so a run continues
bit for bit only with the thread count it ran with: the checkpoint records it
and ``fastper train --resume`` uses it (unless ``--threads`` is given).

A checkpoint is written into a temporary directory and renamed into place,
so a crash mid-write leaves the previous one whole; older checkpoints are
removed once a new one is in place. The CSV logs are append-only: on resume
they are cut back to the lengths recorded in the checkpoint, so rows written
after it (by a run that crashed later) are not repeated.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import fsync_dir, read_state, write_state
from ..errors import CheckpointError

SCHEMA = 1
CHECKPOINTS = "checkpoints"
RUN_FILE = "run.fpk"
BUFFER_FILE = "buffer.fpk"
_PREFIX = "step-"
_TMP = ".tmp"
#: config fields that may differ between sittings: they do not change what a run computes
FREE_FIELDS = ("checkpoint_every",)


class ResumeError(ValueError):
    """A run cannot be resumed: no checkpoint, another config, or a damaged checkpoint."""


def out_dir_of(out_dir: str | Path | None) -> Path:
    """``out_dir`` as a Path; resuming needs one (ValueError without)."""
    if out_dir is None:
        raise ValueError("`resume=True` needs the run's `out_dir`, got out_dir=None")
    return Path(out_dir)


def checkpoint_due(step: int, num_envs: int, every: int) -> bool:
    """Whether the vector step that brought the env-step count to ``step`` passed a multiple of ``every``."""
    return every > 0 and step // every != (step - num_envs) // every


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory of a run, or None. O(checkpoints)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    best: tuple[int, Path] | None = None
    for p in root.iterdir():
        name = p.name
        if not name.startswith(_PREFIX) or name.endswith(_TMP) or not p.is_dir():
            continue
        try:
            n = int(name[len(_PREFIX) :])
        except ValueError:
            continue
        if best is None or n > best[0]:
            best = (n, p)
    return None if best is None else best[1]


def clear(run_dir: str | Path) -> None:
    """Remove a run's checkpoints (a fresh start must not leave an old one to resume)."""
    shutil.rmtree(Path(run_dir) / CHECKPOINTS, ignore_errors=True)


def write(run_dir: str | Path, step: int, state: Mapping[str, Any], buffer: Any) -> Path:
    """Write checkpoint ``step-<step>`` of a run atomically; returns its directory. O(buffer + steps).

    Both files go into ``step-<step>.tmp`` first, which is renamed into place
    once they are on disk; then every other checkpoint of the run is removed.
    A checkpoint of the same step already in place is kept (the run is
    deterministic: it holds the same state).
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{int(step):012d}"
    if not final.exists():  # one there already (a finished run resumed) holds this state
        tmp = root / (final.name + _TMP)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        buffer.save(tmp / BUFFER_FILE)
        write_state(tmp / RUN_FILE, state)
        fsync_dir(tmp)
        tmp.rename(final)
        fsync_dir(root)
    for p in root.iterdir():
        if p != final:
            shutil.rmtree(p, ignore_errors=True)
    return final


@dataclass
class Saved:
    """A checkpoint read back: its directory, its run state and its buffer (loaded)."""

    path: Path
    state: dict[str, Any]
    buffer: Any = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> bool:
        """Whether the run had finished when this checkpoint was written."""
        return bool(self.meta.get("final"))


def config_record(config: Any) -> dict[str, Any]:
    """The config as the JSON values a checkpoint holds (tuples become lists)."""
    return dict(json.loads(json.dumps(asdict(config))))


def config_defaults(config: Any) -> dict[str, Any]:
    """The defaults of ``config``'s dataclass fields, as the JSON values a checkpoint holds."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return dict(json.loads(json.dumps(out)))


def config_differences(saved: Mapping[str, Any], config: Any) -> list[str]:
    """``name=saved (now)`` for each field of ``config`` that differs from the saved config.

    A field the saved config lacks (a checkpoint written before the field
    existed) counts as its default: such a run computed what the default
    computes, so it resumes with the field at its default and is refused
    with any other value.
    """
    now = config_record(config)
    defaults = config_defaults(config)
    old = {**{k: v for k, v in defaults.items() if k not in saved}, **saved}
    return [
        f"{k}={old.get(k, '<missing>')!r} (now {now.get(k, '<missing>')!r})"
        + (" (the checkpoint predates the field: its default)" if k not in saved else "")
        for k in sorted(now.keys() | old.keys())
        if k not in FREE_FIELDS and old.get(k, "<missing>") != now.get(k, "<missing>")
    ]


def read(run_dir: str | Path, algo: str, config: Any, load_buffer: bool = True) -> Saved:
    """Read a run's newest checkpoint and check it belongs to ``algo`` with ``config``.

    Raises:
        ResumeError: no checkpoint in ``run_dir``, one of another agent, one
            whose config differs (each differing field named), or a damaged file.
    """
    run_dir = Path(run_dir)
    path = latest(run_dir)
    if path is None:
        raise ResumeError(
            f"cannot resume {run_dir}: it holds no checkpoint ({CHECKPOINTS}/{_PREFIX}N/); "
            "start the run without --resume (checkpoint_every > 0 writes them)"
        )
    try:
        state, _ = read_state(path / RUN_FILE)
    except (CheckpointError, OSError) as exc:
        raise ResumeError(f"cannot resume {run_dir}: damaged checkpoint: {exc}") from None
    meta = state.get("run")
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        raise ResumeError(f"cannot resume {run_dir}: {path / RUN_FILE} is not a run checkpoint")
    if meta.get("algo") != algo:
        raise ResumeError(
            f"cannot resume {run_dir}: its checkpoint is of `{meta.get('algo')}`, not `{algo}`"
        )
    differ = config_differences(meta.get("config", {}), config)
    if differ:
        raise ResumeError(
            f"cannot resume {run_dir}: the config differs from its checkpoint's in "
            + ", ".join(differ)
            + "; give the settings of the original run"
        )
    saved = Saved(path, state, meta=meta)
    if load_buffer:
        from .. import load

        try:
            saved.buffer = load(path / BUFFER_FILE)
        except (CheckpointError, OSError, ValueError) as exc:
            raise ResumeError(
                f"cannot resume {run_dir}: damaged buffer checkpoint: {exc}"
            ) from None
    return saved


def verify(run_dir: str | Path, algo: str, config: Any) -> Saved:
    """:func:`read` without loading the buffer, but with its whole-file digest checked. O(files)."""
    from ..checkpoint import read_metadata

    saved = read(run_dir, algo, config, load_buffer=False)
    try:
        read_metadata(saved.path / BUFFER_FILE, verify=True)
    except (CheckpointError, OSError) as exc:
        raise ResumeError(f"cannot resume {run_dir}: damaged buffer checkpoint: {exc}") from None
    return saved


# ---------------------------------------------------------------------------
# torch and numpy state <-> checkpoint parts (arrays and JSON values)
# ---------------------------------------------------------------------------


def generator_state(gen: np.random.Generator) -> dict[str, Any]:
    return dict(gen.bit_generator.state)


def set_generator_state(gen: np.random.Generator, state: Mapping[str, Any]) -> None:
    gen.bit_generator.state = dict(state)


@dataclass
class AgentParts:
    """What of an agent a checkpoint holds: networks, optimisers, loose tensors, generators.

    Attributes:
        modules: name -> ``nn.Module`` (its ``state_dict``: parameters and buffers).
        optimizers: name -> ``torch.optim.Optimizer``.
        tensors: name -> a tensor kept outside modules (SAC's log temperature).
        generators: name -> ``np.random.Generator`` the agent draws from.
    """

    modules: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)
    generators: dict[str, np.random.Generator] = field(default_factory=dict)

    def state(self) -> dict[str, dict[str, Any]]:
        """The parts ``modules``, ``optim``, ``torch``: arrays (copies) and JSON values."""
        import torch

        modules = {
            f"{name}/{key}": _array(t)
            for name, m in self.modules.items()
            for key, t in m.state_dict().items()
        }
        optim: dict[str, Any] = {}
        for name, opt in self.optimizers.items():
            sd = opt.state_dict()
            optim[f"{name}/param_groups"] = json.loads(json.dumps(sd["param_groups"]))
            for pid, st in sd["state"].items():
                for key, v in st.items():
                    optim[f"{name}/state/{int(pid)}/{key}"] = (
                        _array(v) if isinstance(v, torch.Tensor) else v
                    )
        tens: dict[str, Any] = {f"tensor/{k}": _array(t) for k, t in self.tensors.items()}
        tens["rng/cpu"] = torch.get_rng_state().numpy().copy()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                tens[f"rng/cuda{i}"] = s.numpy().copy()
        tens["generators"] = {k: generator_state(g) for k, g in self.generators.items()}
        return {"modules": modules, "optim": optim, "torch": tens}

    def load(self, state: Mapping[str, Any]) -> None:
        """Put the parts of :meth:`state` back, torch's generator last. Exact (bit for bit)."""
        import torch

        modules = state["modules"]
        for name, m in self.modules.items():
            prefix = f"{name}/"
            sd = {
                k[len(prefix) :]: torch.from_numpy(v)
                for k, v in modules.items()
                if k.startswith(prefix)
            }
            m.load_state_dict(sd)
        optim = state["optim"]
        for name, opt in self.optimizers.items():
            groups = optim[f"{name}/param_groups"]
            per: dict[int, dict[str, Any]] = {}
            prefix = f"{name}/state/"
            for k, v in optim.items():
                if k.startswith(prefix):
                    pid, key = k[len(prefix) :].split("/", 1)
                    per.setdefault(int(pid), {})[key] = (
                        torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v
                    )
            opt.load_state_dict({"state": per, "param_groups": groups})
        tens = state["torch"]
        with torch.no_grad():
            for k, t in self.tensors.items():
                t.copy_(torch.from_numpy(tens[f"tensor/{k}"]))
        for k, g in self.generators.items():
            set_generator_state(g, tens["generators"][k])
        torch.set_rng_state(torch.from_numpy(tens["rng/cpu"]))
        cuda = sorted(k for k in tens if k.startswith("rng/cuda"))
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([torch.from_numpy(tens[k]) for k in cuda])


def _array(t: Any) -> np.ndarray:
    return np.array(t.detach().cpu().numpy(), copy=True)


def compact_dtype(action_space: Any) -> np.dtype[Any] | None:
    """The smallest integer dtype holding a Discrete space's actions; None for other spaces."""
    if type(action_space).__name__ != "Discrete":
        return None
    lo = int(getattr(action_space, "start", 0))
    return np.result_type(np.min_scalar_type(lo), np.min_scalar_type(lo + int(action_space.n) - 1))


def replay_envs(envs: Any, obs: Any, actions: np.ndarray) -> Any:
    """Step freshly reset ``envs`` through ``actions`` (one row per vector step) as training did.

    An env whose episode ends is reset (no seed, as ``Collector.step``
    does). Returns the observations reached. A ``SyncVectorEnv``'s envs are
    stepped one by one, which is what its ``step`` does in autoreset-off mode,
    without its per-step batching (several times faster); other vector envs
    are stepped whole. O(rows x envs) env steps.
    """
    subs = getattr(envs, "envs", None)
    if not isinstance(subs, list | tuple) or len(subs) != len(obs):
        for row in actions:
            obs, _, terminated, truncated, _ = envs.step(row)
            done = np.logical_or(terminated, truncated)
            if done.any():
                obs, _ = envs.reset(options={"reset_mask": done})
        return obs
    last = list(obs)
    for i, env in enumerate(subs):
        o = last[i]
        for a in actions[:, i]:
            o, _, terminated, truncated, _ = env.step(a)
            if terminated or truncated:
                o, _ = env.reset(options={})
        last[i] = o
    return np.stack([np.asarray(o) for o in last])


class ActionLog:
    """Every action a run gives its training envs: one row per vector step. O(1) per row.

    Rows are kept in a preallocated array of ``rows`` rows (the run's vector
    steps), Discrete actions in the smallest integer type that holds them
    (:func:`compact_dtype`), others in the dtype they came in. :attr:`dtype`
    is the dtype the actions came in, given back on replay.
    """

    def __init__(self, rows: int, action_space: Any) -> None:
        self._rows = int(rows)
        self._space = action_space
        self._data: np.ndarray | None = None
        self.dtype: str | None = None

    def record(self, i: int, actions: np.ndarray) -> None:
        """Keep ``actions`` as row ``i`` (0-based vector step)."""
        if self._data is None:
            self.dtype = actions.dtype.str
            small = compact_dtype(self._space)
            kind = small if small is not None and actions.dtype.kind in "iu" else actions.dtype
            self._data = np.zeros((self._rows, *actions.shape), dtype=kind)
        elif actions.dtype.str != self.dtype:
            raise TypeError(
                f"actions must keep one dtype through a run, got {actions.dtype} after {self.dtype}"
            )
        self._data[i] = actions

    def rows(self, n: int, num_envs: int) -> np.ndarray:
        """The first ``n`` rows (a contiguous copy for a checkpoint)."""
        if self._data is None:
            return np.zeros((0, num_envs), dtype=np.int8)
        return np.ascontiguousarray(self._data[:n])

    def restore(self, rows: np.ndarray, dtype: str | None) -> None:
        """Start from the rows of a checkpoint, recorded with actions of ``dtype``."""
        self.dtype = dtype
        self._data = np.zeros((self._rows, *rows.shape[1:]), dtype=rows.dtype)
        self._data[: len(rows)] = rows


def collector_state(
    col: Any, agent: AgentParts, counters: Mapping[str, Any], final: bool
) -> dict[str, Any]:
    """The state ``run.fpk`` holds: the collector's (``_common.Collector``) and the agent's.

    ``counters``: the agent's own (gradient steps); ``final``: the run has ended.
    """
    res = col.log.result
    n = col.iteration
    shape = (len(res.eval_steps), int(col.cfg.eval_episodes))
    evals = np.asarray(res.eval_returns, dtype=np.float64).reshape(shape)
    lens = np.asarray(res.eval_lengths, dtype=np.int64).reshape(shape)
    space = col.envs.single_action_space

    return {
        "run": {
            "schema": SCHEMA, "algo": col.algo, "config": config_record(col.cfg),
            "iteration": n, "step": col.steps, "final": bool(final),
            "last_eval": col._last_eval, "counters": dict(counters),
            "wall_s": col.log.wall_s(), "csv_bytes": col.log.csv_bytes(),
            "action_dtype": col._actions.dtype,
            "action_space_rng": generator_state(space.np_random),
            "torch_threads": _torch_threads(),
        },
        "collector": {
            "obs": np.array(col.obs), "returns": col._returns.copy(),
            "lengths": col._lengths.copy(), "actions": col._actions.rows(n, col.num_envs),
            "episode_steps": np.asarray(res.episode_end_steps, dtype=np.int64),
            "episode_returns": np.asarray(res.returns, dtype=np.float64),
            "eval_steps": np.asarray(res.eval_steps, dtype=np.int64),
            "eval_returns": evals, "eval_lengths": lens,
        },
        **agent.state(),
    }  # fmt: skip


def _torch_threads() -> int:
    import torch

    return int(torch.get_num_threads())


def restore_collector(col: Any, saved: Saved) -> None:
    """Bring a new ``_common.Collector`` to the state ``saved``: envs, counters, results.

    The envs (just reset with the run's seeds) replay the recorded actions;
    the observations reached must equal the saved ones. O(steps so far).

    Raises:
        ResumeError: the replay reached other observations (a nondeterministic env).
    """
    run, part = saved.meta, saved.state["collector"]
    n = int(run["iteration"])
    actions = part["actions"]
    dtype = np.dtype(run["action_dtype"]) if run["action_dtype"] else actions.dtype
    t0 = time.perf_counter()
    obs = replay_envs(col.envs, col.obs, actions[:n].astype(dtype, copy=False))
    col.replay_s = time.perf_counter() - t0
    saved_obs = part["obs"]
    if np.asarray(obs).shape != saved_obs.shape or not np.array_equal(obs, saved_obs):
        raise ResumeError(
            f"cannot resume {saved.path.parent.parent}: replaying the {n} recorded steps of "
            f"{col.cfg.env_id} did not reach the saved observations, so the environment is "
            "not deterministic given its seeds and actions and cannot be rebuilt exactly"
        )
    col.obs = saved_obs  # equal to what the envs reached, in the vector env's dtype
    col.steps = int(run["step"])
    col._returns = np.array(part["returns"], dtype=np.float64)
    col._lengths = np.array(part["lengths"], dtype=np.int64)
    col._last_eval = int(run["last_eval"])
    set_generator_state(col.envs.single_action_space.np_random, run["action_space_rng"])
    if n:
        col._actions.restore(actions[:n], run["action_dtype"])
    res = col.log.result
    res.episode_end_steps = [int(x) for x in part["episode_steps"]]
    res.returns = [float(x) for x in part["episode_returns"]]
    res.eval_steps = [int(x) for x in part["eval_steps"]]
    res.eval_returns = [[float(x) for x in row] for row in part["eval_returns"]]
    res.eval_lengths = [[int(x) for x in row] for row in part["eval_lengths"]]
    col._bar.update(col.steps, res.returns)
