"""n-step returns, computed as transitions arrive, one window per stream.

A *stream* is one chronological trajectory: one environment of a vector env,
or one actor. Each stream has its own pending window; streams never mix. The
caller says which stream each row is from:

* ``env_ids`` per add: one id per row (any int >= 0, e.g. actor ids); rows of
  one id inside a batch are consecutive steps of that stream, in row order;
* or ``n_envs`` at construction: every add is one step of each of ``n_envs``
  environments, row ``i`` = env ``i`` (a Gymnasium vector env's ``step``);
* a single transition without ``env_ids`` is stream 0. A batch of several rows
  with neither is refused when ``n > 1`` (or with ``autoreset``): read as one
  trajectory, it mixed a vector env's streams.

Transition ``t`` of a stream is written once the ``n`` steps ``t .. t+n-1`` of
that stream are known, or earlier if its episode ends inside that window. The
written transition holds:

* ``reward``: ``sum_{j<m} gamma^j r_{t+j}``, the discounted ``m``-step return,
  ``m = n`` or fewer at the end of an episode (summed in float64 in that
  order, then cast to the field's dtype);
* ``next_obs``: the observation after the window's last step (the bootstrap
  observation);
* ``discount``: ``gamma^m`` to bootstrap with, or ``0`` if the window ends
  with a termination. A truncated episode still bootstraps;
* the termination / truncation flags of the window's last step, and every
  other field of step ``t`` unchanged.

The target is then ``reward + discount * max_a Q(next_obs, a)``. At an episode
end (terminated or truncated) every pending window of that stream is written.
Transitions come out in the order they complete: batch rows in order, the
oldest first among those one row completes.

Autoreset. Gymnasium 1.x vector envs reset an env on the step *after* its
episode ended (``AutoresetMode.NEXT_STEP``, the default): that step returns
the reset observation and is not a transition. ``autoreset="next_step"``
drops, per stream, the row that follows an episode end (counted in
:attr:`NStepWriter.dropped`). ``autoreset=None`` takes every row as a
transition (reset by hand, or ``infos["final_obs"]`` put into ``next_obs``).
``SAME_STEP`` is refused: it hands out the reset observation in place of the
final one. :func:`autoreset_mode` reads the mode of a vector env.

Layout and costs (see :mod:`fastper._kernels.nstep`). Each stream keeps its
pending steps in a ring of ``w = n - 1`` rows (fewer while no window has
needed more, so a huge ``n`` costs only what is pending) in preallocated
arrays: one per field a transition takes from its first step (not
``next_obs`` nor the flags, which come from the step completing the window)
and the reward in float64. They grow by doubling when a new stream appears.
An add of ``k`` rows completing ``m`` transitions costs O(k + m n) in a
compiled kernel and a constant number of numpy calls per field. The most
frequent adds build no batches: one row of a known stream that ends nothing
(O(n)), and a vector step with every env at one pending length and no
episode end (one compiled call sums the returns; O(k n)), run as
straight-line Python written for the writer's fields, with the kernel's
sums (the same bits). No Python loop runs over rows. Memory:
``w * (bytes of those fields + 8 * reward size) + 40`` bytes per stream.
Streams are never forgotten (``clear`` empties their windows and keeps
them), so millions of distinct ids cost memory; ids have no other limit
(any int64 >= 0).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np

from ._codegen import specialise
from ._kernels import nstep as _nk
from ._validation import check_int, check_real, show, to_numpy
from .storage import Field
from .vector import SAME_STEP_MESSAGE as _SAME_STEP
from .vector import autoreset_mode as autoreset_mode  # re-exported: fastper.nstep.autoreset_mode
from .vector import mode_name as _mode_name

REWARD_KEYS = ("reward", "rewards", "rew")
NEXT_OBS_KEYS = ("next_obs", "next_observation", "next_observations", "next_state")
TERMINATED_KEYS = ("terminated", "terminal", "done", "dones")
TRUNCATED_KEYS = ("truncated", "timeout", "timeouts")
DISCOUNT = "discount"
STATE_FORMAT = 2  # state_dict layout; the legacy one-window form has no "format"
_RING0 = 16  # ring rows per stream to start with when n - 1 is larger


class _Find(enum.Enum):
    FIND = "find"

    def __repr__(self) -> str:
        return "<find by name>"


FIND: Final = _Find.FIND
"""Default of ``terminated_key`` / ``truncated_key``: look the field up by name."""

KeyArg = str | None | Literal[_Find.FIND]


def _find(fields: Mapping[str, Field], names: tuple[str, ...]) -> str | None:
    for name in names:
        if name in fields:
            return name
    return None


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, slots=True)
class NStepPlan:
    """What one add completes, from :meth:`NStepWriter.prepare`.

    Attributes:
        out: the completed transitions, ``{field: (count, *shape)}`` in the
            writer's ``output_fields`` order and dtypes. Arrays may share
            memory with the prepared batch (and be read-only): copy them,
            as the storage write does, to keep them.
        count: number of completed transitions (may be 0).
        dropped: rows dropped by ``autoreset="next_step"``.
    """

    out: dict[str, np.ndarray]
    count: int
    dropped: int
    _apply: tuple[Any, ...] | None = field(default=None, repr=False, compare=False)


# plan kinds, the first entry of NStepPlan._apply
_ONE, _DROP, _BATCH = 0, 1, 2
# how an output field is filled: from the completing row, from the first
# step's row, the return, the discount
_LAST, _FIRST, _RETURN, _DISCOUNT = 0, 1, 2, 3
#: a complete window's return is summed in straight-line code up to this many
#: pending steps, in a loop beyond
_UNROLL = 8


def _return_lines(w: int, indent: str, window: str | None = None) -> list[str]:
    """Source that leaves in ``acc`` the return of a complete window (``w`` pending
    steps) of the stream whose ring starts at row ``base``, closed by a step of
    ``reward`` (a float), for a clock of ``clock``: ``sum_j gamma^j r_j``, oldest
    first, in float64, in the compiled kernel's order (the same bits). Reads
    ``RITEM`` (the reward ring's ``item``) and ``G`` / ``G0``.. (``gamma ** j``);
    or, where ``window`` names a list of the stream's ``w`` ring rewards as
    Python floats (up to :data:`_UNROLL` steps), its items: the same values.
    The ring's oldest pending step sits at ``(clock - w) % w == clock % w``."""
    if w > _UNROLL:
        return [
            f"{indent}acc = 0.0",
            f"{indent}for j in range({w}):",
            f"{indent}    acc += G[j] * RITEM(base + (clock + j) % {w})",
            f"{indent}acc += G[{w}] * reward",
        ]

    def read(j: int) -> str:
        at = f"clock % {w}" if j == 0 else f"(clock + {j}) % {w}"
        return f"RITEM(base + {at})" if window is None else f"{window}[{at}]"

    lines = [f"{indent}acc = 0.0 + G0 * {read(0)}"]
    lines += [f"{indent}acc += G{j} * {read(j)}" for j in range(1, w)]
    return [*lines, f"{indent}acc += G{w} * reward"]


def _return_source(w: int) -> str:
    """The source of ``window_return(base, clock, reward)``: :func:`_return_lines`."""
    return "\n".join(["def window_return(base, clock, reward):", *_return_lines(w, "    "),
                      "    return acc"]) + "\n"  # fmt: skip


def _transition_values(
    count: int, win_pos: tuple[int, ...], reward_pos: int, window: list[str], ret: str
) -> list[str]:
    """The completed transitions' values in output order, the discount last, as
    expressions of a generated step whose input values are ``v0, v1, ..`` (the
    ``count`` input fields): a window field's value is its expression in
    ``window`` (the window's oldest step, read before the step is written over
    it), the reward's is ``ret``, every other field's is the input's."""
    out = []
    for i in range(count):
        if i in win_pos:
            out.append(window[win_pos.index(i)])
        else:
            out.append(ret if i == reward_pos else f"v{i}")
    return [*out, "DISC"]


#: ``store(values)``: the source lines that store the completed transitions (their
#: expressions, in output order; None: a column stored otherwise) into the storage,
#: from slot ``start``
StoreLines = Callable[[Sequence[str | None]], list[str]]


def _row_lines(
    count: int, win_pos: tuple[int, ...], flag_pos: tuple[int, ...], reward_pos: int, w: int,
    by_id: bool, row_views: tuple[bool, ...], stream_views: bool, store: StoreLines,
) -> list[str]:  # fmt: skip
    """The one-row part of :meth:`NStepWriter.step_function` for one writer layout
    (see there): ``count`` input fields, the window fields' and episode-end flags'
    positions among them, the reward's, ``w == n - 1``, and whether int ``env_ids`` name
    the stream (no ``n_envs``). ``row_views[j]``: window field ``j``'s rows are
    read and written through views made ahead (``ROWS{j}[at]``: a tuple item,
    where ``WIN{j}[at]`` makes a view each time); ``stream_views``: so are each
    stream's meta row and reward ring (``MROWS[r]``, ``RROWS[r]``). Returns 1 (the transition
    stored, the step in its window) or 0 (nothing changed)."""
    window = [f"ROWS{j}[at]" if row_views[j] else f"WIN{j}[at]" for j in range(len(win_pos))]
    out = _transition_values(count, win_pos, reward_pos, window, "acc")
    lines = [
        "    if env_ids is None:",
        "        r = S._row_of.get(0)",
    ]
    if by_id:
        lines += [
            "    elif type(env_ids) is int and 0 <= env_ids < 9223372036854775808:",
            "        r = S._row_of.get(env_ids)",
        ]
    lines += [
        "    else:",
        "        return 0",
        "    if r is None:",
        "        return 0  # a new stream",
    ]
    if flag_pos:
        lines += [f"    if {' or '.join(f'v{p}' for p in flag_pos)}:", "        return 0"]
    # a stream's meta row and reward ring through views made ahead (MROWS, RROWS:
    # tuple items) where the streams are few enough to keep one each
    unrolled = stream_views and w <= _UNROLL
    lines += [
        *(
            ["    m = MROWS[r]", "    clock, length, skip, _ = m.tolist()"]
            if stream_views
            else ["    clock, length, skip, _ = META[r].tolist()"]
        ),
        f"    if skip or length != {w}:",
        "        return 0  # a dropped row, or a window not yet complete",
        f"    reward = float(v{reward_pos}) if type(v{reward_pos}) is RTYPE else "
        f"float(RTYPE(v{reward_pos}))",
        "    if check_reward and not isfinite(reward):",
        "        return 0  # the general path names the row",
        f"    base = r * {w}",
        f"    at = base + clock % {w}",
        *(["    ring = RROWS[r].tolist()"] if unrolled else []),
        *_return_lines(w, "    ", "ring" if unrolled else None),
        *store(out),
        *(f"    ROWS{j}[at][...] = v{p}" if row_views[j] else f"    WIN{j}[at] = v{p}"
          for j, p in enumerate(win_pos)),
        "    RFLAT[at] = reward",
        "    m[CLOCK] = clock + 1" if stream_views else "    META[r, CLOCK] = clock + 1",
        "    S._version += 1",
        "    return 1",
    ]
    return lines


#: the kernels' window length for any longer one (as good as infinite: an int64)
_N_LIMIT = 2**62

#: the reward dtypes the vector step's kernel stores returns into
_KERNEL_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _kernel_dtype(dtype: np.dtype[Any]) -> bool:
    """Whether the n-step kernels compile for arrays of ``dtype`` (flags, rewards):
    native numbers, not float16 or longdouble."""
    return (
        dtype.isnative
        and dtype.kind in "biuf"
        and dtype != np.float16
        and (dtype.kind != "f" or dtype.itemsize <= 8)
    )


#: a vector step reads and writes its windows through views made ahead for every
#: ring row, up to rings of this many rows (slices beyond)
_VIEW_ROWS = 64

#: the one-row step reads and writes a window field's rows through views made
#: ahead while its ring has at most this many rows (streams x (n - 1))
_ROW_VIEWS = 4096


def _lockstep_lines(
    count: int, win_pos: tuple[int, ...], end_pos: tuple[int, int], reward_pos: int, views: bool,
    store: StoreLines,
) -> list[str]:  # fmt: skip
    """The vector-step part of :meth:`NStepWriter.step_function` for one writer
    layout (see there): ``count`` input fields, the window fields' positions
    among them, the two episode-end flags' (-1: no such field), the reward's;
    ``views``: the windows' rows at ring row ``at`` are read and written through
    views made ahead (``AT{j}[at]``; cheaper than slicing) rather than as
    slices of ``WIN3_{j}``. ``k`` rows (``rows``). The kernel (``LOCKSTEP``)
    plans the step, stores the returns and the discounts (into the columns
    ``RET_OUT`` and ``DISC_OUT``, from ``start``) and commits the step's
    rewards and clocks to the windows; the other fields are stored here, then
    the window fields written. Returns ``k`` (every env's window completed: the
    transitions stored), -1 (the windows still fill: the step waits in them,
    nothing stored) or 0 (nothing changed)."""
    win = [f"AT{j}[at]" if views else f"WIN3_{j}[:k, at]" for j in range(len(win_pos))]
    out: list[str | None] = list(_transition_values(count, win_pos, reward_pos, win, ""))
    out[reward_pos] = out[-1] = None  # (the returns and the discount: the kernel's)
    term, trunc = (f"v{p}" if p >= 0 else "NO_ENDS" for p in end_pos)
    put = "[...] = " if views else " = "
    flags = " or ".join(f"v{p}.dtype is F16" for p in (reward_pos, *end_pos) if p >= 0)
    return [
        "    k = rows",
        "    if k != N_ENVS or S._n_rows != k or env_ids is not None or start + N_ENVS > cap:",
        "        return 0  # the streams are not registered yet, or the rows would wrap",
        f"    if {flags}:",
        "        return 0  # (the kernel has no float16: the general path widens it)",
        f"    code, clock, length = LOCKSTEP(META, k, N, W, {term}, {trunc}, v{reward_pos}, "
        "RWIN, GPOW, check_reward, RET_OUT, DISC_OUT, DISC_F, start)",
        "    if code < 0:",
        "        return 0  # out of step, an episode end, a non-finite reward",
        "    at = clock % W  # where this step waits: the oldest step's place when full",
        "    if code:  # every env's window completes",
        *("    " + line for line in store(out)),
        *(f"    {win[j]}{put}v{p}" for j, p in enumerate(win_pos)),
        "    S._version += 1",
        "    if code:",
        "        return k",
        "    S._n_pending += k",
        "    S._max_len = max(S._max_len, length + 1)",
        "    return -1",
    ]


class NStepWriter:
    """Turns 1-step transitions into n-step ones, per stream (module docstring).

    Not locked: the buffer holds its lock around ``prepare`` and ``commit``.

    Args:
        fields: the input field spec (the stored spec adds ``discount``).
        n: window length, >= 1.
        gamma: discount factor in [0, 1].
        reward_key, next_obs_key: field names; ``None`` finds them among
            common names (``reward``, ``next_obs``, ...). Needed when n > 1.
        terminated_key, truncated_key: field names, or ``None`` to say there
            is no such field; by default found among common names
            (``terminated`` / ``done``; ``truncated`` / ``timeout``). When
            n > 1 or with ``autoreset`` the writer must know how episodes
            end, so a field not found raises instead of being assumed absent.
            ``done`` counts as termination.
        n_envs: every add is one step of each of ``n_envs`` environments (row
            i = env i); ``env_ids`` are then refused. ``None``: streams come
            from ``env_ids`` (stream 0 without).
        autoreset: ``None`` (every row is a transition) or ``"next_step"``
            (drop the row after an episode end, per stream).
        discount_field: add the ``discount`` field; must be True when n > 1.
        key_names: how messages spell each key argument, by role (``"reward"``,
            ``"next_obs"``, ``"terminated"``, ``"truncated"``): a buffer passes
            ``"nstep_keys['reward']"`` and the like, as its user wrote them;
            ``None`` (default): this writer's own ``reward_key`` etc.

    Raises:
        ValueError: a needed field is missing or not found, ``discount`` is
            taken, keys coincide, a bad ``autoreset`` (``"same_step"``: see
            :func:`autoreset_mode`), or ``discount_field=False`` with n > 1.
        TypeError: a key that is not a string or None.
    """

    fields: dict[str, Field]
    output_fields: dict[str, Field]

    def __init__(
        self,
        fields: Mapping[str, Field],
        n: int,
        gamma: float,
        *,
        reward_key: str | None = None,
        next_obs_key: str | None = None,
        terminated_key: KeyArg = FIND,
        truncated_key: KeyArg = FIND,
        n_envs: int | None = None,
        autoreset: str | None = None,
        discount_field: bool = True,
        key_names: Mapping[str, str] | None = None,
    ) -> None:
        self._key_names = None if key_names is None else dict(key_names)
        self.n = check_int("n_step", n, minimum=1)
        self.gamma = check_real("gamma", gamma, minimum=0.0, maximum=1.0)
        self.fields = dict(fields)
        self.n_envs = None if n_envs is None else check_int("n_envs", n_envs, minimum=1)
        if autoreset is not None and autoreset != "next_step":
            bad = f"`autoreset` must be None or 'next_step', got autoreset={show(autoreset)}"
            raise ValueError(_SAME_STEP if _mode_name(autoreset) == "same_step" else bad)
        self.autoreset = autoreset
        if not isinstance(discount_field, bool | np.bool_):
            raise TypeError(
                f"`discount_field` must be a bool, got discount_field={show(discount_field)}"
            )
        if self.n > 1 and not discount_field:
            raise ValueError(
                "`discount_field` must be True when n_step > 1 (the bootstrap discount "
                f"varies), got discount_field=False with n_step={self.n}"
            )
        self.discount_field = bool(discount_field)
        # streams carry state only when windows span steps or rows get dropped
        self._tracks = self.n > 1 or self.autoreset is not None
        self._resolve_keys(reward_key, next_obs_key, terminated_key, truncated_key)
        if self.discount_field and DISCOUNT in self.fields:
            raise ValueError(f"field name `{DISCOUNT}` is reserved for n-step buffers")
        self.output_fields = dict(self.fields)
        if self.discount_field:
            self.output_fields[DISCOUNT] = Field((), np.dtype(np.float32))

        # a transition takes next_obs and the flags from its window's last
        # step, always a row of the add completing it: windows keep the other
        # fields of pending steps, and the reward in float64
        last = {self.next_obs_key, self.terminated_key, self.truncated_key}
        n1 = self.n == 1
        self._window_keys = tuple(
            f for f in self.fields if not n1 and f not in last and f != self.reward_key
        )
        self._kinds = tuple(
            (f, _LAST if n1 or f in last else _RETURN if f == self.reward_key else _FIRST)
            for f in self.fields
        ) + (((DISCOUNT, _DISCOUNT),) if self.discount_field else ())
        ends = [key for key in (self.terminated_key, self.truncated_key) if key is not None]
        self._flags = tuple((key, self.fields[key].shape == ()) for key in ends)
        self._bool_flags = {
            key for key in ends if self.fields[key] == Field((), np.dtype(np.bool_))
        }
        self._reward_size = 0
        self._scalar_reward = False
        if not n1 and self.reward_key is not None:
            rfield = self.fields[self.reward_key]
            self._reward_size = math.prod(rfield.shape)
            self._scalar_reward = rfield.shape == ()
            # the kernel writes returns in the field's dtype where numba can
            f32_64 = rfield.dtype in _KERNEL_FLOATS
            self._rdtype = rfield.dtype if f32_64 else np.dtype(np.float64)
        # the one-row paths on matched values (step_function, prepare_row): positions in
        # the input's field order, and whether this writer's fields allow them
        pos = {name: i for i, name in enumerate(self.fields)}
        self._flag_pos = tuple(pos[key] for key, _ in self._flags)
        self._win_pos = tuple(pos[f] for f in self._window_keys)
        self._reward_pos = -1 if self.reward_key is None else pos[self.reward_key]
        rf = None if self.reward_key is None else self.fields[self.reward_key]
        self._reward_type: Any = None if rf is None else rf.dtype.type
        # the vector-step path (step_function): every env at one pending length
        # (its kernel stores the returns into the reward field and reads the flags:
        # float32 / float64 rewards, flags of dtypes it compiles for)
        self._lockstep_ok = (
            self.n_envs is not None and self.n_envs > 1 and self.n > 1 and self._scalar_reward
            and rf is not None and rf.dtype in _KERNEL_FLOATS and self.autoreset is None
            and all(scalar and _kernel_dtype(self.fields[key].dtype) for key, scalar in self._flags)
        )  # fmt: skip
        # the end flags' input positions, two of them (-1: no such field)
        end_pos = (*self._flag_pos, -1, -1)
        self._end_pos = (end_pos[0], end_pos[1])
        self._rows_direct = (
            self._tracks
            and all(scalar for _, scalar in self._flags)
            and (rf is None or (rf.shape == () and rf.dtype.kind == "f"))
            and (self.n_envs is None or self.n_envs == 1)
        )
        self._empty_out = {
            name: _frozen(np.zeros((0, *f.shape), dtype=f.dtype))
            for name, f in self.output_fields.items()
        }
        # the discount of a full window (of the row itself when n == 1)
        self._disc_full = _frozen(np.array([self.gamma**self.n], dtype=np.float32))
        self._disc_one = self._disc_full[0]  # as a numpy float32 scalar
        self._env_rows: np.ndarray | None = None  # arange(n_envs), made at the first add
        self._dropped = 0
        self._version = 0
        self._reset_streams(4, min(self.n - 1, _RING0))

    #: what :meth:`_views` derives from the windows: views of them, and the steps
    #: specialised to them
    _DERIVED = (
        "_win3", "_rwin3", "_win_cols", "_win3_cols", "_rflat", "_return_fn", "_step",
        "_row_part", "_lock_part",
    )  # fmt: skip

    def __getstate__(self) -> dict[str, Any]:
        # a copy (copy.deepcopy, pickle) copies the windows, then derives its own views
        # and steps from them: copied, a view would be an array of its own, and a step
        # would write into the original's windows
        return {k: v for k, v in self.__dict__.items() if k not in self._DERIVED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _frozen(self._disc_full)  # (copied arrays are writeable again)
        for arr in self._empty_out.values():
            _frozen(arr)
        self._views()

    # -- construction helpers -------------------------------------------------
    def _arg(self, role: str) -> str:
        """How the key argument of ``role`` is spelt in messages (as its user wrote it)."""
        names = self._key_names
        if names is None:
            return f"{role}_key"
        return names.get(role, f"nstep_keys[{role!r}]")

    def _resolve_keys(self, reward: Any, next_obs: Any, term: Any, trunc: Any) -> None:
        fields = self.fields
        for arg, key in zip(("reward", "next_obs", "terminated", "truncated"),
                            (reward, next_obs, term, trunc), strict=True):  # fmt: skip
            if key is not None and key is not FIND and not isinstance(key, str):
                raise TypeError(f"`{self._arg(arg)}` must be a field name or None, got {show(key)}")
            if isinstance(key, str) and key not in fields:
                raise ValueError(
                    f"`{self._arg(arg)}` must name one of the fields {list(fields)}, got {key!r}"
                )
        self.reward_key: str | None = reward or _find(fields, REWARD_KEYS)
        self.next_obs_key: str | None = next_obs or _find(fields, NEXT_OBS_KEYS)
        if self.n > 1:
            for role, key, names in (("reward", self.reward_key, REWARD_KEYS),
                                     ("next_obs", self.next_obs_key, NEXT_OBS_KEYS)):  # fmt: skip
                if key is None:
                    what = "reward" if role == "reward" else "next observation"
                    raise ValueError(
                        f"n-step returns need a {what} field (one of {list(names)}, or named "
                        f"with {self._spell(role, '<field>')}), got fields {list(fields)}"
                    )
            rdtype = fields[str(self.reward_key)].dtype
            if rdtype.kind != "f":
                raise ValueError(
                    f"n-step returns need a floating reward field, got `{self.reward_key}` "
                    f"of dtype {rdtype}"
                )
        why = "n-step returns (n_step > 1)" if self.n > 1 else None
        if why is None and self.autoreset is not None:
            why = "autoreset='next_step'"
        disc = "the discount field" if self.discount_field else None
        self.terminated_key: str | None = self._end_key(
            term, TERMINATED_KEYS, "terminated", "episodes never terminate", why or disc
        )
        self.truncated_key: str | None = self._end_key(
            trunc, TRUNCATED_KEYS, "truncated", "the environment never truncates", why
        )
        keys = (self.reward_key, self.next_obs_key, self.terminated_key, self.truncated_key)
        used = [k for k in keys if k is not None]
        if len(set(used)) != len(used):
            roles = ("reward", "next_obs", "terminated", "truncated")
            got = ", ".join(f"{self._arg(r)}={k!r}" for r, k in zip(roles, keys, strict=True))
            raise ValueError(
                "the reward, next observation, termination and truncation fields must differ, "
                f"got {got}"
            )

    def _spell(self, role: str, value: str | None) -> str:
        """The argument that sets ``role`` to ``value``, as its user would write it."""
        shown = "None" if value is None else repr(value)
        if self._key_names is None:
            return f"{role}_key={shown}"
        key = self._arg(role)[len("nstep_keys[") : -1]  # 'reward' or 'reward_key', quoted
        return f"nstep_keys={{{key}: {shown}}}"

    def _end_key(
        self, given: Any, names: tuple[str, ...], role: str, never: str, why: str | None
    ) -> str | None:
        if given is not FIND:
            return given  # a field name (checked) or an explicit None
        found = _find(self.fields, names)
        if found is None and why is not None:
            what = role[:-2] + "ion"  # termination, truncation
            raise ValueError(
                f"{why} must know where episodes end, but no {what} field is among "
                f"{list(names)} in fields {list(self.fields)}: name it with "
                f"{self._spell(role, '<field>')}, or pass {self._spell(role, None)} if {never}"
            )
        return found

    def _powers(self, w: int) -> np.ndarray:
        """``gamma ** j`` for every window length a ring of ``w`` rows allows."""
        return np.array([self.gamma**j for j in range(min(self.n, w + 1) + 1)])

    def _reset_streams(self, cap: int, w: int) -> None:
        """Forget every stream; room for ``cap`` streams with rings of ``w`` rows."""
        self._cap, self._w = cap, max(w, 1)
        self._gpow = self._powers(self._w)
        self._gpow_list = self._gpow.tolist()
        self._meta = np.zeros((cap, _nk.META_COLS), dtype=np.int64)
        self._ids = np.zeros(cap, dtype=np.int64)
        self._win = {
            f: np.zeros((cap * self._w, *self.fields[f].shape), dtype=self.fields[f].dtype)
            for f in self._window_keys
        }
        self._rwin = np.zeros((cap * self._w, self._reward_size))
        self._views()
        self._row_of: dict[int, int] = {}
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None
        self._n_rows = 0
        self._n_pending = 0
        self._max_len = 0  # >= every pending length: when the ring must grow

    def _views(self) -> None:
        """(streams, w, ...) views of the windows, for the n_envs slice writes; the
        window columns with their input positions, for the one-row path."""
        self._win3 = {f: a.reshape(self._cap, self._w, *a.shape[1:]) for f, a in self._win.items()}
        self._rwin3 = self._rwin.reshape(self._cap, self._w, self._reward_size)
        self._win_cols = tuple(zip(self._win.values(), self._win_pos, strict=True))
        self._win3_cols = tuple(zip(self._win3.values(), self._win_pos, strict=True))
        self._rflat = self._rwin.reshape(-1)  # scalar rewards: one per window row
        self._make_steps()

    # -- properties -----------------------------------------------------------------
    @property
    def n_pending(self) -> int:
        """Transitions waiting for their window, over all streams. O(1)."""
        return self._n_pending

    @property
    def n_streams(self) -> int:
        """Streams seen (with ``n_envs``: all from the first add on; none when n == 1
        without autoreset, where streams carry no state). O(1)."""
        return self._n_rows

    @property
    def dropped(self) -> int:
        """Rows dropped by ``autoreset="next_step"``, ever (``clear`` keeps it). O(1)."""
        return self._dropped

    # -- streams ---------------------------------------------------------------------
    def _check_ids(self, k: int, env_ids: Any) -> np.ndarray:
        return check_env_ids(k, env_ids)

    def _rows(self, k: int, env_ids: Any) -> tuple[int | np.ndarray | None, list[int]]:
        """Check the stream information: the batch's stream row(s), new ids.

        An int for one row of a known stream; None when streams carry no
        state (n == 1 without autoreset).
        """
        if self.n_envs is not None:
            check_vector_step(self.n_envs, k, env_ids)
            if not self._tracks:
                return None, []
            if self._env_rows is None:
                self._env_rows = np.arange(k, dtype=np.int64)  # a cache, not state
            if self._n_rows == 0:  # the first add registers every env: row i = env i
                return self._env_rows, list(range(k))
            return (0 if k == 1 else self._env_rows), []
        if env_ids is None:
            if k > 1 and self._tracks:
                why = "n_step > 1" if self.n > 1 else "autoreset='next_step'"
                raise ValueError(
                    f"a batch of {k} transitions needs stream information when {why}: pass "
                    "`env_ids` (one id per row: the environment or actor it comes from; rows "
                    f"of one id are consecutive steps of it, e.g. env_ids=np.zeros({k}, "
                    "dtype=np.int64) for one environment's trajectory), or set `n_envs` if "
                    "every batch is one step of each of n_envs environments (row i = env i); "
                    "got env_ids=None and n_envs=None"
                )
            sid = 0
        elif type(env_ids) is int and k == 1 and 0 <= env_ids < 2**63:
            sid = env_ids  # the common one-actor call, without numpy
        else:
            ids = self._check_ids(k, env_ids)
            if not self._tracks:
                return None, []
            if k > 1:
                return self._lookup(ids)
            sid = int(ids[0])
        if not self._tracks:
            return None, []
        row = self._row_of.get(sid)
        if row is None:
            return np.array([self._n_rows], dtype=np.int64), [sid]
        return row, []

    def _lookup(self, ids: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Rows of ``ids`` and the new ids (rows after the known ones, in order
        of first appearance). O(k log S), vectorized."""
        if self._sorted is None:
            self._sorted = sort_ids(self._ids[: self._n_rows])
        return lookup_rows(self._sorted, self._n_rows, ids)

    # -- the two-phase add -------------------------------------------------------------
    def prepare(self, batch: Mapping[str, np.ndarray], k: int, env_ids: Any = None) -> NStepPlan:
        """Check the stream information and compute what this add completes.

        Pure: changes nothing (new streams and grown arrays wait in the plan
        for :meth:`commit`). O(k + m n) for ``m`` completed transitions (the
        module docstring has the details).

        Args:
            batch: ``{field: (k, *shape)}`` from
                :func:`fastper.storage.coerce_batch` (validated and cast).
            k: number of rows.
            env_ids: ``None``, or the stream id of each row (ints >= 0; a
                scalar when ``k == 1``; lists and torch tensors accepted).

        Returns:
            An :class:`NStepPlan`, for :meth:`commit` before the next ``prepare``.

        Raises:
            ValueError: a batch of several rows without ``env_ids`` or
                ``n_envs`` (n > 1 or autoreset), a batch that is not
                ``n_envs`` rows, ``env_ids`` with ``n_envs``, or ``env_ids`` of
                the wrong length or negative.
            TypeError: ``env_ids`` that are not integers.
        """
        rows, new_ids = self._rows(k, env_ids)
        if rows is None:  # n == 1 without autoreset: every row as it is
            out = dict(batch)
            if self.discount_field:
                term = self._flag(batch, self.terminated_key, k)
                g = np.float32(self.gamma)
                out[DISCOUNT] = (
                    np.full(k, g) if term is None else np.where(term, np.float32(0.0), g)
                )
            return NStepPlan(out, k, 0)
        if type(rows) is int:
            plan = self._prepare_one(batch, rows)
            if plan is not None:
                return plan
            rows = np.array([rows], dtype=np.int64)
        assert isinstance(rows, np.ndarray)
        term = self._flag(batch, self.terminated_key, k)
        trunc = self._flag(batch, self.truncated_key, k)
        if term is None:
            term = np.zeros(k, dtype=bool)
        if trunc is None:
            trunc = term

        grown = None
        meta, w, gpow = self._meta, self._w, self._gpow
        n_rows = self._n_rows + len(new_ids)
        # a window may outgrow the ring (only when it is shorter than n - 1)
        wider = w < self.n - 1 and self._max_len + k > w
        if n_rows > self._cap or wider:
            new_w = min(self.n - 1, max(2 * w, self._max_len + k)) if wider else w
            grown = self._grown(max(n_rows, self._cap), new_w)
            meta, w, gpow = grown[0], grown[5], grown[6]
        nr = self._reward_size
        cap_out = k + min(self._n_pending, k * (self.n - 1))
        if nr:
            assert self.reward_key is not None
            rb = batch[self.reward_key].reshape(k, nr)
            if not _kernel_dtype(rb.dtype):
                # (the kernel has no float16, longdouble or non-native types: widened
                # into float64, which the windows hold anyway)
                rb = rb.astype(np.float64)
            rout = np.empty((cap_out, nr), dtype=self._rdtype)
        else:
            rb, rout = np.zeros((k, 0)), np.empty((cap_out, 0))
        dout = np.empty(cap_out, dtype=np.float32)
        ibuf = np.empty(2 * cap_out + 6 * k, dtype=np.int64)
        n, auto = min(self.n, _N_LIMIT), self.autoreset is not None
        m, n_u, n_store, dropped, delta, longest, flags = _nk.plan_batch(
            rows, term, trunc, meta, n, self._w, w, auto, self._rwin, rb, gpow, ibuf, rout, dout
        )
        out = self._empty_out
        if m:
            out = self._gather(batch, m, ibuf, cap_out, rout, dout, flags)
        apply = (_BATCH, self._version, batch, rb, ibuf, cap_out, k, n_u, n_store, flags)
        return NStepPlan(out, m, dropped, (*apply, delta, longest, new_ids, grown))

    def _flag(self, batch: Mapping[str, np.ndarray], key: str | None, k: int) -> Any:
        """(k,) bool: does the row's flag field say so (any nonzero entry)."""
        if key is None:
            return None
        arr = batch[key]
        if key in self._bool_flags:
            return arr  # a scalar bool field (the batch holds the field's dtype)
        return (arr != 0).reshape(k, -1).any(axis=1)

    def _prepare_one(self, batch: Mapping[str, np.ndarray], r: int) -> NStepPlan | None:
        """One row of known stream ``r`` that ends nothing, in O(n) Python; else None."""
        clock, length, skip, _ = self._meta[r].tolist()
        if skip:
            return NStepPlan(self._empty_out, 0, 1, (_DROP, self._version, r, clock + 1))
        for key, scalar in self._flags:
            flag = batch[key]
            if flag[0] if scalar else flag.any():
                return None  # an episode end: the kernel flushes the window
        n, w = self.n, self._w
        if n == 1:  # autoreset only: the row is its own transition
            out = {name: batch[name] for name, _ in self._kinds if name != DISCOUNT}
            if self.discount_field:
                out[DISCOUNT] = self._disc_full
            return NStepPlan(out, 1, 0, (_ONE, self._version, r, -1, batch, clock + 1, 0))
        at = r * w + clock % w  # where this row waits
        if length + 1 < n:
            if length + 1 > w:
                return None  # the ring must grow first
            plan = (_ONE, self._version, r, at, batch, clock + 1, length + 1)
            return NStepPlan(self._empty_out, 0, 0, plan)
        if not self._scalar_reward:
            return None
        assert self.reward_key is not None
        acc = self._window_return(r, clock, float(batch[self.reward_key][0]))
        first = r * w + (clock - length) % w  # == at: copied before commit() reuses it
        out = {}
        for name, kind in self._kinds:
            if kind == _LAST:
                out[name] = batch[name]
            elif kind == _FIRST:
                out[name] = self._win[name][first : first + 1].copy()
            elif kind == _RETURN:
                out[name] = np.array([acc], dtype=self.fields[name].dtype)  # shape (1,)
            else:
                out[name] = self._disc_full
        return NStepPlan(out, 1, 0, (_ONE, self._version, r, at, batch, clock + 1, length))

    def _window_return(self, r: int, clock: int, reward: float) -> float:
        """The return of stream ``r``'s complete window (``w == n - 1`` pending steps
        of scalar reward) closed by a step of ``reward``: summed in the kernel's
        order, so the same bits (:func:`_return_lines`). O(n)."""
        return self._return_fn(r * self._w, clock, reward)

    def _make_steps(self) -> None:
        """The window return, and the parts of :meth:`step_function`, made for the
        current windows (again whenever they are replaced: new streams, a load);
        the step made before is dropped."""
        w = self._w
        gp = self._gpow_list
        constants: dict[str, Any] = {
            "RITEM": self._rflat.item, "G": gp, "META": self._meta, "RFLAT": self._rflat,
            "RTYPE": self._reward_type, "DISC": self._disc_one, "CLOCK": _nk.CLOCK,
            "isfinite": math.isfinite,
        }  # fmt: skip
        constants.update({f"G{j}": gp[j] for j in range(min(w, _UNROLL) + 1)})
        (self._return_fn,) = specialise(
            "nstep.window_return", _return_source(w), constants, "window_return"
        )
        #: (the storage's rows it stores into, the step): see step_function
        self._step: tuple[Any, Callable[..., int] | None] | None = None
        #: the one-row part of the step: (window row views, stream views, constants), or None
        self._row_part: tuple[tuple[bool, ...], bool, dict[str, Any]] | None = None
        if self._rows_direct and self.n > 1 and w == self.n - 1 and self._scalar_reward:
            row_views = tuple(
                col.ndim > 1 and col.shape[0] <= _ROW_VIEWS for col, _ in self._win_cols
            )
            for j, (col, _) in enumerate(self._win_cols):
                constants[f"WIN{j}"] = col
                if row_views[j]:
                    constants[f"ROWS{j}"] = tuple(col)  # (row views of the window column)
            stream_views = self._cap <= _ROW_VIEWS
            if stream_views:  # (row views of the streams' meta and reward rings)
                constants["MROWS"] = tuple(self._meta)
                if w <= _UNROLL:  # (a longer window's return reads its ring by item)
                    constants["RROWS"] = tuple(self._rflat.reshape(self._cap, w))
            self._row_part = (row_views, stream_views, constants)
        #: the vector-step part of the step: (views, constants), or None
        self._lock_part: tuple[bool, dict[str, Any]] | None = None
        if self._lockstep_ok:
            assert self.n_envs is not None
            k = self.n_envs
            meta, views = self._meta, w <= _VIEW_ROWS
            lock_constants = {
                "N_ENVS": k, "N": min(self.n, _N_LIMIT), "W": w, "META": meta, "RWIN": self._rwin,
                "GPOW": self._gpow, "LOCKSTEP": _nk.lockstep, "F16": np.dtype(np.float16),
                "NO_ENDS": _frozen(np.zeros(k, dtype=np.bool_)),
                "DISC_F": float(self._disc_full[0]),
            }  # fmt: skip
            for j, (col3, _) in enumerate(self._win3_cols):
                lock_constants[f"WIN3_{j}"] = col3
                if views:
                    lock_constants[f"AT{j}"] = tuple(col3[:k, at] for at in range(w))
            self._lock_part = (views, lock_constants)

    def step_function(self, matcher: Any, rows: Any) -> Callable[..., int] | None:
        """The most frequent n-step adds in one call, written out for this writer's
        fields and windows and for a storage's columns; None where this writer
        has neither of its cases. Made once for ``rows`` and these windows
        (again after they are replaced: new streams, a load).

        ``step(writer, transition, env_ids, check_reward, start)`` takes an add's
        dict of values: ``matcher`` (a :class:`~fastper.storage.DirectRows`
        over :attr:`fields`) checks them as :meth:`~fastper.storage.DirectRows.match`
        does. It then takes two cases, with the rules of :meth:`prepare` and
        :meth:`commit`: one transition of a known stream whose window is
        complete and that ends nothing, or a vector step (``n_envs`` rows, env i
        = stream i, no ``env_ids``) in the steady state: every env at one
        pending length, no episode end in the step, no autoreset, a scalar
        float reward; then every env's window completes at once, or none does
        (while they fill). It computes the completed transitions (the window's
        first step, the return summed as the kernel sums it, this step's
        ``next_obs`` and flags, the discount), stores them into the columns of
        ``rows`` (a :class:`~fastper.storage.DirectRows` of the storage, fields
        in :attr:`output_fields` order) from slot ``start`` (a vector step's rows
        must fit before the ring's end, or it is not taken), then puts the step
        in the windows. It returns how many transitions it stored (the caller
        then commits them to its ring), -1 where the vector step waits in the
        windows with nothing stored, and 0, with nothing changed, for anything
        else (values ``match`` refuses, a new stream, an episode end, a dropped
        row, a window still filling (one row) or out of step (a vector step), a
        non-finite reward (``check_reward``), rows that would wrap): take
        :meth:`prepare_row` or :meth:`prepare`. Straight-line code with no
        Python loop over rows (:mod:`fastper._codegen`); O(k n).
        """
        cached = self._step
        if cached is not None and cached[0] is rows:
            return cached[1]
        step = None
        if (self._row_part is not None or self._lock_part is not None) and tuple(
            rows.names
        ) == tuple(self.output_fields):
            checks, constants = matcher.check_lines()  # (a dict of its own)
            lines = ["def step(S, transition, env_ids, check_reward, start):", *checks]
            count = len(self.fields)
            lines.append("    if rows == -1:")
            constants.update(rows.store_constants())
            if self._row_part is not None:
                row_views, stream_views, row_constants = self._row_part
                body = _row_lines(
                    count, self._win_pos, self._flag_pos, self._reward_pos, self._w,
                    self.n_envs is None, row_views, stream_views,
                    lambda out: rows.store_lines(out, -1),
                )  # fmt: skip
                lines += ["    " + line for line in body]
                constants.update(row_constants)
            else:
                lines.append("        return 0")
            if self._lock_part is not None:
                views, lock_constants = self._lock_part
                k = self.n_envs
                assert k is not None
                lines += _lockstep_lines(
                    count, self._win_pos, self._end_pos, self._reward_pos, views,
                    lambda out: rows.store_lines(out, k, blocks=True),
                )  # fmt: skip
                constants.update(lock_constants)
                constants.update(rows.block_columns(k))
                # (the kernel stores the returns and the discounts into their columns)
                constants["RET_OUT"] = rows.columns[self._reward_pos]
                constants["DISC_OUT"] = rows.columns[count]
            else:
                lines.append("    return 0")
            (step,) = specialise("nstep.step", "\n".join(lines) + "\n", constants, "step")
        self._step = (rows, step)
        return step

    def prepare_row(
        self, values: list[Any], env_ids: Any, check_reward: bool
    ) -> tuple[list[Any] | None, tuple[Any, ...]] | None:
        """:meth:`prepare` for one transition of a known stream that ends nothing, as
        plain values, where :meth:`step_function` does not take it: a window still
        filling, or ``n == 1`` (autoreset only); ``None``: take :meth:`prepare`
        (which checks everything). A complete window is :meth:`step_function`'s.

        ``values``: one row in :attr:`fields` order, each as
        :class:`~fastper.storage.DirectRows` matched it (of the field's shape,
        storable with no cast). ``check_reward``: a row whose reward is not finite
        takes :meth:`prepare` (the buffer refuses it there, naming it). Returns
        the completed transition's values in :attr:`output_fields` order (None
        when nothing completes) and what :meth:`commit_row` applies. Pure. O(1).
        """
        if not self._rows_direct:
            return None
        if env_ids is None:
            sid = 0
        elif type(env_ids) is int and self.n_envs is None and 0 <= env_ids < 2**63:
            sid = env_ids
        else:
            return None
        r = self._row_of.get(sid)
        if r is None:
            return None  # a new stream
        clock, length, skip, _ = self._meta[r].tolist()
        if skip:
            return None
        for p in self._flag_pos:
            if values[p]:
                return None  # an episode end (any nonzero flag): windows are flushed
        reward = 0.0
        rp = self._reward_pos
        if rp >= 0:  # the reward as the field stores it (the windows keep that value)
            v = values[rp]
            rtype = self._reward_type
            reward = float(v) if type(v) is rtype else float(rtype(v))
            if check_reward and not math.isfinite(reward):
                return None  # the general path names the row
        n, w = self.n, self._w
        disc = self._disc_one
        if n == 1:  # autoreset only: the row is its own transition
            out = [*values, disc] if self.discount_field else list(values)
            return out, (self._version, r, -1, values, 0.0, clock + 1, False)
        at = r * w + clock % w  # where this row waits
        if length + 1 < n and length + 1 <= w:  # (longer than w: the ring must grow first)
            return None, (self._version, r, at, values, reward, clock + 1, True)
        return None

    def commit_row(self, apply: tuple[Any, ...]) -> None:
        """Apply what :meth:`prepare_row` returned. O(fields).

        Raises:
            RuntimeError: it is stale (see :meth:`commit`).
        """
        version, r, at, values, reward, clock, longer = apply
        if version != self._version:
            raise RuntimeError("this n-step plan is stale: prepare() it again")
        self._version = version + 1
        if at >= 0:
            for col, p in self._win_cols:
                col[at] = values[p]
            self._rflat[at] = reward
        if longer:
            self._advance(r, clock, int(self._meta[r, _nk.LENGTH]) + 1)
        else:
            self._meta[r, _nk.CLOCK] = clock

    def _advance(self, r: int, clock: int, length: int) -> None:
        """Stream ``r`` after one row: its clock and pending count."""
        meta = self._meta
        meta[r, _nk.CLOCK] = clock
        if length != meta[r, _nk.LENGTH]:
            meta[r, _nk.LENGTH] = length
            self._n_pending += 1
            self._max_len = max(self._max_len, length)

    def _gather(
        self,
        batch: Mapping[str, np.ndarray],
        m: int,
        ibuf: np.ndarray,
        cap_out: int,
        rout: np.ndarray,
        dout: np.ndarray,
        flags: int,
    ) -> dict[str, np.ndarray]:
        """The completed transitions' fields, from the windows and the batch."""
        first = ibuf[:m]
        last = ibuf[cap_out : cap_out + m]
        parts = None
        out: dict[str, np.ndarray] = {}
        for name, kind in self._kinds:
            if kind == _LAST:
                src = batch[name]
                out[name] = src if flags & _nk.LAST_IS_BATCH else src.take(last, axis=0)
            elif kind == _FIRST:
                if flags & _nk.FIRST_IS_BATCH:
                    out[name] = batch[name]
                elif flags & _nk.FIRST_ALL_WINDOW:
                    out[name] = self._win[name].take(first, axis=0)
                else:
                    if parts is None:
                        from_win = first >= 0
                        parts = (from_win, first[from_win], ~from_win, -1 - first[~from_win])
                    f = self.fields[name]
                    arr = np.empty((m, *f.shape), dtype=f.dtype)
                    arr[parts[0]] = self._win[name].take(parts[1], axis=0)
                    arr[parts[2]] = batch[name].take(parts[3], axis=0)
                    out[name] = arr
            elif kind == _RETURN:
                f = self.fields[name]
                if self._scalar_reward and rout.dtype == f.dtype:
                    out[name] = rout[:m, 0]
                else:
                    out[name] = rout[:m].reshape((m, *f.shape)).astype(f.dtype, copy=False)
            else:
                out[name] = dout[:m]
        return out

    @staticmethod
    def _pending_rows(meta: np.ndarray, w: int) -> np.ndarray:
        """Flat ring rows of every pending step (streams in order, oldest first)
        for the streams' ``meta`` and rings of ``w`` rows. O(streams + pending)."""
        lengths = meta[:, _nk.LENGTH]
        rep = np.repeat(np.arange(meta.shape[0], dtype=np.int64), lengths)
        within = np.arange(rep.shape[0], dtype=np.int64) - (np.cumsum(lengths) - lengths)[rep]
        return rep * w + (meta[rep, _nk.CLOCK] - lengths[rep] + within) % w

    def _grown(self, cap: int, w: int) -> tuple[Any, ...]:
        """Copies of the per-stream arrays with room for ``cap`` streams (doubling)
        and rings of ``w`` rows. O(streams + pending)."""
        if cap > self._cap:
            cap = max(2 * self._cap, cap)
        used = self._n_rows
        meta = np.zeros((cap, _nk.META_COLS), dtype=np.int64)
        meta[:used] = self._meta[:used]
        ids = np.zeros(cap, dtype=np.int64)
        ids[:used] = self._ids[:used]
        src = self._pending_rows(self._meta[:used], self._w)
        dst = self._pending_rows(self._meta[:used], w)
        win = {}
        for name, arr in self._win.items():
            win[name] = np.zeros((cap * w, *arr.shape[1:]), dtype=arr.dtype)
            win[name][dst] = arr[src]
        rwin = np.zeros((cap * w, self._reward_size))
        rwin[dst] = self._rwin[src]
        gpow = self._gpow if w == self._w else self._powers(w)
        return meta, ids, win, rwin, cap, w, gpow

    def commit(self, plan: NStepPlan) -> None:
        """Apply the plan of the last :meth:`prepare`. O(k + touched streams).

        Raises:
            RuntimeError: the plan is stale (another plan was committed, or the
                writer cleared or loaded, since it was prepared): a caller's bug.
        """
        apply = plan._apply
        if apply is None:
            return  # nothing changes (n == 1 without autoreset)
        if apply[1] != self._version:
            raise RuntimeError("this n-step plan is stale: prepare() it again")
        self._version += 1
        kind = apply[0]
        if kind == _ONE:
            _, _, r, at, batch, clock, length = apply
            if at >= 0:
                for name in self._window_keys:
                    self._win[name][at] = batch[name][0]
                if self._reward_size:
                    assert self.reward_key is not None
                    self._rwin[at] = batch[self.reward_key].reshape(-1)
            self._advance(r, clock, length)
            return
        if kind == _DROP:
            self._meta[apply[2], _nk.SKIP] = 0
            self._meta[apply[2], _nk.CLOCK] = apply[3]
            self._dropped += 1
            return
        _, _, batch, rb, ibuf, cap_out, k, n_u, n_store, flags, delta, longest, new_ids, grown = (
            apply
        )
        if grown is not None:
            self._meta, self._ids, self._win, self._rwin, self._cap, self._w, self._gpow = grown
            self._gpow_list = self._gpow.tolist()
            self._views()
        if self.n_envs is not None and self._window_keys:
            # every env's row to the ring position of the common clock, one
            # slice per field; rows not kept land where no pending step is
            at = int(self._meta[0, _nk.CLOCK]) % self._w
            for name in self._window_keys:
                self._win3[name][:k, at] = batch[name]
            if self._reward_size:
                self._rwin3[:k, at] = rb
        elif n_store:
            o_dst = 2 * cap_out + 4 * k
            dst = ibuf[o_dst : o_dst + n_store]
            src = None if flags & _nk.STORE_IS_BATCH else ibuf[o_dst + k : o_dst + k + n_store]
            for name in self._window_keys:
                self._win[name][dst] = batch[name] if src is None else batch[name][src]
            if self._reward_size == 1:  # 1-D fancy assignment: several times faster
                rb = rb.reshape(-1)
                self._rwin.reshape(-1)[dst] = rb if src is None else rb[src]
            elif self._reward_size:
                self._rwin[dst] = rb if src is None else rb[src]
        o_u = 2 * cap_out
        new_meta = ibuf[o_u + k : o_u + k + 3 * n_u].reshape(n_u, 3)
        if flags & _nk.TOUCHED_IS_RANGE:
            self._meta[:n_u, :3] = new_meta
        else:
            self._meta[ibuf[o_u : o_u + n_u], :3] = new_meta
        if new_ids:
            start = self._n_rows
            for i, sid in enumerate(new_ids):
                self._row_of[sid] = start + i
            self._ids[start : start + len(new_ids)] = new_ids
            self._n_rows = start + len(new_ids)
            self._sorted = None
        self._n_pending += delta
        self._max_len = max(self._max_len, longest)
        self._dropped += plan.dropped

    # -- housekeeping -------------------------------------------------------------------
    def clear(self) -> None:
        """Drop every pending window. O(streams).

        Streams stay known, with their autoreset state: an env that just ended
        still sends its reset row next, whatever happened to the buffer.
        """
        self._meta[:, _nk.LENGTH] = 0
        self._n_pending = 0
        self._max_len = 0
        self._version += 1

    def settings(self) -> dict[str, Any]:
        """The constructor's arguments (field names resolved), JSON-able. O(1)."""
        return {
            "n": self.n,
            "gamma": self.gamma,
            "reward_key": self.reward_key,
            "next_obs_key": self.next_obs_key,
            "terminated_key": self.terminated_key,
            "truncated_key": self.truncated_key,
            "n_envs": self.n_envs,
            "autoreset": self.autoreset,
            "discount_field": self.discount_field,
        }

    def state_dict(self) -> dict[str, Any]:
        """The pending state: JSON values and top-level numpy arrays. O(pending).

        Keys: ``format`` (2); ``stream_ids`` (int64, the streams in the order
        they appeared); ``lengths`` (int64, pending steps per stream);
        ``skip_next`` (bool, per stream: its next row follows an episode end,
        autoreset); ``dropped`` (int); and ``pending/<field>`` for every field
        a pending step keeps (not ``next_obs`` nor the flags, which a pending
        step never passes on), the streams' steps one after another, oldest
        first.
        """
        meta = self._meta[: self._n_rows]
        idx = self._pending_rows(meta, self._w)
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "stream_ids": self._ids[: self._n_rows].copy(),
            "lengths": meta[:, _nk.LENGTH].copy(),
            "skip_next": meta[:, _nk.SKIP] != 0,
            "dropped": self._dropped,
        }
        for name in self._window_keys:
            state[f"pending/{name}"] = self._win[name].take(idx, axis=0)
        if self._reward_size:
            assert self.reward_key is not None
            f = self.fields[self.reward_key]
            rew = self._rwin.take(idx, axis=0).reshape((idx.shape[0], *f.shape))
            state[f"pending/{self.reward_key}"] = rew.astype(f.dtype)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the pending state with ``state`` (from :meth:`state_dict`). O(pending).

        Also reads the legacy one-window form ``{"pending/<field>": array}``
        of fastper 0.1 (every input field, no stream information): its rows
        become stream 0's window.

        Raises:
            ValueError: anything inconsistent (unknown or missing keys, wrong
                dtypes or shapes, a window longer than n - 1, a pending step
                that ends an episode, duplicate or negative stream ids, ids
                outside ``n_envs``); the writer is then unchanged.
            TypeError: ``state`` is not a mapping.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"n-step state must be a mapping, got {show(state)}")
        ids, lengths, skip, dropped, pending = self._check_state(state)
        # nothing below can fail
        longest = int(lengths.max(initial=0))
        known = ids if self.n_envs is None or not ids.size else np.arange(self.n_envs)
        self._reset_streams(max(4, known.shape[0]), min(self.n - 1, max(_RING0, longest)))
        self._row_of = {int(i): r for r, i in enumerate(known.tolist())}
        self._ids[: known.shape[0]] = known
        self._n_rows = known.shape[0]
        if self.n_envs is None:
            rows = np.arange(ids.shape[0], dtype=np.int64)
            self._meta[rows, _nk.CLOCK] = lengths
        else:
            rows = ids  # row i = env i; one clock for all, as every add moves all
            self._meta[: self._n_rows, _nk.CLOCK] = longest
        self._meta[rows, _nk.LENGTH] = lengths
        self._meta[rows, _nk.SKIP] = skip
        idx = self._pending_rows(self._meta[: self._n_rows], self._w)
        for name in self._window_keys:
            self._win[name][idx] = pending[name]
        if self._reward_size:
            assert self.reward_key is not None
            self._rwin[idx] = pending[self.reward_key].reshape(idx.shape[0], self._reward_size)
        self._n_pending = int(lengths.sum())
        self._max_len = longest
        self._dropped = dropped
        self._version += 1

    def _check_state(
        self, state: Mapping[str, Any]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, dict[str, np.ndarray]]:
        keys = {f"pending/{name}": name for name in self.fields}
        legacy = "stream_ids" not in state
        meta_keys = () if legacy else ("format", "stream_ids", "lengths", "skip_next", "dropped")
        unknown = [k for k in state if k not in keys and k not in meta_keys]
        needed = list(keys) if legacy else [f"pending/{f}" for f in self._window_keys]
        if not legacy and self._reward_size:
            needed.append(f"pending/{self.reward_key}")
        needed += list(meta_keys)
        missing = [k for k in needed if k not in state]
        if unknown or missing:
            raise ValueError(
                f"n-step state must have the keys {needed}, got unknown keys {unknown} and "
                f"missing keys {missing}"
            )
        arrays = {k: _array(state, k) for k in state if k not in ("format", "dropped")}
        if legacy:  # one stream's window
            shapes = {k: a.shape for k, a in arrays.items()}
            if len({s[:1] for s in shapes.values()}) != 1 or any(not s for s in shapes.values()):
                raise ValueError(f"legacy n-step state: arrays must have one length, got {shapes}")
            total = next(iter(shapes.values()))[0]
            ids = np.zeros(1 if total else 0, dtype=np.int64)
            lengths = np.full(ids.shape[0], total, dtype=np.int64)
            skip = np.zeros(ids.shape[0], dtype=bool)
            dropped = 0
        else:
            if state["format"] != STATE_FORMAT:
                raise ValueError(
                    f"n-step state `format` must be {STATE_FORMAT}, got {show(state['format'])}"
                )
            ids, lengths, skip = arrays["stream_ids"], arrays["lengths"], arrays["skip_next"]
            for name, arr in (("stream_ids", ids), ("lengths", lengths)):
                if arr.ndim != 1 or arr.dtype.kind not in "iu":
                    raise ValueError(f"n-step state `{name}` must be 1-D integers, got {show(arr)}")
            if skip.ndim != 1 or skip.dtype != np.bool_:
                raise ValueError(f"n-step state `skip_next` must be 1-D bool, got {show(skip)}")
            if not ids.shape == lengths.shape == skip.shape:
                raise ValueError(
                    "n-step state `stream_ids`, `lengths` and `skip_next` must have one entry "
                    f"per stream, got {ids.shape[0]}, {lengths.shape[0]} and {skip.shape[0]}"
                )
            if ids.size and (int(ids.min()) < 0 or np.unique(ids).shape[0] != ids.shape[0]):
                raise ValueError(
                    f"n-step state `stream_ids` must be distinct and >= 0, got {show(ids)}"
                )
            ids, lengths = ids.astype(np.int64), lengths.astype(np.int64)
            if (skip & (lengths != 0)).any() or (skip.any() and self.autoreset is None):
                raise ValueError(
                    "n-step state `skip_next` (the stream's next row follows an episode end) "
                    "needs autoreset and an empty window, got it with autoreset="
                    f"{self.autoreset!r} and lengths={show(lengths[skip])}"
                )
            dropped = state["dropped"]
            if not isinstance(dropped, int | np.integer) or isinstance(dropped, bool):
                raise ValueError(f"n-step state `dropped` must be an int, got {show(dropped)}")
            if dropped < 0:
                raise ValueError(f"n-step state `dropped` must be >= 0, got {dropped}")
            dropped = int(dropped)
        if lengths.size and (int(lengths.min()) < 0 or int(lengths.max()) > self.n - 1):
            raise ValueError(
                f"n-step state `lengths` must lie in [0, n - 1 = {self.n - 1}] (a window holds "
                f"at most n - 1 pending steps), got lengths={show(lengths)}"
            )
        if self.n_envs is not None and ids.size and int(ids.max()) >= self.n_envs:
            raise ValueError(
                f"n-step state has streams unknown with n_envs={self.n_envs}: "
                f"{show(ids[ids >= self.n_envs])}"
            )
        if self.n_envs is not None and not legacy and ids.size not in (0, self.n_envs):
            raise ValueError(
                f"n-step state must list no stream or all n_envs={self.n_envs} of them, got "
                f"{ids.size}"
            )
        if not self._tracks and ids.size:
            raise ValueError(f"n-step state has {ids.size} stream(s); n_step=1 keeps none")
        total = int(lengths.sum())
        pending = {}
        for key, name in keys.items():
            if key in arrays:
                arr, f = arrays[key], self.fields[name]
                if arr.dtype != f.dtype or arr.shape != (total, *f.shape):
                    raise ValueError(
                        f"n-step state `{key}` must have dtype {f.dtype} and shape "
                        f"{(total, *f.shape)}, got dtype {arr.dtype} and shape {arr.shape}"
                    )
                if name in (self.terminated_key, self.truncated_key) and (arr != 0).any():
                    raise ValueError(
                        f"n-step state `{key}`: a pending step cannot end an episode (its "
                        "window would have been written)"
                    )
                pending[name] = arr
        return ids, lengths, skip, dropped, pending


def check_vector_step(n_envs: int, k: int, env_ids: Any) -> None:
    """With ``n_envs`` set, an add is one step of every env: ``k == n_envs`` rows, no ``env_ids``."""
    if env_ids is not None:
        raise ValueError(
            f"`env_ids` must be None when n_envs={n_envs} is set (row i is env "
            f"i), got env_ids={show(env_ids)}"
        )
    if k != n_envs:
        single = k == 1 and " (a single transition is refused: its env is ambiguous)"
        raise ValueError(
            f"with n_envs={n_envs} every add must be one step of every "
            f"environment, a batch of exactly {n_envs} rows (row i = env i), got "
            f"{k} row(s){single or ''}"
        )


def check_env_ids(k: int, env_ids: Any) -> np.ndarray:
    """``env_ids`` of an add of ``k`` rows as int64 (one id >= 0 per row), or a clear error."""
    arr = to_numpy(env_ids)
    if arr.ndim == 0 and k == 1:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(
            f"`env_ids` must be 1-D with one id per row ({k}), got env_ids with shape {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"`env_ids` must hold integers, got env_ids with dtype {arr.dtype}: {show(arr)}"
        )
    if arr.shape[0] != k:
        raise ValueError(
            f"`env_ids` must have one id per row ({k}), got {arr.shape[0]} ids: {show(arr)}"
        )
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError(f"`env_ids` must be >= 0, got env_ids={show(arr)}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > 2**63 - 1:
        raise ValueError(f"`env_ids` must be < 2**63, got env_ids={show(arr)}")
    return arr.astype(np.int64, copy=False)


def sort_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids sorted, their rows): the index :func:`lookup_rows` searches. O(S log S)."""
    order = np.argsort(ids, kind="stable")
    return ids[order], order.astype(np.int64)


def lookup_rows(
    index: tuple[np.ndarray, np.ndarray], n_known: int, ids: np.ndarray
) -> tuple[np.ndarray, list[int]]:
    """Stream rows of ``ids`` and the new ids, in order of first appearance.

    ``index`` is :func:`sort_ids` of the ``n_known`` known ids; a new id gets
    row ``n_known``, ``n_known + 1``, ... by first appearance. O(k log S).
    """
    sids, srows = index
    if sids.shape[0]:
        pos = np.minimum(np.searchsorted(sids, ids), sids.shape[0] - 1)
        hit = sids[pos] == ids
        rows = srows[pos]
        if hit.all():
            return rows, []
    else:
        hit = np.zeros(ids.shape[0], dtype=bool)
        rows = np.zeros(ids.shape[0], dtype=np.int64)
    miss = ids[~hit]
    uniq, first = np.unique(miss, return_index=True)
    order = np.argsort(first, kind="stable")
    new_row = np.empty(uniq.shape[0], dtype=np.int64)
    new_row[order] = n_known + np.arange(uniq.shape[0], dtype=np.int64)
    rows[~hit] = new_row[np.searchsorted(uniq, miss)]
    return rows, uniq[order].tolist()


def _array(state: Mapping[str, Any], key: str) -> np.ndarray:
    value = state[key]
    if not isinstance(value, np.ndarray):
        raise ValueError(f"n-step state `{key}` must be a numpy array, got {show(value)}")
    return value
