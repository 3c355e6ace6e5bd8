"""Stable-Baselines3 replay buffers backed by a fastper prioritized buffer.

:class:`PrioritizedReplayBuffer` and :class:`DictPrioritizedReplayBuffer` have
the constructor, ``add`` / ``sample`` / ``size`` / ``reset`` / ``pos`` /
``full`` of SB3's ``ReplayBuffer`` and ``DictReplayBuffer`` (and subclass
them, so SB3's own checks accept them). Behind them, one fastper buffer
(proportional by default; rank-based or uniform on request) holds one row per
transition: an ``add`` of ``n_envs`` envs writes ``n_envs`` rows, and every
stored transition is drawn by its own priority, not "a step, then an env"
as in SB3.

What a sample holds: SB3's fields (``observations``, ``actions``,
``next_observations``, ``dones``, ``rewards``, ``discounts``) with SB3's
shapes, dtypes and device, plus ``weights`` (IS weights, float32, shape
``(batch_size, 1)`` like ``rewards`` and ``dones``, so ``weights * (q -
target) ** 2`` never broadcasts to ``(B, B)``), and ``indices`` / ``keys``
(numpy int64) for :meth:`PrioritizedReplayBuffer.update_priorities`.

SB3's public arrays (``observations``, ``next_observations``, ``actions``,
``rewards``, ``dones``, ``timeouts``; ``{key: array}`` observations for Dict
spaces) are views of the fastper storage with SB3's shapes ``(buffer_size,
n_envs, *shape)`` and dtypes, and ``pos`` / ``full`` are settable: rows
written through the arrays are admitted to the index when ``pos`` / ``full``
say they are stored, SB3's way to load offline data. One-step buffers only:
an n-step buffer stores n-step transitions, not SB3's rows.

beta lives in the fastper buffer: ``sample`` uses the fastper buffer's beta
schedule at its step (the count of ``sample`` calls), and setting
:attr:`PrioritizedReplayBuffer.beta` (as the PER algorithms do while they
anneal) replaces that schedule. So the buffer, its checkpoint files and
copies of its state all sample with the beta in force.

A prioritized buffer whose priorities are never updated does not replay by
priority (SB3's own algorithms never update them): after
:attr:`PrioritizedReplayBuffer.warn_unprioritized_after` samples without an
update, it says so once, with a ``UserWarning``.

Imported lazily: ``import fastper`` and ``import fastper.compat`` never import
this module, torch or stable-baselines3.
"""

from __future__ import annotations

import io
import math
import os
import pathlib
import shutil
import sys
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import numpy as np

try:
    import torch as th
    from gymnasium import spaces
    from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer
    from stable_baselines3.common.preprocessing import get_action_dim, get_obs_shape
    from stable_baselines3.common.utils import get_device
    from stable_baselines3.common.vec_env import VecNormalize
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastper.compat.sb3 needs stable-baselines3 (and torch, gymnasium): "
        "pip install 'fastper[sb3]'"
    ) from exc

from .. import buffers as _buffers
from .. import schedules as _sched
from .._validation import check_int, check_real
from ..buffer_state import read_metadata
from ..loading import load as _load_buffer
from ..storage import Field

__all__ = [
    "DictPrioritizedReplayBuffer",
    "DictPrioritizedReplayBufferSamples",
    "PrioritizedReplayBuffer",
    "PrioritizedReplayBufferSamples",
]

#: fastper buffer class of each ``scheme``
SCHEMES: dict[str, type[Any]] = {
    "proportional": _buffers.PrioritizedReplayBuffer,
    "rank": _buffers.RankBasedReplayBuffer,
    "uniform": _buffers.ReplayBuffer,
}
#: constructor arguments of the fastper buffer that this adapter sets itself
_RESERVED = ("capacity", "fields", "n_step", "n_envs", "autoreset", "nstep_keys", "storage")
PathOrFile = str | os.PathLike[str] | io.BufferedIOBase


class PrioritizedReplayBufferSamples(NamedTuple):
    """One minibatch: SB3's ``ReplayBufferSamples`` fields plus what PER needs.

    Attributes:
        observations: ``(B, *obs_shape)`` tensor, the observation space's dtype
            (float32 after VecNormalize).
        actions: ``(B, action_dim)`` tensor (Discrete: int64 ``(B, 1)``).
        next_observations: as ``observations``.
        dones: ``(B, 1)`` float32: 1 for a termination, 0 otherwise (a time-limit
            truncation is 0, so it bootstraps).
        rewards: ``(B, 1)`` float32 (with ``n_steps > 1``: the discounted n-step return).
        discounts: ``None`` for one-step buffers; with ``n_steps > 1`` a ``(B, 1)``
            float32 tensor, ``gamma^m`` for an m-step window (0 after a
            termination, where ``dones`` is 1 anyway).
        weights: ``(B, 1)`` float32 importance-sampling weights, the
            largest in the batch = 1 by default (the buffer's ``weight_norm``).
        indices: ``(B,)`` int64 numpy array of the slots drawn.
        keys: ``(B,)`` int64 numpy array: the insertion counter of each slot's
            occupant; pass it to ``update_priorities`` to drop stale updates.
    """

    observations: th.Tensor
    actions: th.Tensor
    next_observations: th.Tensor
    dones: th.Tensor
    rewards: th.Tensor
    discounts: th.Tensor | None
    weights: th.Tensor
    indices: np.ndarray
    keys: np.ndarray


class DictPrioritizedReplayBufferSamples(NamedTuple):
    """As :class:`PrioritizedReplayBufferSamples`, with ``{key: tensor}`` observations."""

    observations: dict[str, th.Tensor]
    actions: th.Tensor
    next_observations: dict[str, th.Tensor]
    dones: th.Tensor
    rewards: th.Tensor
    discounts: th.Tensor | None
    weights: th.Tensor
    indices: np.ndarray
    keys: np.ndarray


def _obs_field(space: spaces.Space, shape: tuple[int, ...]) -> Field:
    return Field(tuple(int(s) for s in shape), np.dtype(space.dtype))


def _flag(value: bool) -> np.ndarray:
    out = np.array([value])
    out.setflags(write=False)
    return out


