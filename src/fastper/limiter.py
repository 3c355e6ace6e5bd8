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
As in Reverb's tables, the limiter decides inside the lock and the draw is
made there too (indices, keys, weights: one atomic step with the decision);
the rows are read after the lock is released, so a sample reading from disk
or a slower tier never holds up the actors' ``add``. Settings that could
never let a call through (``min_size_to_sample`` above the buffer's
capacity, a batch wider than the limiter's range) are refused at once
rather than waited on.
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

import inspect
import math
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import policy as _policy
from ._validation import check_int, check_real, show, to_numpy
from .batch import SampleBatch, check_batch_size
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

    def check_batch(self, count: int) -> int:
        """``count`` if a batch that large can ever pass (:meth:`admits_batch`), else ValueError."""
        if not self.admits_batch(count):
            raise ValueError(
                f"a batch of {count} can never pass this rate limiter: its range "
                f"[{self.min_diff:g}, {self.max_diff:g}] must be at least batch_size + "
                f"samples_per_insert = {count + self.samples_per_insert:g} wide; widen "
                "error_buffer"
            )
        return count

    def admits_insert(self, count: int) -> bool:
        """Whether an insert of ``count`` can ever pass once stage 1 is over.

        Samples never take ``diff`` below ``min_diff``, so an insert that
        adds more than the range's width, ``count * samples_per_insert >
        max_diff - min_diff``, would wait for ever (split such a batch).
        """
        width = self.max_diff - self.min_diff
        return math.isinf(width) or count * self.samples_per_insert <= width + 1e-9

    def check_capacity(self, capacity: int) -> None:
        """Refuse a buffer of ``capacity`` slots that could never hold ``min_size_to_sample``.

        Raises:
            ValueError: ``min_size_to_sample > capacity``: every sample would
                wait for ever.
        """
        cap = check_int("capacity", capacity, minimum=1)
        if self.min_size_to_sample > cap:
            raise ValueError(
                f"`min_size_to_sample` must be <= the buffer's capacity {cap}, got "
                f"min_size_to_sample={self.min_size_to_sample}: the buffer never holds more "
                f"than {cap} transitions, so every sample would wait for ever"
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
    The limiter's decision and the buffer's change (the rows written, or
    the draw: indices, keys, weights) happen under one lock, so concurrent
    actors and learners cannot overshoot the range together. A buffer with
    ``draw`` and ``gather`` (fastper's CPU buffers) has its rows read after
    that lock is released: a slow read (disk, a compressed tier) holds up
    no ``add``. A row whose slot was overwritten between the draw and the
    read is drawn again, so every row returned is the transition its key
    names; rows drawn again carry the weights of their own draw. A buffer
    without them is sampled whole under the lock.

    ``update_priorities`` and everything else pass through unlimited
    (``rb.buffer`` is the buffer; ``rb.buffer`` and ``rb.limiter`` may be
    replaced, and are checked against each other as at construction).
    A call that waits past its timeout or is cancelled leaves the buffer,
    its generator and the counters untouched.

    Raises:
        TypeError: ``limiter`` is not a :class:`RateLimiter`, or ``buffer``
            not a buffer.
        ValueError: ``min_size_to_sample`` above the buffer's capacity (every
            sample would wait for ever), or a bad ``timeout``.
    """

    def __init__(self, buffer: Any, limiter: RateLimiter, *, timeout: float | None = None) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._attach(buffer, limiter)
        self.timeout = self._check_timeout(timeout)
        self._cancelled = False
        self._stats = {"insert_waits": 0, "insert_wait_s": 0.0, "sample_waits": 0,
                       "sample_wait_s": 0.0, "redrawn_rows": 0}  # fmt: skip

    @staticmethod
    def _check_timeout(timeout: Any) -> float | None:
        if timeout is None:
            return None
        return check_real("timeout", timeout, minimum=0.0)

    # -- the buffer and the limiter, checked against each other ------------------
    def _attach(self, buffer: Any, limiter: Any) -> None:
        """Check ``buffer`` and ``limiter`` together, then use them. O(fields)."""
        if not isinstance(limiter, RateLimiter):
            raise TypeError(f"`limiter` must be a RateLimiter, got limiter={show(limiter)}")
        for name in ("add", "sample", "__len__"):
            if not callable(getattr(buffer, name, None)):
                raise TypeError(f"`buffer` must be a fastper buffer, got buffer={show(buffer)}")
        capacity = getattr(buffer, "capacity", None)
        if isinstance(capacity, int | np.integer) and not isinstance(capacity, bool):
            limiter.check_capacity(int(capacity))
        self._buffer = buffer
        self._limiter = limiter
        # draw under the lock, read the rows after it (buffers that can)
        self._split = callable(getattr(buffer, "draw", None)) and callable(
            getattr(buffer, "gather", None)
        )
        self._row_nbytes = _row_nbytes(buffer)
        # rows drawn again belong to a sample already counted: the buffer's step stays
        draw = getattr(buffer, "draw", None)
        takes = callable(draw) and self._split and "advance" in inspect.signature(draw).parameters
        self._redraw_args: dict[str, Any] = {"advance": False} if takes else {}

    @property
    def buffer(self) -> Any:
        """The buffer wrapped; settable (checked against :attr:`limiter`)."""
        return self._buffer

    @buffer.setter
    def buffer(self, buffer: Any) -> None:
        with self._cond:
            self._attach(buffer, self._limiter)
            self._cond.notify_all()

    @property
    def limiter(self) -> RateLimiter:
        """The rate limiter; settable (checked against :attr:`buffer`)."""
        return self._limiter

    @limiter.setter
    def limiter(self, limiter: RateLimiter) -> None:
        with self._cond:
            self._attach(self._buffer, limiter)
            self._cond.notify_all()

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
            ValueError: ``k`` rows can never pass this limiter (``k *
                samples_per_insert`` exceeds its range; split the batch).
            RateLimitTimeout: still blocked after ``timeout`` seconds.
            RateLimiterCancelled: :meth:`cancel` was called.
            Exception: whatever ``buffer.add`` raises (then nothing is counted).
        """
        with self._cond:
            buffer, lim = self._buffer, self._limiter
            rows = _row_count(buffer, transition)
            if not lim.can_insert(rows, len(buffer)) and not lim.admits_insert(rows):
                raise ValueError(
                    f"a batch of {rows} inserts can never pass this rate limiter: rows * "
                    f"samples_per_insert = {rows * lim.samples_per_insert:g} exceeds the width "
                    f"{lim.max_diff - lim.min_diff:g} of its range [{lim.min_diff:g}, "
                    f"{lim.max_diff:g}]; add smaller batches or widen error_buffer"
                )
            self._wait("insert", lambda: self._limiter.can_insert(rows, len(self._buffer)), timeout)
            buffer, lim = self._buffer, self._limiter  # either may have been replaced meanwhile
            slots = buffer.add(transition, priorities, env_ids=env_ids)
            lim.record_insert(len(slots))
            self._cond.notify_all()
        return slots

    def sample(
        self, batch_size: int, beta: float | None = None, *, timeout: float | None = _DEFAULT
    ) -> Any:
        """``buffer.sample`` once the limiter lets ``batch_size`` samples through.

        The draw is made under the limiter's lock, the rows read after it
        (see the class). O(B log N) plus the rows' read.

        Raises:
            ValueError: ``batch_size`` too large for this machine's memory
                (see :func:`fastper.batch.check_batch_size`), or the
                limiter's range too narrow to ever admit a batch of that
                size (widen ``error_buffer``).
            RateLimitTimeout, RateLimiterCancelled: as for :meth:`add`.
            Exception: whatever the buffer's sampling raises (then nothing is
                counted).
        """
        b = check_batch_size(batch_size, self._row_nbytes)
        with self._cond:
            buffer, lim = self._buffer, self._limiter
            lim.check_batch(b)
            self._wait("sample", lambda: self._limiter.can_sample(b, len(self._buffer)), timeout)
            buffer, lim = self._buffer, self._limiter  # either may have been replaced meanwhile
            if not self._split:
                batch = buffer.sample(b, beta)
                lim.record_sample(b)
                self._cond.notify_all()
                return batch
            drawn = buffer.draw(b, beta)  # one atomic step with the decision
            lim.record_sample(b)
            self._cond.notify_all()
        try:
            return self._read(buffer, drawn, beta)
        except BaseException:
            with self._cond:  # nothing was handed out: give the samples back
                lim.record_sample(-b)
                undraw = getattr(buffer, "undraw", None)
                if callable(undraw):  # and the draw, if nothing was drawn since
                    undraw()
                self._cond.notify_all()
            raise

    def _read(self, buffer: Any, drawn: Any, beta: float | None) -> SampleBatch:
        """The rows of ``drawn``, read without the limiter's lock; overwritten ones drawn again.

        O(B) plus the read; each further round reads only the rows that were
        overwritten. After :data:`_REDRAW_ROUNDS` rounds the rest is sampled
        whole by the buffer (draw and read under its own lock).
        """
        b = int(np.shape(drawn.indices)[0])
        again_beta = getattr(drawn, "beta", None)  # the beta of the first draw, kept
        again_beta = beta if again_beta is None else again_beta
        again = self._redraw_args
        data, fresh = _gathered(buffer, drawn.indices, drawn.keys, b)
        idx, keys = drawn.indices, drawn.keys
        prob, weights = drawn.probabilities, drawn.weights
        stale = np.flatnonzero(~fresh)
        if stale.size:
            with self._cond:
                self._stats["redrawn_rows"] += int(stale.size)
            idx, keys, prob, weights = (np.array(a, copy=True) for a in (idx, keys, prob, weights))
            parts = (idx, keys, prob, weights)
            for _ in range(_REDRAW_ROUNDS):
                redrawn = buffer.draw(int(stale.size), again_beta, **again)
                got, ok = _gathered(buffer, redrawn.indices, redrawn.keys, int(stale.size))
                new = (redrawn.indices, redrawn.keys, redrawn.probabilities, redrawn.weights)
                data = _place(data, stale[ok], got, np.flatnonzero(ok), parts, new)
                stale = stale[~ok]
                if not stale.size:
                    break
            else:
                last = buffer.sample(int(stale.size), again_beta)  # rows and keys agree
                every = np.arange(stale.size)
                new = (last.indices, last.keys, last.probabilities, last.weights)
                data = _place(data, stale, last.data, every, parts, new)
            if getattr(buffer, "weight_norm", None) == "batch" and again_beta is not None:
                # each draw was normalised by its own largest weight: normalise the merged
                # batch by the largest of all of them, as one draw would have been
                weights = _policy.is_weights(prob, 1.0, 1.0, b, float(again_beta), "batch")
        return SampleBatch(data, idx, weights, prob, keys, again_beta)

    def can_insert(self, count: int = 1) -> bool:
        """Whether ``count`` inserts would go ahead without waiting now."""
        with self._cond:
            return self._limiter.can_insert(count, len(self._buffer))

    def can_sample(self, batch_size: int = 1) -> bool:
        """Whether a batch of ``batch_size`` would be sampled without waiting now."""
        with self._cond:
            return self._limiter.can_sample(batch_size, len(self._buffer))

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
        """Counters and waits: inserts, samples, diff, per side how often / how long calls
        waited, and ``redrawn_rows``: rows drawn again, their slot overwritten during the read."""
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
        if name.startswith("_") or name in ("buffer", "limiter"):
            raise AttributeError(name)
        return getattr(self._buffer, name)

    def __repr__(self) -> str:
        return f"RateLimitedBuffer({self.buffer!r}, {self.limiter!r})"


#: rounds of drawing again the rows overwritten during a read, before the rest
#: is sampled whole by the buffer
_REDRAW_ROUNDS = 3


def _row_nbytes(buffer: Any) -> int:
    """Bytes of one stored row of ``buffer`` (0 when it does not say). O(fields)."""
    fields = getattr(buffer, "fields", None)
    if not isinstance(fields, Mapping):
        return 0
    return int(sum(int(getattr(f, "nbytes_per_item", 0)) for f in fields.values()))


def _gathered(buffer: Any, indices: Any, keys: Any, n: int) -> tuple[dict[str, Any], np.ndarray]:
    """``buffer.gather(indices, keys)``: the rows and their fresh mask (n bools). O(n) plus the read.

    ``gather`` returns a pair ``(rows, fresh)`` (e.g. a :class:`~fastper.batch.Gathered`):
    ``fresh`` is False where the slot was overwritten since the draw.
    """
    data, fresh = buffer.gather(indices, keys)
    mask = to_numpy(fresh)
    if mask.shape != (n,) or mask.dtype != np.bool_:
        raise TypeError(
            f"`buffer.gather` must return the rows and a bool mask of {n} entries, got a mask "
            f"{show(mask)}"
        )
    return dict(data), mask


def _place(
    data: dict[str, Any],
    to: np.ndarray,
    rows: Mapping[str, Any],
    source: np.ndarray,
    parts: tuple[np.ndarray, ...],
    new: tuple[Any, ...],
) -> dict[str, Any]:
    """Put rows ``source`` of ``rows`` / ``new`` at positions ``to`` of ``data`` / ``parts``.

    O(len(to)) per field: no Python loop over rows.
    """
    if not to.size:
        return data
    for name, column in data.items():
        if not getattr(getattr(column, "flags", None), "writeable", True):
            column = data[name] = np.array(column, copy=True)
        column[to] = rows[name][source]
    for part, values in zip(parts, new, strict=True):
        part[to] = np.asarray(values)[source]
    return data


def _row_count(buffer: Any, transition: Mapping[str, Any]) -> int:
    """Rows in ``transition`` for ``buffer``'s fields (1 for a single transition). O(fields)."""
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
