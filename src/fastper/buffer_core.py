"""What every buffer shares, on the host or on a device: its settings and the ring.

:class:`BufferCore` checks the constructor arguments common to
:mod:`fastper.buffers` and :mod:`fastper.device` once (each with its message),
builds the n-step writer when streams or n-step returns are asked for, and
gives the properties that only read those settings. It holds no priorities
and no rows: the buffers add their sampler or device index, and storage.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import numpy as np

from . import schedules as _sched
from ._validation import check_finite_rewards, check_int, check_real, show
from ._validation import nstep_key_args as _nstep_key_args
from ._validation import nstep_key_names as _nstep_key_names
from .nstep import REWARD_KEYS, NStepPlan, NStepWriter
from .storage import Field, FieldLike, ReplayStorage, make_fields
from .writer import RingWriter

#: the widest vector env ``n_envs`` accepts (many actors pass ``env_ids`` instead)
MAX_ENVS = 1 << 16
#: ``alpha_every`` default: re-weigh at most this many slots per sample, amortised
AUTO_ALPHA_SLOTS = 256

MaxPriorityPolicy = str | float

F = TypeVar("F", bound=Callable[..., Any])


def locked(method: F) -> F:
    """Run the method under the buffer's re-entrant lock."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._run_count:  # new transitions' priorities not yet in the index
                self._flush_run()
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class BufferCore:
    """Settings, schedules, ring and n-step writer of a buffer (see the module docstring)."""

    kind: ClassVar[str] = ""
    _default_alpha: ClassVar[float] = 1.0
    _default_beta: ClassVar[float] = 0.0

    _capacity: int
    _eps: float
    _clip: float | None
    _max_policy: MaxPriorityPolicy
    _stratified: bool
    _shuffle: bool
    _weight_norm: str
    _alpha_every: int
    _gamma: float
    _nstep: NStepWriter | None
    _alpha_schedule: Any
    _beta_schedule: Any
    _noise_schedule: Any
    _seed: int | None
    _step: int
    _writer: RingWriter
    _storage: ReplayStorage
    _lock: threading.RLock
    _frames: Any = None  # a FrameStore on host buffers built with frame_stack
    _allow_nonfinite: bool = False
    #: the float reward field whose values an add checks are finite (None: no check)
    _reward_check: str | None = None
    #: slots written by single adds whose (shared) new priority the index has not yet
    #: taken: a run from ``_run_start``; every locked call applies it first
    _run_count: int = 0

    def _flush_run(self) -> None:  # pragma: no cover - host buffers defer runs
        raise NotImplementedError

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Python would name the private ``_Buffer.__init__`` for a misspelt keyword
        unknown = [k for k in kwargs if k not in _keywords(cls)]
        if unknown:
            name = unknown[0]
            close = difflib.get_close_matches(name, sorted(_keywords(cls)), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}{hint}")
        return super().__new__(cls)

    def _configure(
        self,
        capacity: int,
        fields: Mapping[str, FieldLike],
        *,
        alpha: _sched.ScheduleLike | None,
        beta: _sched.ScheduleLike | None,
        eps: float,
        clip: float | None,
        max_priority: Any,
        policies: tuple[str, ...],
        stratified: bool,
        shuffle: bool,
        weight_norm: str,
        norms: tuple[str, ...],
        alpha_every: int | None,
        priority_noise: _sched.ScheduleLike,
        n_step: int,
        gamma: float,
        n_envs: int | None,
        autoreset: str | None,
        nstep_keys: Mapping[str, str | None] | None,
        seed: int | None,
        allow_nonfinite_rewards: bool = False,
    ) -> tuple[dict[str, Field], float]:
        """Check and keep the shared settings. Returns (the stored fields, alpha at step 0)."""
        self._capacity = check_int("capacity", capacity, minimum=1)
        input_fields = make_fields(fields)
        self._eps = check_real("eps", eps, minimum=0.0)
        self._clip = None if clip is None else check_real("clip", clip, minimum=0.0)
        self._max_policy = self._check_max_policy(max_priority, policies)
        for flag, value in (("stratified", stratified), ("shuffle", shuffle)):
            check_flag(flag, value)
        self._stratified = bool(stratified)
        self._shuffle = bool(shuffle)
        if weight_norm not in norms:
            raise ValueError(
                f"`weight_norm` must be one of {list(norms)}, got weight_norm={weight_norm!r}"
            )
        self._weight_norm = weight_norm
        if alpha_every is None:
            alpha_every = -(-self._capacity // AUTO_ALPHA_SLOTS)
        self._alpha_every = check_int("alpha_every", alpha_every, minimum=1)
        n_step = check_int("n_step", n_step, minimum=1)
        if n_envs is not None:
            n_envs = check_int("n_envs", n_envs, minimum=1)
            if n_envs > MAX_ENVS:
                raise ValueError(
                    f"`n_envs` must be <= {MAX_ENVS} (a vector env's width; many actors pass "
                    f"`env_ids` to add instead), got n_envs={n_envs}"
                )
        self._gamma = check_real("gamma", gamma, minimum=0.0, maximum=1.0)
        self._nstep = None
        stored = input_fields
        if n_step > 1 or autoreset is not None or n_envs is not None:
            self._nstep = NStepWriter(
                input_fields, n_step, self._gamma, n_envs=n_envs, autoreset=autoreset,
                discount_field=n_step > 1, key_names=_nstep_key_names(nstep_keys),
                **_nstep_key_args(nstep_keys),
            )  # fmt: skip
            stored = self._nstep.output_fields
        elif nstep_keys:
            _nstep_key_args(nstep_keys)  # checked, unused without streams
        self._allow_nonfinite = check_flag("allow_nonfinite_rewards", allow_nonfinite_rewards)
        self._reward_check = None
        if not self._allow_nonfinite:
            if self._nstep is not None:
                reward = self._nstep.reward_key
            else:
                named = _nstep_key_args(nstep_keys).get("reward_key")
                reward = named or next((k for k in REWARD_KEYS if k in input_fields), None)
            if reward is not None and reward in input_fields:
                if input_fields[reward].dtype.kind == "f":
                    self._reward_check = reward
        self._alpha_schedule = _sched.as_schedule(
            "alpha", self._default_alpha if alpha is None else alpha
        )
        self._beta_schedule = _sched.as_schedule(
            "beta", self._default_beta if beta is None else beta
        )
        self._noise_schedule = _sched.as_schedule("priority_noise", priority_noise)
        self._step = 0
        alpha0 = check_real("alpha", self._alpha_schedule(0), minimum=0.0)
        check_real("beta", self._beta_schedule(0), minimum=0.0)
        check_real("priority_noise", self._noise_schedule(0), minimum=0.0)
        self._seed = None if seed is None else check_int("seed", seed, minimum=0)
        self._writer = RingWriter(self._capacity)
        return stored, alpha0

    def _check_rewards(self, rows: Mapping[str, Any]) -> None:
        """Refuse non-finite rewards in ``rows`` (checked rows of an add, numpy), unless
        the buffer was made with ``allow_nonfinite_rewards=True``. O(1) for one row."""
        field = self._reward_check
        if field is not None:
            check_finite_rewards(field, rows[field])

    # -- n-step windows: one plan for every front end ----------------------------------
    @staticmethod
    def _refuse_priorities_with_windows(priorities: Any) -> None:
        if priorities is not None:
            raise ValueError(
                "`priorities` cannot be given to add() when n_step > 1 or streams are tracked"
            )

    def _plan_windows(self, batch: Mapping[str, np.ndarray], k: int, env_ids: Any) -> NStepPlan:
        """The n-step plan of ``k`` rows, changing nothing; refuses a batch that
        completes more than the ring holds. Every front end plans its windows here."""
        assert self._nstep is not None
        plan = self._nstep.prepare(batch, k, env_ids)
        m, cap = plan.count, self._capacity
        if m > cap and k > cap:
            raise ValueError(
                f"a batch must not complete more than capacity={cap} transitions, got {m}"
            )
        return plan

    # -- schedules: one rule for every front end --------------------------------------
    def _apply_alpha(self, alpha: float) -> None:  # pragma: no cover - each front end's index
        raise NotImplementedError

    def _checked_alpha(self, value: Any) -> float:
        if type(value) is float and 0.0 <= value < math.inf:  # fast path, no ABC checks
            return value
        return check_real("alpha", value, minimum=0.0)

    @staticmethod
    def _check_beta(value: Any) -> float:
        if type(value) is float and 0.0 <= value < math.inf:
            return value
        return check_real("beta", value, minimum=0.0)

    def _alpha_at(self, step: int) -> float:
        """The alpha in force at ``step``: the schedule at the last multiple of ``alpha_every``."""
        return self._checked_alpha(self._alpha_schedule(step - step % self._alpha_every))

    @locked
    def set_alpha(self, alpha: _sched.ScheduleLike) -> None:
        """Replace alpha (a number or a schedule); re-weighs every stored priority now. O(N).

        Raises:
            ValueError: a negative alpha, or one under which a stored priority
                would overflow the sum tree (nothing changes).
        """
        schedule = _sched.as_schedule("alpha", alpha)
        self._apply_alpha(
            self._checked_alpha(schedule(self._step - self._step % self._alpha_every))
        )
        self._alpha_schedule = schedule

    @locked
    def set_beta(self, beta: _sched.ScheduleLike) -> None:
        """Replace beta (a number or a schedule). O(1)."""
        schedule = _sched.as_schedule("beta", beta)
        self._check_beta(schedule(self._step))
        self._beta_schedule = schedule

    def _priority_cap(self) -> float:
        """The largest priority an update can produce: ``clip + eps`` (inf without clip)."""
        return math.inf if self._clip is None else self._clip + self._eps

    def _check_max_policy(self, policy: Any, policies: tuple[str, ...]) -> MaxPriorityPolicy:
        if isinstance(policy, str):
            if policy not in policies:
                names = ", ".join(repr(p) for p in policies)
                raise ValueError(
                    f"`max_priority` must be {names} or a number > 0, got max_priority={policy!r}"
                    + (
                        " ('current' needs a max tree, not kept on the device)"
                        if policy == "current"
                        else ""
                    )
                )
            return policy
        value = check_real("max_priority", policy, minimum=0.0, strict_min=True)
        if value > self._priority_cap():
            raise ValueError(
                f"`max_priority` must be <= clip + eps = {self._priority_cap()!r} (no update "
                f"can reach more), got max_priority={value!r}"
            )
        return value

    def _check_stored_max(self, stored_max: float, max_seen: float) -> None:
        """A state's largest stored priority against what could have recorded it: an
        update or a given priority (which raise ``max_priority_ever``), or a new
        item's constant ``max_priority`` (which does not). Raises ValueError."""
        policy = self._max_policy
        bound = max_seen if isinstance(policy, str) else max(max_seen, policy)
        if stored_max > bound:
            raise ValueError(
                f"max_priority_ever={max_seen!r} is below a stored priority ({stored_max!r}): "
                "the state is inconsistent (a corrupt or edited file?)"
            )

    # -- introspection ---------------------------------------------------------------
    def __len__(self) -> int:
        return self._writer.size

    @property
    def capacity(self) -> int:
        """Number of slots."""
        return self._capacity

    @property
    def fields(self) -> dict[str, Field]:
        """The stored field spec (with ``discount`` for n-step buffers)."""
        return dict(self._storage.fields)

    @property
    def total_added(self) -> int:
        """Transitions ever written to storage (the next transition's key)."""
        return self._writer.added

    @property
    def alpha_every(self) -> int:
        """An alpha schedule is applied at steps that are multiples of this."""
        return self._alpha_every

    @property
    def weight_norm(self) -> str:
        """How IS weights are normalised: ``"buffer"``, ``"batch"`` or ``"none"``."""
        return self._weight_norm

    @property
    def beta(self) -> float:
        """beta at the current step (used when ``sample`` gets no beta)."""
        return float(self._beta_schedule(self._step))

    @property
    def cursor(self) -> int:
        """The slot the next transition goes to (``total_added % capacity``). O(1)."""
        return int(self._writer.cursor)

    @property
    def n_pending(self) -> int:
        """Transitions held back by the n-step writer, not yet stored."""
        return 0 if self._nstep is None else self._nstep.n_pending

    @property
    def n_dropped(self) -> int:
        """Rows dropped by ``autoreset="next_step"`` (the step after an episode end)."""
        return 0 if self._nstep is None else self._nstep.dropped

    def _settings(self) -> dict[str, Any]:
        """Constructor arguments (JSON-able), as a state's ``settings``."""
        nstep = self._nstep
        return {
            "capacity": self._capacity,
            "fields": [
                [k, f.to_dict()]
                for k, f in (nstep.fields if nstep else self._storage.fields).items()
            ],
            "eps": self._eps,
            "clip": self._clip,
            "max_priority": self._max_policy,
            "stratified": self._stratified,
            "shuffle": self._shuffle,
            "weight_norm": self._weight_norm,
            "alpha_every": self._alpha_every,
            "gamma": self._gamma,
            "seed": self._seed,
            "nstep": None if nstep is None else nstep.settings(),
            # only when set: the headers of buffers with the default stay as they were
            **({"allow_nonfinite_rewards": True} if self._allow_nonfinite else {}),
            **self._class_settings(),
        }

    def _class_settings(self) -> dict[str, Any]:
        return {}

    def _schedules_state(self) -> dict[str, Any]:
        """The schedules as a state's ``schedules`` (see :func:`fastper.schedules.to_dict`)."""
        return {
            "alpha": _sched.to_dict(self._alpha_schedule),
            "beta": _sched.to_dict(self._beta_schedule),
            "priority_noise": _sched.to_dict(self._noise_schedule),
        }


_KEYWORDS: dict[type, frozenset[str]] = {}


def _keywords(cls: type) -> frozenset[str]:
    """Keyword arguments the constructors along ``cls``'s MRO name (``**kwargs`` forwards)."""
    known = _KEYWORDS.get(cls)
    if known is not None:
        return known
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
    _KEYWORDS[cls] = frozenset(names)
    return _KEYWORDS[cls]


def constructor_args(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A state's ``settings`` as keyword arguments of the buffer's constructor."""
    s = dict(settings)
    args: dict[str, Any] = {
        "capacity": check_int("capacity", s.pop("capacity"), minimum=1),
        "fields": {str(k): (tuple(v["shape"]), v["dtype"]) for k, v in s.pop("fields")},
    }
    nstep = s.pop("nstep")
    if nstep is not None:
        nstep = dict(nstep)
        args["n_step"] = nstep.pop("n")
        args["n_envs"] = nstep.pop("n_envs", None)
        args["autoreset"] = nstep.pop("autoreset", None)
        args["nstep_keys"] = {k: v for k, v in nstep.items() if k.endswith("_key")}
    args.update(s)
    return args


def check_flag(name: str, value: Any) -> bool:
    """A bool argument (numpy bools accepted)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"`{name}` must be a bool, got {name}={show(value)}")
    return bool(value)