#: one env's time-limit flag, False and True
_FLAGS = (_flag(False), _flag(True))
_NDARRAY = np.ndarray
_BOOL = np.dtype(np.bool_)
_FLOAT32 = np.dtype(np.float32)
#: the fields of a one-step buffer of one observation array, in the order add()
#: hands their values to the storage (a loaded file may hold them in another)
_SB3_ORDER = ("obs", "action", "reward", "next_obs", "done", "timeout")
_ONE = (1,)
#: the index that makes a flat (n_envs,) array of actions a column (n_envs, 1)
_COLUMN = (slice(None), None)


def _rows(name: str, value: Any, want: tuple[int, ...]) -> np.ndarray:
    """``value`` with shape ``want`` = (n_envs, *shape), a view where it can be; else a ValueError."""
    arr = value if type(value) is np.ndarray else np.asarray(value)
    if arr.shape == want:
        return arr
    if arr.size != math.prod(want):
        raise ValueError(
            f"`{name}` must hold n_envs={want[0]} values of shape {want[1:]}, got an array "
            f"of shape {arr.shape}"
        )
    return arr.reshape(want)


class PrioritizedReplayBuffer(ReplayBuffer):
    """SB3's ``ReplayBuffer`` API over a fastper prioritized buffer.

    A drop-in ``replay_buffer_class`` for SB3's off-policy algorithms. Plain
    SB3 algorithms ignore ``weights`` and never update priorities, so every
    transition keeps the priority it was stored with and replay is not by
    priority (uniform; rank-based: by slot order): use
    :class:`~fastper.compat.sb3.PERDQN`, :class:`~fastper.compat.sb3.PERSAC`,
    :class:`~fastper.compat.sb3.PERTD3`, or call :meth:`update_priorities`
    yourself. After :attr:`warn_unprioritized_after` samples (default 1000)
    with no update, a prioritized buffer whose priorities are all still
    equal warns once (``UserWarning``).

    Args:
        buffer_size: transitions held, all envs together (as in SB3:
            ``buffer_size // n_envs`` per env, at least 1).
        observation_space, action_space: the env's spaces (Box, Discrete,
            MultiDiscrete, MultiBinary; Dict observations:
            :class:`DictPrioritizedReplayBuffer`).
        device: torch device of the sampled tensors (``"auto"``: CUDA if present).
        n_envs: envs per ``add``.
        optimize_memory_usage: must be False (see Raises).
        handle_timeout_termination: as in SB3: ``infos[i]["TimeLimit.truncated"]``
            marks a time-limit truncation, which is stored as not done (it
            bootstraps); False: every ``done`` is a termination.
        alpha: priority exponent, number or ``fastper.schedules`` schedule
            (default: proportional 0.6, rank 0.7).
        beta: IS exponent. A number (default: proportional 0.4, rank 0.5) is
            where the PER algorithms start annealing to 1 over ``learn()``; a
            ``fastper.schedules`` schedule (counted in ``sample`` calls) is
            used as given and not annealed. Either way it is the fastper
            buffer's beta schedule, the one source of the beta ``sample`` uses.
        eps: added to |td| so that no priority is zero (default 1e-6).
        clip: optional cap on |td| before ``eps``.
        weight_norm: what the IS weights are divided by so that the largest
            is 1: ``"batch"`` (default: the largest weight in the batch),
            ``"buffer"`` (the largest over the whole buffer, as in the PER
            paper) or ``"none"``. The default differs from fastper's own
            buffers (``"buffer"``): the buffer-wide largest weight belongs to
            the transition of smallest priority; at beta = 1 it is
            ``(p_typical / p_min) ** alpha`` times a typical weight (about
            4,000 for p_min = eps = 1e-6, |td| near 1, alpha 0.6), and every
            batch's loss shrinks by that factor. With SB3's default DQN
            hyper-parameters PERDQN then learned far less than SB3's DQN,
            and with ``"batch"`` about as well (the SB3 results page).
        scheme: ``"proportional"`` (default), ``"rank"`` or ``"uniform"``
            (uniform draws, weights 1: SB3's buffer, plus priorities kept).
        n_steps, gamma: n-step returns, computed as transitions arrive, per
            env (fastper's per-stream windows; truncations bootstrap,
            terminations do not). ``n_steps > 1`` adds ``discounts`` to samples.
        seed: seed of the buffer's generator; ``None`` draws one from numpy's
            global generator, which SB3 seeds from the algorithm's ``seed``,
            so seeded runs are reproducible.
        **fastper_kwargs: passed to the fastper buffer (``max_priority``,
            ``stratified``, ``priority_noise``, ``sort_every``, ...).

    Costs: ``add`` is O(n_envs log N) (one vectorised fastper add, plus SB3's
    scan of ``infos`` for time limits); ``sample`` O(B log N) plus the gather
    and the copy to ``device``; ``update_priorities`` O(B log N). Memory:
    SB3's arrays (observations twice, as SB3 without
    ``optimize_memory_usage``; actions; float32 reward, done and timeout;
    n-step buffers: two bool flags, terminated and truncated, and a float32
    discount instead of done and timeout) plus about 18 bytes per slot of
    priorities and trees (rank-based: see ``fastper.samplers.RankSampler``);
    rows of up to 256 bytes are one record each, padded by at most 1/8
    (:func:`fastper.storage.default_layout`).

    Raises:
        ValueError: ``optimize_memory_usage=True``, a Dict observation space
            (use :class:`DictPrioritizedReplayBuffer`), an unknown ``scheme``
            or ``weight_norm``, bad fastper arguments.
        TypeError: an argument this class sets itself (``capacity``,
            ``fields``, ``n_envs``...) or an unknown keyword.
    """

    _dict_obs: ClassVar[bool] = False
    #: samples without any priority update after which a prioritized buffer
    #: warns, once, that it is not replaying by priority
    warn_unprioritized_after: int = 1000

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        alpha: _sched.ScheduleLike | None = None,
        beta: _sched.ScheduleLike | None = None,
        eps: float = 1e-6,
        clip: float | None = None,
        weight_norm: str = "batch",
        scheme: str = "proportional",
        n_steps: int = 1,
        gamma: float = 0.99,
        seed: int | None = None,
        **fastper_kwargs: Any,
    ) -> None:
        if optimize_memory_usage:
            raise ValueError(
                "`optimize_memory_usage` must be False for a prioritized buffer, got "
                "optimize_memory_usage=True: SB3's memory-saving layout reads a "
                "transition's next observation from the following row, which a buffer "
                "that samples and overwrites slots one transition at a time cannot "
                "rely on. Pass optimize_memory_usage=False (next observations are stored)"
            )
        is_dict = isinstance(observation_space, spaces.Dict)
        if is_dict != self._dict_obs:
            want = "DictPrioritizedReplayBuffer" if is_dict else "PrioritizedReplayBuffer"
            raise ValueError(
                f"`observation_space` {observation_space} needs {want}, not {type(self).__name__}"
            )
        if scheme not in SCHEMES:
            raise ValueError(f"`scheme` must be one of {list(SCHEMES)}, got scheme={scheme!r}")
        reserved = [k for k in _RESERVED if k in fastper_kwargs]
        if reserved:
            raise TypeError(
                f"`{reserved[0]}` is set by {type(self).__name__} from SB3's arguments "
                "(buffer_size, the spaces, n_envs, n_steps) and cannot be passed"
            )
        n_envs = check_int("n_envs", n_envs, minimum=1)
        n_steps = check_int("n_steps", n_steps, minimum=1)
        buffer_size = check_int("buffer_size", buffer_size, minimum=1)
        if n_steps > 1 and is_dict:
            raise ValueError(
                f"`n_steps` must be 1 with a Dict observation space, got n_steps={n_steps} "
                "(as in SB3: n-step windows keep one next-observation field)"
            )
        # BaseBuffer's attributes, set here: its __init__ would assign `pos` and
        # `full`, which this class derives from the fastper ring
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs_shape = get_obs_shape(observation_space)  # type: ignore[assignment]
        self.action_dim = get_action_dim(action_space)
        self.device = get_device(device)
        self.n_envs = n_envs
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = False
        self.handle_timeout_termination = bool(handle_timeout_termination)
        self.n_steps = n_steps
        self.gamma = check_real("gamma", gamma, minimum=0.0, maximum=1.0)

        # (field suffix, dict key or None, per-row shape) of each observation part
        obs_shapes: Mapping[str | None, tuple[int, ...]] = (
            dict(self.obs_shape) if is_dict else {None: tuple(self.obs_shape)}  # type: ignore[arg-type]
        )
        self._obs_parts = tuple(
            ("" if key is None else f".{key}", key, tuple(int(s) for s in shape))
            for key, shape in obs_shapes.items()
        )
        obs_fields = {
            suffix: _obs_field(
                observation_space if key is None else observation_space[key],  # type: ignore[index]
                shape,
            )
            for suffix, key, shape in self._obs_parts
        }
        action_dtype = self._maybe_cast_dtype(action_space.dtype)
        fields: dict[str, Field] = {f"obs{s}": f for s, f in obs_fields.items()}
        fields["action"] = Field((self.action_dim,), np.dtype(action_dtype))
        fields["reward"] = Field((), np.dtype(np.float32))
        fields.update({f"next_obs{s}": f for s, f in obs_fields.items()})
        if n_steps == 1:
            # SB3's own columns: the raw done flag and the time-limit flag, float32
            # (so that `dones` / `timeouts` are views of them, in SB3's dtype)
            fields["done"] = Field((), np.dtype(np.float32))
            fields["timeout"] = Field((), np.dtype(np.float32))
        else:
            # the n-step windows end on a termination and bootstrap after a truncation
            fields["terminated"] = Field((), np.dtype(np.bool_))
            fields["truncated"] = Field((), np.dtype(np.bool_))
        self._fields = fields

        if seed is None:
            # SB3 seeds numpy's global generator from the algorithm's seed first
            seed = int(np.random.randint(0, 2**31 - 1))  # noqa: NPY002 - SB3's generator
        nstep_args: dict[str, Any] = (
            {"n_step": n_steps, "gamma": self.gamma, "n_envs": n_envs} if n_steps > 1 else {}
        )
        self._buffer: Any = SCHEMES[scheme](
            self.buffer_size * n_envs, fields, alpha=alpha, beta=beta, eps=eps, clip=clip,
            seed=seed, **nstep_args, **self._norm_arg(scheme, weight_norm), **fastper_kwargs,
        )  # fmt: skip
        schedule = _sched.as_schedule("beta", self._buffer.beta if beta is None else beta)
        self._beta_given: Any = schedule  # what `beta = None` goes back to
        self._beta_start: float | None = (
            float(schedule(0)) if isinstance(schedule, _sched.Constant) else None
        )
        # samples since construction while no priority was ever updated (see sample)
        self._unprioritized_samples = 0
        self._watch_priorities = scheme != "uniform"
        self._no_timeouts = np.zeros(n_envs, dtype=np.bool_)
        self._no_timeouts.setflags(write=False)  # (shared by every add: read only)
        # what add() checks every row against: (field, next field, dict key, (n_envs, *shape))
        self._obs_rows = tuple(
            (f"obs{suffix}", f"next_obs{suffix}", key, (n_envs, *shape))
            for suffix, key, shape in self._obs_parts
        )
        self._action_rows = (n_envs, self.action_dim)
        self._n_rows = (n_envs,)
        # (n_envs, *obs shape) of one observation array (not a Dict space): add()'s
        # most frequent call, whose arrays have exactly the shapes stored
        self._plain_rows = None if is_dict else (n_envs, *self.obs_shape)
        # the dtypes of that call's arrays that need no cast (add's fastest way), and
        # the field order that way writes in
        self._obs_dtype = None if is_dict else fields["obs"].dtype
        self._action_dtype = fields["action"].dtype
        self._exact_order = not is_dict and n_steps == 1
        if self._exact_order:
            assert tuple(fields) == _SB3_ORDER
        # one-dimensional actions SB3's algorithms pass (DQN: Discrete as (n_envs,))
        self._flat_actions = (n_envs,) if self.action_dim == 1 else None
        # what add()'s first test checks a vector step of the stored dtypes against:
        # (obs rows, obs dtype, action dtype, action rows, flat action rows, (n_envs,))
        self._vector_exact = (
            (self._plain_rows, self._obs_dtype, self._action_dtype, self._action_rows,
             self._flat_actions, self._n_rows)
            if self._exact_order and n_envs > 1
            else None
        )  # fmt: skip

    @staticmethod
    def _norm_arg(scheme: str, weight_norm: str) -> dict[str, str]:
        """``weight_norm`` for the fastper buffer (the uniform one has no IS weights)."""
        if weight_norm not in ("batch", "buffer", "none"):
            raise ValueError(
                "`weight_norm` must be one of ['batch', 'buffer', 'none'], got "
                f"weight_norm={weight_norm!r}"
            )
        return {} if scheme == "uniform" else {"weight_norm": weight_norm}

    # -- the ring, as SB3 sees it --------------------------------------------------
    @property
    def fastper_buffer(self) -> Any:
        """The fastper buffer behind this one (its ``sample``, ``priorities``, ``save``...)."""
        return self._buffer

    @property
    def scheme(self) -> str:
        """``"proportional"``, ``"rank"`` or ``"uniform"``."""
        return str(self._buffer.scheme)

    def _cursor(self) -> int:
        """The next slot written. O(1)."""
        return self._buffer.cursor

    @property
    def pos(self) -> int:
        """The next row (one slot per env) written: ``cursor // n_envs``, as SB3's ``pos``. O(1).

        One-step buffers write one row per ``add``, exactly as SB3 does; with
        n-step windows an ``add`` writes the transitions it completes, so
        ``pos`` follows the stored transitions, not the ``add`` calls.

        Settable (one-step buffers), as SB3's attribute is, to load rows
        written straight into the public arrays (:attr:`observations`...):
        rows ``0 .. pos - 1`` (every row once :attr:`full`) are then stored,
        and the rows this admits get the new-transition priority
        (``max_priority``) and new keys, as if ``add`` had written them.
        Moving ``pos`` forward on a buffer that is not full admits only the
        rows passed, O(k log N), and keeps every other priority; becoming
        full admits every row not yet stored, then rows ``0 .. pos - 1``
        again (the ring passes them to stop at ``pos``); on a full buffer,
        moving ``pos`` forward re-admits the rows passed; any other change
        (``pos`` moved back, ``full = False``) drops every priority and
        admits the rows kept, O(N log N).

        Raises:
            ValueError: ``pos`` outside ``[0, buffer_size)``, or an n-step buffer.
        """
        return self._cursor() // self.n_envs

    @pos.setter
    def pos(self, value: int) -> None:
        self._move_ring(value, self.full)

    @property
    def full(self) -> bool:
        """Whether every slot holds a transition. O(1).

        Settable (one-step buffers), as SB3's attribute is: ``full = True``
        admits every row (at the new-transition priority), ``full = False``
        keeps only rows ``0 .. pos - 1``.
        """
        return len(self._buffer) == self._buffer.capacity

    @full.setter
    def full(self, value: bool) -> None:
        self._move_ring(self.pos, value)

    def _move_ring(self, pos: Any, full: Any) -> None:
        """Make the stored rows SB3's ``[0, pos)`` (every row if ``full``), next row ``pos``.

        Checks everything first: a refused value changes nothing.
        """
        self._refuse_nstep_arrays("setting `pos` / `full`")
        if isinstance(full, np.bool_) or type(full) is bool:
            full = bool(full)
        else:
            raise TypeError(f"`full` must be a bool, got {full!r} ({type(full).__name__})")
        n_rows = self.buffer_size
        pos = check_int("pos", pos, minimum=0)
        if pos >= n_rows:
            raise ValueError(
                f"`pos` must be in [0, buffer_size) = [0, {n_rows}) (rows of n_envs={self.n_envs} "
                f"slots), got pos={pos}; to mark every row as stored set `full = True`"
            )
        fb = self._buffer
        cap, e = fb.capacity, self.n_envs
        old_pos, old_full = self.pos, self.full
        if (pos, full) == (old_pos, old_full):
            return
        if not old_full and not full and pos > old_pos:
            fb.adopt((pos - old_pos) * e)
        elif not old_full and full:
            fb.adopt(cap - old_pos * e)  # every row stored, the ring back at row 0
            fb.adopt(pos * e)
        elif old_full and full:
            fb.adopt(((pos - old_pos) * e) % cap)
        else:  # fewer rows stored than now
            fb.clear()
            fb.adopt(pos * e)

    # -- SB3's public arrays: views of the fastper storage -------------------------
    def _column(self, name: str) -> np.ndarray:
        """Field ``name`` of the storage as SB3 lays it out: ``(buffer_size, n_envs, *shape)``, a view."""
        self._refuse_nstep_arrays(f"the public array for {name!r}")
        columns = getattr(self._buffer.storage, "columns", None)
        if columns is None:
            raise TypeError(
                f"the public arrays need fastper's in-memory storage, got "
                f"{type(self._buffer.storage).__name__}"
            )
        col = columns[name]
        view = col.reshape(self.buffer_size, self.n_envs, *col.shape[1:])
        assert np.shares_memory(view, col)
        return view

    def _set_column(self, name: str, value: Any) -> None:
        view = self._column(name)
        arr = np.asarray(value)
        if arr.shape != view.shape:
            raise ValueError(
                f"`{name}` must have shape {view.shape} (buffer_size, n_envs, *shape) as SB3's "
                f"array, got {arr.shape}; or write into it: buffer.<array>[:n] = rows"
            )
        if not np.can_cast(arr.dtype, view.dtype, casting="same_kind"):
            raise TypeError(f"`{name}` holds {view.dtype}, got an array of {arr.dtype}")
        view[...] = arr

    def _refuse_nstep_arrays(self, what: str) -> None:
        if self.n_steps > 1:
            raise ValueError(
                f"{what} needs a one-step buffer (n_steps=1), got n_steps={self.n_steps}: an "
                "n-step buffer stores n-step transitions (discounted returns, the observation "
                "n steps on, a discount), not SB3's one-step rows. Read them with "
                "buffer.fastper_buffer (its storage and sample), or build the buffer with "
                "n_steps=1 to load rows through the arrays"
            )

    def _obs_view(self, prefix: str) -> Any:
        if not self._dict_obs:
            return self._column(prefix)
        return {str(key): self._column(prefix + suffix) for suffix, key, _ in self._obs_parts}

    def _set_obs(self, prefix: str, value: Any) -> None:
        if not self._dict_obs:
            self._set_column(prefix, value)
            return
        keys = [str(key) for _, key, _ in self._obs_parts]
        if not isinstance(value, Mapping) or sorted(value) != sorted(keys):
            raise ValueError(f"`observations` of a Dict space must be a dict with keys {keys}")
        for suffix, key, _ in self._obs_parts:
            self._set_column(prefix + suffix, value[str(key)])

    @property
    def observations(self) -> Any:
        """SB3's ``observations``: ``(buffer_size, n_envs, *obs_shape)``, a view of the storage.

        Dict spaces: ``{key: array}``. Writes go to the stored rows (admit new
        rows by setting :attr:`pos` / :attr:`full`). One-step buffers only.
        """
        return self._obs_view("obs")

    @observations.setter
    def observations(self, value: Any) -> None:
        self._set_obs("obs", value)

    @property
    def next_observations(self) -> Any:
        """SB3's ``next_observations``, as :attr:`observations`: a view of the storage."""
        return self._obs_view("next_obs")

    @next_observations.setter
    def next_observations(self, value: Any) -> None:
        self._set_obs("next_obs", value)

    @property
    def actions(self) -> np.ndarray:
        """SB3's ``actions``: ``(buffer_size, n_envs, action_dim)`` (float64 stored as float32), a view."""
        return self._column("action")

    @actions.setter
    def actions(self, value: Any) -> None:
        self._set_column("action", value)

    @property
    def rewards(self) -> np.ndarray:
        """SB3's ``rewards``: ``(buffer_size, n_envs)`` float32, a view of the storage."""
        return self._column("reward")

    @rewards.setter
    def rewards(self, value: Any) -> None:
        self._set_column("reward", value)

    @property
    def dones(self) -> np.ndarray:
        """SB3's ``dones``: ``(buffer_size, n_envs)`` float32, 1 at an episode end, a view.

        As in SB3, a time-limit end is 1 here and 1 in :attr:`timeouts`:
        samples report ``dones * (1 - timeouts)``.
        """
        return self._column("done")

    @dones.setter
    def dones(self, value: Any) -> None:
        self._set_column("done", value)

    @property
    def timeouts(self) -> np.ndarray:
        """SB3's ``timeouts``: ``(buffer_size, n_envs)`` float32, 1 at a time-limit end, a view.

        Written by ``add`` only with ``handle_timeout_termination`` (else 0), as in SB3.
        """
        return self._column("timeout")

    @timeouts.setter
    def timeouts(self, value: Any) -> None:
        self._set_column("timeout", value)

    @property
    def beta(self) -> float:
        """The IS exponent the next ``sample`` uses: the fastper buffer's beta at its step. O(1).

        Settable: a number replaces the fastper buffer's beta schedule with
        that constant (so its checkpoints and copies of its state use it
        too); ``None`` restores the beta this buffer was built with.
        """
        return float(self._buffer.beta)

    @beta.setter
    def beta(self, value: float | None) -> None:
        if value is None:
            self._buffer.set_beta(self._beta_given)
        else:
            self._buffer.set_beta(check_real("beta", value, minimum=0.0))

    @property
    def beta_start(self) -> float | None:
        """The constant beta given (the annealing start), or ``None`` for a beta schedule."""
        return self._beta_start

    # -- add ------------------------------------------------------------------------
    def add(
        self,
        obs: np.ndarray | dict[str, np.ndarray],
        next_obs: np.ndarray | dict[str, np.ndarray],
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        """Store one step of every env: ``n_envs`` transitions. O(n_envs log N).

        Arguments as SB3's ``ReplayBuffer.add`` (leading dimension ``n_envs``).
        A done env whose ``infos[i]["TimeLimit.truncated"]`` is true is stored
        as truncated, not terminated (with ``handle_timeout_termination``).

        Raises:
            ValueError, TypeError: arrays of the wrong size or dtype, ``infos``
                of the wrong length; the buffer is left unchanged.
        """
        vector = self._vector_exact
        if (
            vector is not None
            and type(obs) is _NDARRAY
            and type(next_obs) is _NDARRAY
            and type(action) is _NDARRAY
            and type(reward) is _NDARRAY
            and type(done) is _NDARRAY
        ):
            # The most frequent vector step, first: arrays of the stored dtypes and of
            # exactly the shapes SB3's VecEnv gives (the actions also flat, as SB3's DQN
            # passes Discrete ones), bool dones, no env at its time limit. The values
            # go to the storage in its field order, with no dict and no per-field
            # match. Anything else takes the ways below, which store the same rows.
            plain, obs_dtype, action_dtype, action_rows, flat, n_rows = vector
            if (
                obs.dtype is obs_dtype
                and next_obs.dtype is obs_dtype
                and action.dtype is action_dtype
                and reward.dtype is _FLOAT32
                and done.dtype is _BOOL
                and obs.shape == plain
                and next_obs.shape == plain
                and reward.shape == n_rows
                and done.shape == n_rows
                and ((acts := action.shape) == action_rows or acts == flat)
            ):
                timeouts: np.ndarray | None = self._no_timeouts
                if self.handle_timeout_termination:
                    if len(infos) != n_rows[0]:
                        timeouts = None  # (refused below, by name)
                    else:
                        # (_timeouts without its call or its list while every env
                        # answers False, as on most steps; each info is read once)
                        i = 0
                        for info in infos:
                            flag = info.get("TimeLimit.truncated", False)
                            if flag is not False:
                                timeouts = self._timeouts_from(infos, i, flag)
                                break
                            i += 1
                if timeouts is not None:
                    # (flat actions as they are: the storage takes them so, see
                    # DirectRows.exact_putter)
                    values: list[Any] = [obs, action, reward, next_obs, done, timeouts]
                    if (
                        timeouts is not self._no_timeouts and timeouts.shape != n_rows
                    ) or not self._buffer._add_exact(values, n_rows[0], _SB3_ORDER):
                        # (flags of another shape, which the general add refuses by
                        # name, or a buffer not in its common state: the general add,
                        # with the flags read above, as each info is read once)
                        if acts != action_rows:
                            action = action[_COLUMN]  # (n_envs,) -> (n_envs, 1), a view
                        row = {"obs": obs, "next_obs": next_obs, "action": action, "reward": reward}
                        self._add_rows(row, done, infos, timeouts)
                    return
        plain = self._plain_rows
        n_rows = self._n_rows
        if (
            plain is not None
            and type(obs) is _NDARRAY
            and obs.shape == plain
            and type(next_obs) is _NDARRAY
            and next_obs.shape == plain
            and type(action) is _NDARRAY
            and ((acts := action.shape) == self._action_rows or acts == self._flat_actions)
            and type(reward) is _NDARRAY
            and reward.shape == n_rows
            and (rewards := reward.dtype).kind in "fiub"  # (numbers: others are refused below)
            and type(done) is _NDARRAY
            and done.dtype is _BOOL
            and done.shape == n_rows
            and (not self.handle_timeout_termination or len(infos) == self.n_envs)
        ):
            # Arrays of exactly the shapes SB3's VecEnv gives (one-dimensional actions:
            # SB3's DQN passes Discrete actions as (n_envs,)), bool dones. The rows, and
            # the values refused, are the general way's below.
            if n_rows == _ONE:  # one env: one transition of its values, the cheapest add
                # Arrays of the fields' own dtypes (one-step buffers): the values go to
                # the storage in its field order, with no dict and no per-field match.
                exact = (
                    self._exact_order
                    and obs.dtype is self._obs_dtype
                    and next_obs.dtype is self._obs_dtype
                    and action.dtype is self._action_dtype
                    and rewards is _FLOAT32
                )
                flag = done.item()
                timeout = self.handle_timeout_termination and bool(
                    infos[0].get("TimeLimit.truncated", False)
                )
                # the env's action in the field's shape (action_dim,): a flat (1,) already is
                act = action[0] if acts == self._action_rows else action
                if exact:
                    r = reward.item()
                    values = [obs[0], act, r, next_obs[0], flag, timeout]
                    if self._buffer._add_exact(values, -1, _SB3_ORDER):
                        return
                one_row: dict[str, Any] = {
                    "obs": obs[0], "next_obs": next_obs[0], "action": act,
                    "reward": reward.item(),  # checked and cast as its array would be
                }  # fmt: skip
                if self.n_steps == 1:
                    one_row["done"] = flag
                    one_row["timeout"] = timeout
                else:
                    one_row["terminated"] = flag and not timeout
                    one_row["truncated"] = flag and timeout
                self._buffer.add(one_row)
                return
            if acts != self._action_rows:  # flat: one action per env
                action = action.reshape(self._action_rows)
            row = {"obs": obs, "next_obs": next_obs, "action": action, "reward": reward}
            self._add_rows(row, done, infos)
            return
        row = {}
        for name, next_name, key, want in self._obs_rows:
            row[name] = _rows(name, obs if key is None else obs[key], want)
            row[next_name] = _rows(next_name, next_obs if key is None else next_obs[key], want)
        row["action"] = _rows("action", action, self._action_rows)
        row["reward"] = _rows("reward", reward, n_rows)
        done_arr = _rows("done", done, n_rows)
        if done_arr.dtype != np.bool_:
            done_arr = done_arr != 0
        self._add_rows(row, done_arr, infos)

    def _add_rows(
        self, row: dict[str, Any], done: np.ndarray, infos: list[dict[str, Any]],
        timeouts: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """Add ``row`` (the observations, actions and rewards, checked) with the flags
        made of ``done`` (bool, one per env) and ``infos`` (or ``timeouts``, the
        time-limit flags already read from them)."""
        if timeouts is None:
            timeouts = self._timeouts(infos) if self.handle_timeout_termination else self._no_timeouts
        if self.n_steps == 1:
            row["done"] = done  # bool flags: stored in the float32 columns as 0 / 1
            row["timeout"] = timeouts
        else:
            row["terminated"] = done & ~timeouts
            row["truncated"] = done & timeouts
        self._buffer.add(row)

    def _timeouts(self, infos: list[dict[str, Any]]) -> np.ndarray:
        if len(infos) != self.n_envs:
            raise ValueError(
                f"`infos` must hold one dict per env (n_envs={self.n_envs}), got {len(infos)}"
            )
        if self.n_envs == 1:  # (read-only flags: the buffer copies them into its columns)
            return _FLAGS[bool(infos[0].get("TimeLimit.truncated", False))]
        return self._timeouts_from(infos, 0, infos[0].get("TimeLimit.truncated", False))

    def _timeouts_from(self, infos: list[dict[str, Any]], i: int, flag: Any) -> np.ndarray:
        """:meth:`_timeouts` (n_envs > 1) where the infos of envs ``0 .. i-1`` have
        answered ``False`` and env ``i``'s ``flag``: the others read once. O(n_envs)."""
        rest = [info.get("TimeLimit.truncated", False) for info in infos[i + 1 :]]
        flags = [False] * i + [flag, *rest]
        if not any(flags):  # (most steps: no env hit its time limit)
            return self._no_timeouts
        return np.array(flags, np.bool_)

    # -- sample ---------------------------------------------------------------------
    def sample(  # type: ignore[override]
        self, batch_size: int, env: VecNormalize | None = None
    ) -> PrioritizedReplayBufferSamples:
        """Draw ``batch_size`` transitions by priority, with replacement. O(B log N).

        Args:
            batch_size: number of draws (may exceed the number stored).
            env: a ``VecNormalize`` to normalise observations and rewards
                with, exactly as SB3's buffer does (stored ones are raw).

        Returns:
            :class:`PrioritizedReplayBufferSamples` (Dict buffers:
            :class:`DictPrioritizedReplayBufferSamples`), tensors on ``device``.

        Raises:
            fastper.EmptyBufferError: nothing stored yet.
        """
        batch = self._buffer.sample(batch_size)
        if self._watch_priorities:
            self._unprioritized_samples += 1
            if self._unprioritized_samples >= self.warn_unprioritized_after:
                self._watch_priorities = False
                self._warn_unprioritized()
        data = batch.data
        obs = self._observations(data, "obs", env)
        next_obs = self._observations(data, "next_obs", env)
        rewards = self._normalize_reward(data["reward"].reshape(-1, 1), env)
        discounts = None
        if self.n_steps > 1:
            discounts = self._tensor(data["discount"].reshape(-1, 1))
            dones = data["terminated"].astype(np.float32)
        else:
            dones = data["done"] * (1 - data["timeout"])  # as SB3: a time limit bootstraps
        return self._samples_type()(
            obs,
            self._tensor(data["action"]),
            next_obs,
            self._tensor(dones.reshape(-1, 1)),
            self._tensor(rewards),
            discounts,
            self._tensor(batch.weights.astype(np.float32).reshape(-1, 1)),
            batch.indices,
            batch.keys,
        )

    def _warn_unprioritized(self) -> None:
        """Warn once that replay is not by priority, if every priority is still the same. O(N)."""
        fb = self._buffer
        n = len(fb)
        if n == 0:
            return
        p = fb.priorities(np.arange(n))
        if p.min() != p.max():
            return  # set another way (the fastper buffer's own update_priorities, a loaded file)
        how = (
            "uniformly (proportional sampling of equal priorities)"
            if self.scheme == "proportional"
            else "by slot order (rank-based sampling ranks equal priorities by slot)"
        )
        warnings.warn(
            f"{type(self).__name__} was sampled {self._unprioritized_samples} times and no "
            f"priority was ever updated: every transition keeps the priority it was stored "
            f"with, so it replays {how}, not by TD error. SB3's own DQN / SAC / TD3 never "
            "update priorities: use fastper.compat.sb3.PERDQN / PERSAC / PERTD3, call "
            "buffer.update_priorities(samples.indices, td_errors, samples.keys) after each "
            'gradient step, or pass scheme="uniform"',
            UserWarning,
            stacklevel=3,
        )

    @classmethod
    def _samples_type(cls) -> type[Any]:
        return (
            DictPrioritizedReplayBufferSamples if cls._dict_obs else PrioritizedReplayBufferSamples
        )

    def _tensor(self, array: np.ndarray) -> th.Tensor:
        # sampled arrays are fresh copies: no second copy on the CPU (from_numpy shares
        # the array's memory as as_tensor does there, at a third of its cost)
        device = self.device  # (SB3 may set it again, as load_replay_buffer does)
        if type(array) is np.ndarray and getattr(device, "type", None) == "cpu":
            return th.from_numpy(array)
        return th.as_tensor(array, device=device)

    def _observations(
        self, data: Mapping[str, np.ndarray], prefix: str, env: VecNormalize | None
    ) -> Any:
        if not self._dict_obs:
            return self._tensor(np.asarray(self._normalize_obs(data[prefix], env)))
        raw = {str(key): data[prefix + suffix] for suffix, key, _ in self._obs_parts}
        normed = self._normalize_obs(raw, env)
        assert isinstance(normed, dict)
        return {key: self._tensor(np.asarray(v)) for key, v in normed.items()}

    # -- priorities -----------------------------------------------------------------
    def update_priorities(self, indices: Any, td_errors: Any, keys: Any = None) -> int:
        """Set priority ``min(|td|, clip) + eps`` for sampled slots. O(B log N).

        Args:
            indices: ``samples.indices``.
            td_errors: one TD error per index (numpy or torch, any device;
                ``(B,)`` or ``(B, 1)``); only the magnitude is used.
            keys: ``samples.keys``: updates for slots overwritten since the
                sample are dropped (counted in ``fastper_buffer.stale_updates``).

        Returns:
            The number of priorities written.

        Raises:
            ValueError: lengths differ, a TD error is not finite, bad keys.
            fastper.InvalidIndexError: an index never written.
        """
        self._watch_priorities = False
        return int(self._buffer.update_priorities(_numpy(indices), _numpy(td_errors), _numpy(keys)))

    # -- housekeeping ---------------------------------------------------------------
    def size(self) -> int:
        """Rows stored, as SB3's ``size()``: ``buffer_size`` when full, else ``pos``. O(1)."""
        return self.buffer_size if self.full else self.pos

    def reset(self) -> None:
        """Drop every transition (and pending n-step window). O(N).

        The generator, the key counter (keys sampled before stay stale) and
        the largest priority ever recorded are kept.
        """
        self._buffer.clear()

    @property
    def n_pending(self) -> int:
        """Transitions waiting for their n-step window (0 for one-step buffers). O(1)."""
        return int(self._buffer.n_pending)

    def drop_pending(self) -> int:
        """Drop the pending n-step windows of every env; returns how many transitions. O(n_envs).

        For an env reset outside the stream of ``add`` calls (SB3's ``learn``
        resets the env when it starts): the windows of the cut episodes would
        otherwise run on into the next episode's steps. Stored transitions are
        untouched.
        """
        return self._buffer.drop_pending()

    def save(self, path: PathOrFile) -> None:
        """Write the buffer as a fastper checkpoint (pickle-free, checksummed). O(N).

        The file is the fastper buffer's (``fastper.load`` and ``fastper
        inspect`` read it): rows, priorities, ring, schedules, random state
        and n-step windows. ``path`` may be a path (parent folders are
        created) or a writable binary file object.
        """
        if isinstance(path, io.IOBase):
            with tempfile.TemporaryDirectory() as tmp:
                name = os.path.join(tmp, "replay.fpk")
                self._buffer.save(name)
                with open(name, "rb") as f:
                    shutil.copyfileobj(f, path)
            return
        target = pathlib.Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._buffer.save(target)

    def load(self, path: PathOrFile) -> None:
        """Replace this buffer's contents with a checkpoint written by :meth:`save`. O(N).

        The file brings its rows, priorities, settings (alpha, beta, eps,
        scheme...), random state and ring; this object keeps its device,
        ``handle_timeout_termination`` and spaces. The file's beta is the one
        in force when it was saved (an annealed one included);
        :attr:`beta_start`, where annealing starts, stays the one this buffer
        was built with, unless the file holds a beta schedule (then
        ``None``: used as given). The file must hold the same fields
        (spaces), capacity (``buffer_size`` and ``n_envs``) and ``n_steps``;
        nothing changes if it does not.

        Raises:
            ValueError: a file made for other spaces, capacity or n_steps.
            fastper.CheckpointError: not a fastper checkpoint, or a corrupt one.
        """
        if isinstance(path, io.IOBase):
            with tempfile.TemporaryDirectory() as tmp:
                name = os.path.join(tmp, "replay.fpk")
                with open(name, "wb") as f:
                    shutil.copyfileobj(path, f)
                self.load(name)
            return
        meta = read_metadata(path)
        state = meta["state"]
        self._check_compatible(path, state)
        loaded = _load_buffer(path)
        beta = state["schedules"]["beta"]
        self._buffer = loaded
        if beta.get("kind") != "constant":
            self._beta_start, self._beta_given = None, _sched.from_dict(beta)
        elif self._beta_start is None:
            self._beta_start = float(beta["value"])
            self._beta_given = _sched.from_dict(beta)

    def _check_compatible(self, path: PathOrFile, state: Mapping[str, Any]) -> None:
        settings = state["settings"]
        nstep = settings.get("nstep")
        theirs = {
            "fields": {str(k): v for k, v in settings["fields"]},
            "capacity": settings["capacity"],
            # n-step windows are kept per env: their number matters too
            "n_steps": (1, None) if nstep is None else (nstep.get("n"), nstep.get("n_envs")),
        }
        mine = {
            "fields": {k: f.to_dict() for k, f in self._fields.items()},
            "capacity": self._buffer.capacity,
            "n_steps": (1, None) if self.n_steps == 1 else (self.n_steps, self.n_envs),
        }
        differ = [k for k in mine if mine[k] != theirs[k]]
        if differ:
            old_flags = "terminated" in theirs["fields"] and "done" in mine["fields"]
            raise ValueError(
                f"replay buffer file {str(path)!r} does not fit this buffer: "
                + "; ".join(f"{k}={theirs[k]!r} in the file, {mine[k]!r} here" for k in differ)
                + " (same spaces, buffer_size * n_envs and (n_steps, n_envs) needed)"
                + (
                    ". The file stores one-step transitions with terminated / truncated "
                    "flags (fastper 0.6 and older); one-step buffers now store SB3's done / "
                    "timeout columns: read the file's rows with fastper.load(path)"
                    if old_flags
                    else ""
                )
            )

    def __reduce_ex__(self, protocol: Any) -> Any:
        _drop_sb3_pickle_file()
        raise TypeError(
            f"{type(self).__name__} (fastper.compat.sb3) is not picklable: it is saved in "
            "fastper's pickle-free checkpoint format instead. With PERDQN / PERSAC / PERTD3 "
            "use model.save_replay_buffer(path) and model.load_replay_buffer(path); with "
            "another SB3 algorithm fastper.compat.sb3.save_replay_buffer(model, path) and "
            "load_replay_buffer(model, path); or buffer.save(path) / buffer.load(path)"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(buffer_size={self.buffer_size * self.n_envs}, "
            f"n_envs={self.n_envs}, scheme={self.scheme!r}, stored={len(self._buffer)})"
        )


class DictPrioritizedReplayBuffer(PrioritizedReplayBuffer, DictReplayBuffer):
    """SB3's ``DictReplayBuffer`` API over a fastper prioritized buffer.

    As :class:`PrioritizedReplayBuffer`, for ``spaces.Dict`` observations (one
    stored field per key, ``obs.<key>`` and ``next_obs.<key>``); samples are
    :class:`DictPrioritizedReplayBufferSamples`. One-step only (``n_steps=1``),
    as SB3's.
    """

    _dict_obs: ClassVar[bool] = True

    def sample(  # type: ignore[override]
        self, batch_size: int, env: VecNormalize | None = None
    ) -> DictPrioritizedReplayBufferSamples:
        """Draw ``batch_size`` transitions by priority (see :meth:`PrioritizedReplayBuffer.sample`). O(B log N)."""
        return super().sample(batch_size, env)  # type: ignore[return-value]


def _drop_sb3_pickle_file() -> None:
    """Remove the empty file SB3's ``save_to_pkl`` opened for this refused buffer, if any.

    SB3's ``model.save_replay_buffer(path)`` opens ``path`` (adding ``.pkl``)
    before pickling the buffer, which refuses: without this the refusal
    leaves an empty file behind. Only a file that SB3 opened from a path
    itself and that is still empty is removed; a file object the caller
    passed is theirs and left alone.
    """
    from stable_baselines3.common import save_util

    frame = sys._getframe(1)
    for _ in range(4):  # pickle.dump calls __reduce_ex__ from C: save_to_pkl is next
        if frame is None:
            return
        if frame.f_code is save_util.save_to_pkl.__code__:
            break
        frame = frame.f_back  # type: ignore[assignment]
    else:
        return
    given, file = frame.f_locals.get("path"), frame.f_locals.get("file")
    name = getattr(file, "name", None)
    if not isinstance(given, (str, os.PathLike)) or not isinstance(name, str):
        return
    try:
        if os.fstat(file.fileno()).st_size != 0:  # type: ignore[union-attr]
            return
        file.close()  # type: ignore[union-attr]
        os.unlink(name)
    except (OSError, ValueError):  # pragma: no cover - already closed or removed
        return


def _numpy(value: Any) -> Any:
    """A torch tensor as a flat numpy array (detached, on the host); others unchanged."""
    if isinstance(value, th.Tensor):
        return value.detach().reshape(-1).cpu().numpy()
    if isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[1] == 1:
        return value.reshape(-1)
    return value
