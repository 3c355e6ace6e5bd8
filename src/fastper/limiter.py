"""Rate limiting: keep the learner's samples and the actors' inserts at a ratio.

With actors and a learner running side by side (threads here; processes or
machines with ``fastper.distributed``), nothing ties how often a transition is
replayed to how fast new ones arrive: a fast learner overfits a small memory,
a slow one lets most transitions pass unseen. :class:`RateLimiter` holds the
ratio as Reverb defines it (DeepMind's replay server), counting every sampled
transition as one sample:

* **stage 1**, while the buffer holds fewer than ``min_size_to_sample``
  transitions: inserts always go ahead, samples wait;
* **stage 2**: the quantity ``diff = inserts * samples_per_insert - samples``
  is kept within ``[min_diff, max_diff]``; an insert that would push it above
  ``max_diff`` waits (the actors are ahead), a sample that would push it below
  ``min_diff`` waits (the learner is ahead). With ``error_buffer=e`` the range
  is ``min_size_to_sample * samples_per_insert +/- e``, so the error counts
  only what happened after stage 1.

The limiter itself is pure arithmetic over two counters (deterministic, O(1)
per call, testable without threads). :class:`RateLimitedBuffer` wraps a
buffer with one: ``add`` and ``sample`` block while their side is ahead (with
a timeout), check and act atomically, and a call that raises changes nothing.
In a single-threaded loop nothing can unblock a waiting call, so ask first::

    rb = RateLimitedBuffer(buffer, RateLimiter(samples_per_insert=8.0,
                                               min_size_to_sample=1000,
                                               error_buffer=512))
    rb.add(transition)                      # one env step
    while rb.can_sample(64):                # replay ratio held at 8 per transition
        batch = rb.sample(64)
        ...
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ._validation import check_int, check_real, show
from .errors import FastPERError

__all__ = ["RateLimitTimeout", "RateLimitedBuffer", "RateLimiter", "RateLimiterCancelled"]


class RateLimitTimeout(FastPERError, TimeoutError):
    """A rate-limited call waited past its timeout; nothing was inserted or sampled."""


class RateLimiterCancelled(FastPERError, RuntimeError):
    """The rate limiter was cancelled (shutting down) while or before a call waited."""


class RateLimiter:
    """Samples-per-insert ratio with a minimum size, as Reverb's rate limiters define it.

    Args:
        samples_per_insert: how many times, on average, each inserted
            transition should be sampled (> 0). A batch of B counts B samples.
        min_size_to_sample: samples wait until the buffer holds this many
            transitions (>= 1).
        error_buffer: how far the ratio may drift before a side waits: a
            number ``e`` (range ``min_size_to_sample * samples_per_insert +/- e``),
            a pair ``(min_diff, max_diff)`` used as given, or ``None`` (no ratio:
            only the minimum size is enforced, Reverb's ``MinSize``). The range
            must be at least ``2 * max(1, samples_per_insert)`` wide, else a
            side could be blocked for good.

    Raises:
        ValueError: bad numbers, or a range that would deadlock as soon as
            ``min_size_to_sample`` transitions are in.

    Every method is O(1); the limiter holds no lock (the wrapper does).
    """

    def __init__(
        self,
        samples_per_insert: float = 1.0,
        min_size_to_sample: int = 1,
        error_buffer: float | tuple[float, float] | None = None,
    ) -> None:
        spi = check_real("samples_per_insert", samples_per_insert, minimum=0.0)
        if not 0.0 < spi < math.inf:
            raise ValueError(
                f"`samples_per_insert` must be > 0 and finite, got samples_per_insert={spi}"
            )
        min_size = check_int("min_size_to_sample", min_size_to_sample, minimum=1)
        offset = spi * min_size
        if error_buffer is None:
            lo, hi = -math.inf, math.inf
        elif isinstance(error_buffer, tuple | list):
            if len(error_buffer) != 2:
                raise ValueError(
                    "`error_buffer` must be a number or a pair (min_diff, max_diff), got "
                    f"error_buffer={show(error_buffer)}"
                )
            lo = check_real("error_buffer[0]", error_buffer[0])
            hi = check_real("error_buffer[1]", error_buffer[1])
        else:
            e = check_real("error_buffer", error_buffer, minimum=0.0)
            lo, hi = offset - e, offset + e
        if not hi - lo >= 2.0 * max(1.0, spi):
            raise ValueError(
                f"`error_buffer` must span at least 2 * max(1, samples_per_insert) = "
                f"{2.0 * max(1.0, spi):g}, got the range [{lo:g}, {hi:g}]: a narrower one "
                "can block inserts or samples for good"
            )
        if lo > offset:
            raise ValueError(
                f"`error_buffer`'s range [{lo:g}, {hi:g}] lies above min_size_to_sample * "
                f"samples_per_insert = {offset:g}: sampling would wait for good once "
                f"{min_size} transitions are in"
            )
        if hi < offset:
            warnings.warn(
                f"error_buffer's range [{lo:g}, {hi:g}] lies below min_size_to_sample * "
                f"samples_per_insert = {offset:g}: inserts will wait once {min_size} "
                "transitions are in, until a learner running alongside samples",
                stacklevel=2,
            )
        self.samples_per_insert = spi
        self.min_size_to_sample = min_size
        self.min_diff = lo
        self.max_diff = hi
        self.inserts = 0
        self.samples = 0

    @classmethod
    def min_size(cls, min_size_to_sample: int) -> RateLimiter:
        """Only a minimum size: samples wait for ``min_size_to_sample`` transitions."""
        return cls(1.0, min_size_to_sample, None)

    @property
    def diff(self) -> float:
        """``inserts * samples_per_insert - samples``: above the range, actors are ahead."""
        return self.inserts * self.samples_per_insert - self.samples

    def can_insert(self, count: int, size: int) -> bool:
        """Whether ``count`` inserts may go ahead now, the buffer holding ``size``."""
        if size + count <= self.min_size_to_sample:
            return True  # stage 1: fill up freely
        return (self.inserts + count) * self.samples_per_insert - self.samples <= self.max_diff

    def can_sample(self, count: int, size: int) -> bool:
        """Whether ``count`` samples (a batch of that size) may go ahead now."""
        if size < self.min_size_to_sample:
            return False
        return self.diff - count >= self.min_diff

    def admits_batch(self, count: int) -> bool:
        """Whether a batch of ``count`` can ever pass (the range is wide enough for it)."""
        return count <= self.max_diff - self.min_diff - self.samples_per_insert + 1e-9 or (
            math.isinf(self.min_diff) or math.isinf(self.max_diff)
        )

    def record_insert(self, count: int) -> None:
        """Count ``count`` transitions inserted."""
        self.inserts += int(count)

    def record_sample(self, count: int) -> None:
        """Count ``count`` transitions sampled."""
        self.samples += int(count)

    def blocked_side(self, size: int) -> str:
        """Which side would wait for one more call now: "insert", "sample", "both" or "none"."""
        ins, smp = not self.can_insert(1, size), not self.can_sample(1, size)
        return "both" if ins and smp else "insert" if ins else "sample" if smp else "none"

    def state_dict(self) -> dict[str, Any]:
        """Settings and counters, JSON-able."""
        return {
            "samples_per_insert": self.samples_per_insert,
            "min_size_to_sample": self.min_size_to_sample,
            "min_diff": self.min_diff,
            "max_diff": self.max_diff,
            "inserts": self.inserts,
            "samples": self.samples,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> RateLimiter:
        """The limiter a :meth:`state_dict` describes, counters included."""
        keys = ("samples_per_insert", "min_size_to_sample", "min_diff", "max_diff")
        missing = [k for k in (*keys, "inserts", "samples") if k not in state]
        if missing:
            raise ValueError(f"a rate limiter state must have {missing}, got keys {sorted(state)}")
        lo, hi = float(state["min_diff"]), float(state["max_diff"])
        bounds = None if math.isinf(lo) and math.isinf(hi) else (lo, hi)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # warned when it was made
            out = cls(state["samples_per_insert"], state["min_size_to_sample"], bounds)
        out.inserts = check_int("inserts", state["inserts"], minimum=0)
        out.samples = check_int("samples", state["samples"], minimum=0)
        return out

    def __repr__(self) -> str:
        return (
            f"RateLimiter(samples_per_insert={self.samples_per_insert:g}, "
            f"min_size_to_sample={self.min_size_to_sample}, range=[{self.min_diff:g}, "
            f"{self.max_diff:g}], inserts={self.inserts}, samples={self.samples})"
        )


class _Default:
    """The wrapper's own timeout (``RateLimitedBuffer(timeout=...)``)."""

    def __repr__(self) -> str:
        return "DEFAULT"


_DEFAULT: Any = _Default()


class RateLimitedBuffer:
    """A buffer whose ``add`` and ``sample`` wait for a :class:`RateLimiter`.

    Args:
        buffer: any fastper buffer (``add``, ``sample``, ``len``).
        limiter: the ratio to hold.
        timeout: default seconds a call waits before it raises
            :class:`RateLimitTimeout` (``None``: wait for ever; ``0``: never wait).

    ``add`` counts the transitions it stored (with n-step, the windows it
    completed) and waits on the rows it was given; ``sample(B)`` counts B.
    Check, call and count happen under one lock, so concurrent actors and
    learners cannot overshoot the range together. ``update_priorities`` and
    everything else pass through unlimited (``rb.buffer`` is the buffer).
    A call that waits past its timeout or is cancelled leaves the buffer,
    its generator and the counters untouched.
    """

    def __init__(self, buffer: Any, limiter: RateLimiter, *, timeout: float | None = None) -> None:
        if not isinstance(limiter, RateLimiter):
            raise TypeError(f"`limiter` must be a RateLimiter, got limiter={show(limiter)}")
        for name in ("add", "sample", "__len__"):
            if not callable(getattr(buffer, name, None)):
                raise TypeError(f"`buffer` must be a fastper buffer, got buffer={show(buffer)}")
        self.buffer = buffer
        self.limiter = limiter
        self.timeout = self._check_timeout(timeout)
        self._cond = threading.Condition(threading.Lock())
        self._cancelled = False
        self._stats = {"insert_waits": 0, "insert_wait_s": 0.0, "sample_waits": 0,
                       "sample_wait_s": 0.0}  # fmt: skip

    @staticmethod
    def _check_timeout(timeout: Any) -> float | None:
        if timeout is None:
            return None
        return check_real("timeout", timeout, minimum=0.0)

    # -- the two limited calls ---------------------------------------------------
    def add(
        self,
        transition: Mapping[str, Any],
        priorities: Any = None,
        *,
        env_ids: Any = None,
        timeout: float | None = _DEFAULT,
    ) -> Any:
        """``buffer.add`` once the limiter lets ``k`` inserts through (k = rows given).

        Raises:
            RateLimitTimeout: still blocked after ``timeout`` seconds.
            RateLimiterCancelled: :meth:`cancel` was called.
            Whatever ``buffer.add`` raises (then nothing is counted).
        """
        rows = _row_count(self.buffer, transition)
        with self._cond:
            self._wait("insert", lambda: self.limiter.can_insert(rows, len(self.buffer)), timeout)
            slots = self.buffer.add(transition, priorities, env_ids=env_ids)
            self.limiter.record_insert(len(slots))
            self._cond.notify_all()
        return slots

    def sample(
        self, batch_size: int, beta: float | None = None, *, timeout: float | None = _DEFAULT
    ) -> Any:
        """``buffer.sample`` once the limiter lets ``batch_size`` samples through.

        Raises:
            ValueError: the limiter's range is too narrow to ever admit a batch
                of ``batch_size`` (widen ``error_buffer``).
            RateLimitTimeout, RateLimiterCancelled: as for :meth:`add`.
        """
        b = check_int("batch_size", batch_size, minimum=1)
        if not self.limiter.admits_batch(b):
            lim = self.limiter
            raise ValueError(
                f"a batch of {b} can never pass this rate limiter: its range [{lim.min_diff:g}, "
                f"{lim.max_diff:g}] must be at least batch_size + samples_per_insert = "
                f"{b + lim.samples_per_insert:g} wide; widen error_buffer"
            )
        with self._cond:
            self._wait("sample", lambda: self.limiter.can_sample(b, len(self.buffer)), timeout)
            batch = self.buffer.sample(b, beta)
            self.limiter.record_sample(b)
            self._cond.notify_all()
        return batch

    def can_insert(self, count: int = 1) -> bool:
        """Whether ``count`` inserts would go ahead without waiting now."""
        with self._cond:
            return self.limiter.can_insert(count, len(self.buffer))

    def can_sample(self, batch_size: int = 1) -> bool:
        """Whether a batch of ``batch_size`` would be sampled without waiting now."""
        with self._cond:
            return self.limiter.can_sample(batch_size, len(self.buffer))

    def _wait(self, side: str, ready: Callable[[], bool], timeout: float | None) -> None:
        """Wait (holding the condition) until ``ready()``; raise on timeout or cancel."""
        limit = self.timeout if timeout is _DEFAULT else self._check_timeout(timeout)
        if self._cancelled:
            raise RateLimiterCancelled(f"the rate limiter was cancelled; no {side} was done")
        if ready():
            return
        t0 = time.monotonic()
        deadline = None if limit is None else t0 + limit
        self._stats[f"{side}_waits"] += 1
        try:
            while not ready():
                if self._cancelled:
                    raise RateLimiterCancelled(
                        f"the rate limiter was cancelled while a {side} waited; nothing was done"
                    )
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    lim = self.limiter
                    raise RateLimitTimeout(
                        f"{side} waited {limit:g} s for the rate limiter and gave up, nothing "
                        f"done: size {len(self.buffer)} (min_size_to_sample "
                        f"{lim.min_size_to_sample}), inserts {lim.inserts}, samples "
                        f"{lim.samples}, inserts*samples_per_insert - samples = {lim.diff:g} "
                        f"(allowed [{lim.min_diff:g}, {lim.max_diff:g}]); the "
                        f"{'learner' if side == 'insert' else 'actors'} must "
                        f"{'sample' if side == 'insert' else 'insert'} first"
                    )
                self._cond.wait(left)
        finally:
            self._stats[f"{side}_wait_s"] += time.monotonic() - t0

    # -- control -----------------------------------------------------------------
    def cancel(self) -> None:
        """Wake every waiting call with :class:`RateLimiterCancelled`; later calls raise too."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    @property
    def stats(self) -> dict[str, Any]:
        """Counters and waits: inserts, samples, diff, and per side how often / how long calls waited."""
        with self._cond:
            lim = self.limiter
            return {"inserts": lim.inserts, "samples": lim.samples, "diff": lim.diff,
                    "blocked": lim.blocked_side(len(self.buffer)), **self._stats}  # fmt: skip

    def update_priorities(self, indices: Any, td_errors: Any, keys: Any = None) -> Any:
        """``buffer.update_priorities``, never limited."""
        return self.buffer.update_priorities(indices, td_errors, keys=keys)

    def __len__(self) -> int:
        return len(self.buffer)

    def __getattr__(self, name: str) -> Any:
        # everything else (save, beta, priorities, ...) is the buffer's own
        if name in ("buffer", "limiter"):
            raise AttributeError(name)
        return getattr(self.buffer, name)

    def __repr__(self) -> str:
        return f"RateLimitedBuffer({self.buffer!r}, {self.limiter!r})"


def _row_count(buffer: Any, transition: Mapping[str, Any]) -> int:
    """Rows in ``transition`` for ``buffer``'s fields (1 for a single transition). O(fields)."""
    import numpy as np

    from .storage import row_count

    fields = getattr(buffer, "fields", None)
    if not isinstance(transition, Mapping) or not isinstance(fields, Mapping):
        return 1
    for name, value in transition.items():
        if name in fields:
            try:
                rows = row_count(name, fields[name], tuple(np.shape(value)))
            except (TypeError, ValueError):
                return 1  # the buffer's own add says what is wrong
            return 1 if rows is None else max(1, rows)
    return 1
