"""Schedules for ``alpha`` and ``beta``: callables of the step.

Every schedule is a small frozen dataclass, so it can be described in a
checkpoint (:meth:`Schedule.to_dict`) and rebuilt (:func:`from_dict`) without
pickle. A buffer also accepts any plain callable ``step -> float``; such a
buffer can still be saved, but the callable must be passed again on load.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._validation import check_int, check_real

ScheduleLike = float | int | Callable[[int], float]


class Schedule:
    """Base class: ``schedule(step) -> value`` for integer ``step >= 0``."""

    kind: str = ""

    def __call__(self, step: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description, inverse of :func:`from_dict`."""
        d = {k: v for k, v in self.__dict__.items()}
        d["kind"] = self.kind
        return d


@dataclass(frozen=True)
class Constant(Schedule):
    """Always ``value``."""

    value: float
    kind = "constant"

    def __post_init__(self) -> None:
        check_real("value", self.value)

    def __call__(self, step: int) -> float:
        return float(self.value)


@dataclass(frozen=True)
class Linear(Schedule):
    """From ``start`` at step 0 to ``end`` at ``steps``, then flat at ``end``."""

    start: float
    end: float
    steps: int
    kind = "linear"

    def __post_init__(self) -> None:
        check_real("start", self.start)
        check_real("end", self.end)
        check_int("steps", self.steps, minimum=1)

    def __call__(self, step: int) -> float:
        frac = min(max(step, 0), self.steps) / self.steps  # no float overflow for huge steps
        return float(self.start + frac * (self.end - self.start))


@dataclass(frozen=True)
class Cosine(Schedule):
    """Half-cosine from ``start`` at step 0 to ``end`` at ``steps``, then flat."""

    start: float
    end: float
    steps: int
    kind = "cosine"

    def __post_init__(self) -> None:
        check_real("start", self.start)
        check_real("end", self.end)
        check_int("steps", self.steps, minimum=1)

    def __call__(self, step: int) -> float:
        frac = min(max(step, 0), self.steps) / self.steps  # no float overflow for huge steps
        return float(self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * frac)))


@dataclass(frozen=True)
class Piecewise(Schedule):
    """Linear interpolation through ``(step, value)`` points; flat outside them.

    Args:
        points: ``[(step, value), ...]`` with strictly increasing steps.
    """

    points: tuple[tuple[int, float], ...]
    kind = "piecewise"

    def __init__(self, points: Sequence[Sequence[float]]) -> None:
        pts = tuple(
            (
                check_int("step", int(s) if float(s).is_integer() else s, minimum=0),
                check_real("value", v),
            )
            for s, v in points
        )
        if not pts:
            raise ValueError("`points` must not be empty, got points=[]")
        steps = [s for s, _ in pts]
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(f"`points` steps must be strictly increasing, got steps={steps}")
        object.__setattr__(self, "points", pts)

    def __call__(self, step: int) -> float:
        steps = [s for s, _ in self.points]
        j = bisect.bisect_right(steps, step)
        if j == 0:
            return self.points[0][1]
        if j == len(self.points):
            return self.points[-1][1]
        (s0, v0), (s1, v1) = self.points[j - 1], self.points[j]
        return float(v0 + (step - s0) / (s1 - s0) * (v1 - v0))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "points": [list(p) for p in self.points]}


@dataclass(frozen=True)
class Step(Schedule):
    """Piecewise constant: ``values[j]`` for ``boundaries[j-1] <= step < boundaries[j]``.

    Args:
        boundaries: strictly increasing steps, one fewer than ``values``.
        values: the value on each interval.
    """

    boundaries: tuple[int, ...]
    values: tuple[float, ...]
    kind = "step"

    def __init__(self, boundaries: Sequence[int], values: Sequence[float]) -> None:
        b = tuple(check_int("boundary", x, minimum=0) for x in boundaries)
        v = tuple(check_real("value", x) for x in values)
        if len(v) != len(b) + 1:
            raise ValueError(
                f"`values` must have len(boundaries) + 1 = {len(b) + 1} entries, got {len(v)}"
            )
        if any(y <= x for x, y in zip(b, b[1:], strict=False)):
            raise ValueError(f"`boundaries` must be strictly increasing, got boundaries={list(b)}")
        object.__setattr__(self, "boundaries", b)
        object.__setattr__(self, "values", v)

    def __call__(self, step: int) -> float:
        return self.values[bisect.bisect_right(self.boundaries, step)]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "boundaries": list(self.boundaries), "values": list(self.values)}


def constant(value: float) -> Constant:
    """A constant schedule."""
    return Constant(value)


def linear(start: float, end: float, steps: int) -> Linear:
    """Linear from ``start`` to ``end`` over ``steps`` steps (e.g. beta 0.4 -> 1)."""
    return Linear(start, end, steps)


def cosine(start: float, end: float, steps: int) -> Cosine:
    """Cosine from ``start`` to ``end`` over ``steps`` steps."""
    return Cosine(start, end, steps)


def piecewise(points: Sequence[Sequence[float]]) -> Piecewise:
    """Linear interpolation through ``(step, value)`` points."""
    return Piecewise(points)


def step(boundaries: Sequence[int], values: Sequence[float]) -> Step:
    """Piecewise-constant values changing at ``boundaries``."""
    return Step(boundaries, values)


_KINDS: dict[str, Callable[..., Schedule]] = {
    "constant": lambda d: Constant(d["value"]),
    "linear": lambda d: Linear(d["start"], d["end"], d["steps"]),
    "cosine": lambda d: Cosine(d["start"], d["end"], d["steps"]),
    "piecewise": lambda d: Piecewise(d["points"]),
    "step": lambda d: Step(d["boundaries"], d["values"]),
}


def as_schedule(name: str, value: ScheduleLike) -> Callable[[int], float]:
    """A number becomes :class:`Constant`; a callable is kept as it is."""
    if isinstance(value, Schedule):
        return value
    if callable(value):
        return value
    return Constant(check_real(name, value))


def to_dict(schedule: Callable[[int], float]) -> dict[str, Any]:
    """Description of a schedule for a checkpoint; ``{"kind": "callable"}`` for others."""
    if isinstance(schedule, Schedule):
        return schedule.to_dict()
    return {"kind": "callable", "repr": repr(schedule)[:200]}


def from_dict(d: dict[str, Any]) -> Schedule:
    """Rebuild a schedule described by :func:`to_dict`.

    Raises:
        ValueError: an unknown kind or malformed description.
    """
    kind = d.get("kind")
    if kind not in _KINDS:
        raise ValueError(f"schedule `kind` must be one of {sorted(_KINDS)}, got kind={kind!r}")
    try:
        return _KINDS[kind](d)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed {kind} schedule description {d!r}: {exc}") from None
