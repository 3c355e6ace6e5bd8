"""alpha / beta schedules: values, serialisation, argument checks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fastper import schedules
from fastper.schedules import Constant, Cosine, Linear, Piecewise, Schedule, Step


@pytest.mark.parametrize("value", [0.0, 0.4, 7, -2.5])
def test_constant(value) -> None:
    s = schedules.constant(value)
    assert isinstance(s, Constant) and isinstance(s, Schedule)
    for step in (0, 1, 10, 10**9):
        assert s(step) == float(value)
        assert isinstance(s(step), float)


def test_linear_values() -> None:
    s = schedules.linear(0.4, 1.0, 100)
    assert s(0) == pytest.approx(0.4)
    assert s(25) == pytest.approx(0.55)
    assert s(50) == pytest.approx(0.7)
    assert s(100) == pytest.approx(1.0)
    assert s(1000) == pytest.approx(1.0)
    decreasing = schedules.linear(1.0, 0.0, 4)
    assert [decreasing(i) for i in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def test_cosine_values() -> None:
    s = schedules.cosine(1.0, 0.2, 100)
    assert s(0) == pytest.approx(1.0)
    assert s(50) == pytest.approx(0.6)  # halfway: midpoint
    assert s(25) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert s(100) == pytest.approx(0.2)
    assert s(10**6) == pytest.approx(0.2)
    vals = [s(i) for i in range(101)]
    assert all(b <= a for a, b in zip(vals, vals[1:], strict=False))  # monotone


def test_piecewise_values() -> None:
    s = schedules.piecewise([(10, 0.0), (20, 1.0), (40, 0.5)])
    assert s(0) == 0.0  # flat before the first point
    assert s(10) == 0.0
    assert s(15) == pytest.approx(0.5)
    assert s(20) == pytest.approx(1.0)
    assert s(30) == pytest.approx(0.75)
    assert s(40) == pytest.approx(0.5)
    assert s(10**6) == pytest.approx(0.5)  # flat after the last point
    single = schedules.piecewise([[5, 3.0]])
    assert single(0) == single(5) == single(99) == 3.0


def test_step_values() -> None:
    s = schedules.step([10, 20], [1.0, 0.5, 0.25])
    expected = {0: 1.0, 9: 1.0, 10: 0.5, 19: 0.5, 20: 0.25, 10**6: 0.25}
    for step, value in expected.items():
        assert s(step) == value, step
    assert schedules.step([], [0.3])(123) == 0.3


@pytest.mark.parametrize(
    "schedule",
    [
        schedules.constant(0.6),
        schedules.linear(0.4, 1.0, 1000),
        schedules.cosine(0.7, 0.1, 50),
        schedules.piecewise([(0, 0.1), (10, 0.9), (30.0, 0.4)]),
        schedules.step([5, 9], [0.6, 0.5, 0.4]),
    ],
    ids=lambda s: type(s).__name__,
)
def test_to_dict_from_dict_round_trip(schedule) -> None:
    d = schedule.to_dict()
    assert d["kind"] == schedule.kind
    assert schedules.to_dict(schedule) == d
    # JSON-safe and rebuildable from the JSON text
    rebuilt = schedules.from_dict(json.loads(json.dumps(d)))
    assert type(rebuilt) is type(schedule)
    assert rebuilt == schedule
    assert rebuilt.to_dict() == d
    steps = [0, 1, 3, 5, 9, 10, 17, 30, 49, 50, 999, 1000, 5000]
    np.testing.assert_array_equal([rebuilt(s) for s in steps], [schedule(s) for s in steps])


def test_to_dict_of_plain_callable() -> None:
    d = schedules.to_dict(lambda step: 0.5)
    assert d["kind"] == "callable"
    with pytest.raises(ValueError, match="schedule `kind` must be one of"):
        schedules.from_dict(d)


def test_as_schedule() -> None:
    c = schedules.as_schedule("alpha", 0.6)
    assert isinstance(c, Constant) and c(3) == 0.6
    lin = schedules.linear(0.0, 1.0, 10)
    assert schedules.as_schedule("alpha", lin) is lin

    def fn(step: int) -> float:
        return 0.1 * step

    assert schedules.as_schedule("beta", fn) is fn
    with pytest.raises(TypeError, match="`alpha` must be a real number"):
        schedules.as_schedule("alpha", "0.6")
    with pytest.raises(TypeError, match="`beta` must be a real number"):
        schedules.as_schedule("beta", True)
    with pytest.raises(ValueError, match="`alpha` must be finite"):
        schedules.as_schedule("alpha", math.inf)


def test_schedules_are_frozen() -> None:
    s = schedules.linear(0.0, 1.0, 10)
    with pytest.raises(AttributeError):
        s.start = 0.5  # type: ignore[misc]
    assert s(5) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("make", "exc", "match"),
    [
        (lambda: Constant(math.nan), ValueError, "`value` must be finite"),
        (lambda: Constant("x"), TypeError, "`value` must be a real number"),
        (lambda: Linear(0.0, 1.0, 0), ValueError, "`steps` must be >= 1"),
        (lambda: Linear(0.0, 1.0, -5), ValueError, "`steps` must be >= 1"),
        (lambda: Linear(0.0, 1.0, 2.5), TypeError, "`steps` must be an integer"),
        (lambda: Linear(math.inf, 1.0, 10), ValueError, "`start` must be finite"),
        (lambda: Linear(0.0, None, 10), TypeError, "`end` must be a real number"),
        (lambda: Cosine(0.0, 1.0, 0), ValueError, "`steps` must be >= 1"),
        (lambda: Cosine("a", 1.0, 10), TypeError, "`start` must be a real number"),
        (lambda: Piecewise([]), ValueError, "must not be empty"),
        (lambda: Piecewise([(0, 1.0), (0, 2.0)]), ValueError, "strictly increasing"),
        (lambda: Piecewise([(5, 1.0), (2, 2.0)]), ValueError, "strictly increasing"),
        (lambda: Piecewise([(-1, 1.0)]), ValueError, "`step` must be >= 0"),
        (lambda: Piecewise([(1.5, 1.0)]), TypeError, "`step` must be an integer"),
        (lambda: Piecewise([(1, math.nan)]), ValueError, "`value` must be finite"),
        (lambda: Step([10], [1.0]), ValueError, "len\\(boundaries\\) \\+ 1 = 2"),
        (lambda: Step([10, 10], [1.0, 2.0, 3.0]), ValueError, "strictly increasing"),
        (lambda: Step([-1], [1.0, 2.0]), ValueError, "`boundary` must be >= 0"),
        (lambda: Step([1.5], [1.0, 2.0]), TypeError, "`boundary` must be an integer"),
        (lambda: Step([1], [1.0, "b"]), TypeError, "`value` must be a real number"),
    ],
)
def test_bad_arguments(make, exc, match) -> None:
    with pytest.raises(exc, match=match):
        make()


@pytest.mark.parametrize(
    "d",
    [
        {"kind": "exponential", "rate": 0.1},
        {"value": 1.0},
        {"kind": "linear", "start": 0.0, "end": 1.0},
        {"kind": "step", "boundaries": [1]},
        {"kind": "constant", "value": "x"},
    ],
)
def test_from_dict_rejects_malformed(d) -> None:
    with pytest.raises(ValueError, match="schedule"):
        schedules.from_dict(d)


def test_from_dict_rejects_invalid_values() -> None:
    with pytest.raises(ValueError, match="`steps` must be >= 1"):
        schedules.from_dict({"kind": "linear", "start": 0.0, "end": 1.0, "steps": 0})
