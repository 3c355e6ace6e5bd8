"""Field specs from Gymnasium spaces.

``fields_from_spaces(env.observation_space, env.action_space)`` gives the
usual transition layout (``obs``, ``action``, ``reward``, ``next_obs``,
``terminated``, ``truncated``) with each space's shape and dtype. Spaces are
read by duck typing (their class name, ``shape``, ``dtype``, ``spaces``), so
this module imports neither gymnasium nor gym.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .storage import Field, make_fields

__all__ = ["fields_from_space", "fields_from_spaces"]


def _space_fields(prefix: str, space: Any) -> dict[str, Field]:
    kind = type(space).__name__
    if kind == "Dict":
        out: dict[str, Field] = {}
        for key, sub in space.spaces.items():
            out.update(_space_fields(f"{prefix}.{key}", sub))
        return out
    if kind == "Tuple":
        out = {}
        for i, sub in enumerate(space.spaces):
            out.update(_space_fields(f"{prefix}.{i}", sub))
        return out
    if kind == "Discrete":
        # gymnasium uses int64 for Discrete samples; keep indices that wide
        return {prefix: Field((), np.dtype(np.int64))}
    if kind in ("Box", "MultiDiscrete", "MultiBinary"):
        shape = tuple(int(d) for d in space.shape)
        dtype = np.dtype(space.dtype)
        return {prefix: Field(shape, dtype)}
    raise TypeError(
        f"`space` must be a Box, Discrete, MultiDiscrete, MultiBinary, Dict or Tuple space, "
        f"got space={space!r} ({kind}); give its field spec by hand"
    )


def fields_from_space(name: str, space: Any) -> dict[str, Field]:
    """Fields holding one sample of ``space`` under ``name``. O(size of the spec).

    Box / MultiDiscrete / MultiBinary keep their shape and dtype; Discrete is
    a scalar int64; a Dict or Tuple space becomes one field per leaf, named
    ``name.key`` (nested: ``name.key.sub``) or ``name.0``, ``name.1``...

    Raises:
        TypeError: a space kind without a fixed-size array layout
            (e.g. Text, Graph, Sequence).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty str, got name={name!r}")
    return _space_fields(name, space)


def fields_from_spaces(
    observation_space: Any,
    action_space: Any,
    *,
    reward_dtype: Any = np.float32,
    next_obs: bool = True,
    truncated: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Field]:
    """The field spec of a transition for an environment's spaces.

    Args:
        observation_space: e.g. ``env.observation_space``.
        action_space: e.g. ``env.action_space``.
        reward_dtype: dtype of the ``reward`` field (float32 by default).
        next_obs: include ``next_obs`` (leave it out to rebuild it from the
            next slot yourself).
        truncated: include a ``truncated`` flag next to ``terminated`` (n-step
            returns use it to end a window without cutting the bootstrap).
        extra: more fields, ``{name: (shape, dtype)}``, e.g. log-probabilities.

    Returns:
        ``{name: Field}``, usable as the ``fields`` of any buffer. For a Dict
        observation space the observation fields are ``obs.<key>`` and
        ``next_obs.<key>``.

    Raises:
        TypeError: a space kind without a fixed-size array layout.
        ValueError: ``extra`` names a field that already exists.
    """
    fields = fields_from_space("obs", observation_space)
    fields.update(fields_from_space("action", action_space))
    fields["reward"] = Field((), np.dtype(reward_dtype))
    if next_obs:
        fields.update(fields_from_space("next_obs", observation_space))
    fields["terminated"] = Field((), np.dtype(np.bool_))
    if truncated:
        fields["truncated"] = Field((), np.dtype(np.bool_))
    for name, field in (make_fields(extra) if extra else {}).items():
        if name in fields:
            raise ValueError(
                f"`extra` must not repeat a transition field, got extra field {name!r}"
            )
        fields[name] = field
    return fields
