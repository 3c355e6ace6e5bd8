"""n-step returns, computed as transitions arrive.

Transitions are one chronological stream (one environment). Transition ``t``
is written once the ``n`` transitions ``t .. t+n-1`` are known, or earlier if
its episode ends inside that window. The written transition holds:

* ``reward``: ``sum_{j<m} gamma^j r_{t+j}``, the discounted ``m``-step return,
  ``m = n`` or fewer at the end of an episode;
* ``next_obs``: the observation after the window's last step (the bootstrap
  observation);
* ``discount``: ``gamma^m`` to bootstrap with, or ``0`` if the window ends
  with a termination. A truncated episode still bootstraps;
* the termination / truncation flags of the window's last step, and every
  other field of step ``t`` unchanged.

The target is then ``reward + discount * max_a Q(next_obs, a)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._validation import check_int, check_real
from .storage import Field

REWARD_KEYS = ("reward", "rewards", "rew")
NEXT_OBS_KEYS = ("next_obs", "next_observation", "next_observations", "next_state")
TERMINATED_KEYS = ("terminated", "terminal", "done", "dones")
TRUNCATED_KEYS = ("truncated", "timeout", "timeouts")
DISCOUNT = "discount"


def _find(fields: Mapping[str, Field], names: tuple[str, ...]) -> str | None:
    for name in names:
        if name in fields:
            return name
    return None


class NStepWriter:
    """Turns 1-step transitions into n-step ones (see the module docstring).

    Args:
        fields: the input field spec (the stored spec adds ``discount``).
        n: window length, >= 1.
        gamma: discount factor in [0, 1].
        reward_key, next_obs_key, terminated_key, truncated_key: field names;
            by default found among common names (``reward``, ``next_obs``,
            ``terminated`` or ``done``, ``truncated``). Without a termination
            field episodes never end; ``done`` counts as termination.

    Raises:
        ValueError: a needed field is missing, or ``discount`` is taken.
    """

    def __init__(
        self,
        fields: Mapping[str, Field],
        n: int,
        gamma: float,
        *,
        reward_key: str | None = None,
        next_obs_key: str | None = None,
        terminated_key: str | None = None,
        truncated_key: str | None = None,
    ) -> None:
        self.n = check_int("n_step", n, minimum=1)
        self.gamma = check_real("gamma", gamma, minimum=0.0, maximum=1.0)
        self.fields = dict(fields)
        self.reward_key = reward_key or _find(fields, REWARD_KEYS)
        self.next_obs_key = next_obs_key or _find(fields, NEXT_OBS_KEYS)
        self.terminated_key = terminated_key or _find(fields, TERMINATED_KEYS)
        self.truncated_key = truncated_key or _find(fields, TRUNCATED_KEYS)
        for role, key, names in (
            ("reward", self.reward_key, REWARD_KEYS),
            ("next observation", self.next_obs_key, NEXT_OBS_KEYS),
        ):
            if key is None or key not in fields:
                raise ValueError(
                    f"n-step returns need a {role} field (one of {list(names)} or named "
                    f"explicitly), got fields {list(fields)}"
                )
        for key in (self.terminated_key, self.truncated_key):
            if key is not None and key not in fields:
                raise ValueError(f"n-step field `{key}` is not among the fields {list(fields)}")
        assert self.reward_key is not None
        if fields[self.reward_key].dtype.kind != "f":
            raise ValueError(
                f"n-step returns need a floating reward field, got `{self.reward_key}` "
                f"of dtype {fields[self.reward_key].dtype}"
            )
        if DISCOUNT in fields:
            raise ValueError(f"field name `{DISCOUNT}` is reserved for n-step buffers")
        self.pending: dict[str, np.ndarray] = self._empty()

    def _empty(self) -> dict[str, np.ndarray]:
        return {k: np.zeros((0, *f.shape), dtype=f.dtype) for k, f in self.fields.items()}

    @property
    def output_fields(self) -> dict[str, Field]:
        return {**self.fields, DISCOUNT: Field((), np.dtype(np.float32))}

    @property
    def n_pending(self) -> int:
        return int(next(iter(self.pending.values())).shape[0])

    def process(
        self, batch: Mapping[str, np.ndarray], k: int
    ) -> tuple[dict[str, np.ndarray], int, dict[str, np.ndarray]]:
        """Pure: (transitions to write, their count, the new pending window)."""
        seq = {name: np.concatenate([self.pending[name], batch[name]]) for name in self.fields}
        length = self.n_pending + k
        terminated = self._flag(seq, self.terminated_key, length)
        truncated = self._flag(seq, self.truncated_key, length)
        ended = terminated | truncated
        pos = np.arange(length)
        end_at = np.where(ended, pos, length)
        next_end = np.minimum.accumulate(end_at[::-1])[::-1]
        # an n past the sequence's end changes nothing (the window is cut there or
        # not yet complete): the cap keeps a huge n (a forged checkpoint) from
        # overflowing int64 or looping for ever
        reach = min(self.n, length + 1)
        last = np.minimum(pos + (reach - 1), next_end)
        emit = int(np.count_nonzero(last < length))  # the emitted ones form a prefix
        last = last[:emit]
        m = last - pos[:emit] + 1
        assert self.reward_key is not None and self.next_obs_key is not None
        rewards = seq[self.reward_key].astype(np.float64)
        ret = np.zeros(emit, dtype=np.float64)
        for j in range(reach):  # loop over the window, vectorised over transitions
            take = j < m
            ret += np.where(
                take, self.gamma**j * rewards[np.minimum(pos[:emit] + j, length - 1)], 0.0
            )
        out = {name: arr[:emit].copy() for name, arr in seq.items()}
        out[self.reward_key] = ret.astype(self.fields[self.reward_key].dtype)
        out[self.next_obs_key] = seq[self.next_obs_key][last]
        for key in (self.terminated_key, self.truncated_key):
            if key is not None:
                out[key] = seq[key][last]
        discount = np.where(terminated[last], 0.0, np.power(self.gamma, m.astype(np.float64)))
        out[DISCOUNT] = discount.astype(np.float32)
        pending = {name: arr[emit:].copy() for name, arr in seq.items()}
        return out, emit, pending

    @staticmethod
    def _flag(seq: Mapping[str, np.ndarray], key: str | None, length: int) -> np.ndarray:
        if key is None:
            return np.zeros(length, dtype=bool)
        flag = np.asarray(seq[key]).reshape(length, -1) != 0
        return np.asarray(flag.any(axis=1))

    def clear(self) -> None:
        self.pending = self._empty()

    def settings(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "gamma": self.gamma,
            "reward_key": self.reward_key,
            "next_obs_key": self.next_obs_key,
            "terminated_key": self.terminated_key,
            "truncated_key": self.truncated_key,
        }
