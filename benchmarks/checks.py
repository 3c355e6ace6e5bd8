"""Correctness check run on every adapter before it is timed.

A buffer of 8 slots gets known priorities 1..8. Over many draws the sampled
frequencies must match P(i) = p_i^alpha / sum_k p_k^alpha, the gathered data
must be the data stored in the sampled slots, and the IS weights must equal
(N P(i))^-beta divided by their maximum, over the whole buffer or over the
batch (the check says which the library does). Nothing is hidden: the result
lists every problem found, and `peers.py` prints it in the report.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from adapters import Adapter, make_chunk, to_numpy


def check_adapter(
    cls: type[Adapter],
    alpha: float,
    beta: float,
    *,
    slots: int = 8,
    draws: int = 200,
    batch_size: int = 256,
    tolerance: float = 0.01,
) -> dict[str, Any]:
    """Check one library's proportional PER on a small buffer with known priorities.

    Args:
        cls: the adapter class (its library must import).
        alpha, beta: the PER exponents under test.
        slots: buffer capacity, filled completely.
        draws: number of ``sample(batch_size)`` calls for the frequency test.
        batch_size: batch size of those calls.
        tolerance: largest accepted |frequency - P(i)|.

    Returns:
        A JSON-able dict: ``ok``, ``problems`` (list of strings), ``freq_max_abs_err``,
        ``tolerance``, ``samples`` and ``weight_norm`` ("buffer", "batch", "undetermined"
        or "mismatch").
    """
    problems: list[str] = []
    ad = cls(slots, alpha, beta, 1)
    chunk = make_chunk(np.random.default_rng(1), slots)
    chunk["obs"][:, 0] = np.arange(slots, dtype=np.float32)  # marks each transition
    chunk["action"][:] = np.arange(slots)
    if cls.batched_add:
        ad.add_batch(ad.native_batch(chunk))
    else:
        for row in ad.native_rows(chunk):
            ad.add_one(row)
    if len(ad) != slots:
        problems.append(f"len after adding {slots} transitions is {len(ad)}")

    prio = np.arange(1.0, slots + 1.0)
    ad.set_priorities(np.arange(slots, dtype=np.int64), prio)
    expected = prio**alpha / np.sum(prio**alpha)

    counts = np.zeros(slots)
    bad_data = 0
    for _ in range(draws):
        s = ad.sample(batch_size)
        idx = to_numpy(s.indices).astype(np.int64).reshape(-1)
        if idx.shape != (batch_size,) or idx.min() < 0 or idx.max() >= slots:
            problems.append(f"sample returned indices of shape {idx.shape} / out of range")
            break
        counts += np.bincount(idx, minlength=slots)
        obs = to_numpy(s.data["obs"])
        action = to_numpy(s.data["action"]).reshape(-1)
        if not (np.array_equal(obs[:, 0], idx) and np.array_equal(action, idx)):
            bad_data += 1
        missing = [f for f in chunk if f not in s.data or len(to_numpy(s.data[f])) != batch_size]
        if missing:
            problems.append(f"fields not materialised for the whole batch: {missing}")
            break
    if bad_data:
        problems.append(f"gathered data does not match the sampled slots in {bad_data} batches")
    freq = counts / max(counts.sum(), 1.0)
    freq_err = float(np.max(np.abs(freq - expected)))
    if freq_err > tolerance:
        problems.append(
            f"sampled frequencies {np.round(freq, 4).tolist()} differ from "
            f"p^alpha/sum {np.round(expected, 4).tolist()} by {freq_err:.4f} > {tolerance}"
        )

    norm, worst = _weight_norm(ad, expected, beta, slots)
    if norm == "mismatch":
        problems.append(
            f"IS weights differ from (N P)^-beta / max (over buffer or batch): "
            f"worst relative error {worst:.3g}"
        )
    return {
        "ok": not problems,
        "problems": problems,
        "freq_max_abs_err": freq_err,
        "tolerance": tolerance,
        "samples": int(counts.sum()),
        "weight_norm": norm,
    }


def _weight_norm(
    ad: Adapter, expected: np.ndarray, beta: float, slots: int, tries: int = 200
) -> tuple[str, float]:
    """Which normalisation the weights of small batches follow, and the worst error."""
    seen: set[str] = set()
    worst = 0.0
    w_max_buffer = (slots * expected.min()) ** -beta
    for _ in range(tries):
        s = ad.sample(4)
        idx = to_numpy(s.indices).astype(np.int64).reshape(-1)
        w = to_numpy(s.weights).astype(np.float64).reshape(-1)
        raw = (slots * expected[idx]) ** -beta
        if w.shape != raw.shape:
            seen.add("mismatch")
            worst = np.inf
            continue
        by_buffer = raw / w_max_buffer
        by_batch = raw / raw.max()
        ok_buffer = bool(np.allclose(w, by_buffer, rtol=1e-3, atol=0))
        ok_batch = bool(np.allclose(w, by_batch, rtol=1e-3, atol=0))
        if ok_buffer and not ok_batch:
            seen.add("buffer")
        elif ok_batch and not ok_buffer:
            seen.add("batch")
        elif not ok_buffer and not ok_batch:
            seen.add("mismatch")
            worst = max(worst, float(np.max(np.abs(w / by_buffer - 1))))
    if "mismatch" in seen or len(seen) > 1:
        return "mismatch", worst
    return (seen.pop() if seen else "undetermined"), worst
