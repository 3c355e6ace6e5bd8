"""Dopamine's ``ReplayElement`` and the checks of a buffer's element specs.

:class:`ReplayElement` names one stored or returned element of
:class:`~fastper.compat.dopamine_replay.OutOfGraphPrioritizedReplayBuffer`
(name, shape per transition, dtype), as Dopamine's namedtuple does;
:func:`element_shape` and :func:`extra_elements` check the shapes and the
``extra_storage_types`` a buffer is built with. Users import
:class:`ReplayElement` from :mod:`fastper.compat.dopamine`.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from .._validation import show

__all__ = ["ReplayElement", "element_shape", "extra_elements"]


class ReplayElement(NamedTuple):
    """Name, shape (per transition) and dtype of one stored or returned element."""

    name: str
    shape: Sequence[int]
    type: Any


_STORED = ("observation", "action", "reward", "terminal")
_RESERVED = frozenset(
    {
        *_STORED,
        "priority",
        "state",
        "next_state",
        "next_action",
        "next_reward",
        "indices",
        "sampling_probabilities",
    }
)


def element_shape(name: str, value: Any) -> tuple[int, ...]:
    """``value`` as a tuple of ints >= 0 (a tuple or list of them), named ``name`` in errors.

    Raises:
        TypeError: anything else.
    """
    if not isinstance(value, tuple | list) or not all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) and int(s) >= 0 for s in value
    ):
        raise TypeError(f"`{name}` must be a tuple of non-negative ints, got {name}={show(value)}")
    return tuple(int(s) for s in value)


def extra_elements(extra_storage_types: Iterable[Any] | None) -> list[ReplayElement]:
    """The checked ``extra_storage_types``: :class:`ReplayElement` or ``(name, shape, dtype)``.

    Raises:
        TypeError: an entry of another form, a name that is not a non-empty
            string, or a bad shape.
        ValueError: a name reserved for the stored or returned elements, or repeated.
    """
    if extra_storage_types is None:
        return []
    out: list[ReplayElement] = []
    for element in extra_storage_types:
        try:
            name, shape, dtype = element.name, element.shape, element.type
        except AttributeError:
            try:
                name, shape, dtype = element
            except (TypeError, ValueError):
                raise TypeError(
                    "`extra_storage_types` must hold ReplayElement(name, shape, type) entries, "
                    f"got {show(element)}"
                ) from None
        if not isinstance(name, str) or not name:
            raise TypeError(f"extra storage element names must be non-empty strings, got {name!r}")
        if name in _RESERVED or any(e.name == name for e in out):
            raise ValueError(
                f"extra storage element name {name!r} is reserved or repeated; "
                f"reserved names are {sorted(_RESERVED)}"
            )
        out.append(
            ReplayElement(name, element_shape(f"shape of extra element {name!r}", shape), dtype)
        )
    return out
