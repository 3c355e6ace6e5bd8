"""One test per fixed bug, named after what went wrong."""

from __future__ import annotations

import hashlib
import json
import math
import struct

import numpy as np
import pytest

import fastper
from fastper.checkpoint import _PREFIX, MAGIC


def test_float_just_past_int64_max_is_rejected_not_wrapped() -> None:
    # float(2**63 - 1) rounds up to 2**63, so a `hi > max` check let 2.0**63 through
    store = fastper.Storage({"x": np.int64}, 2)
    with pytest.raises(fastper.FieldTypeError, match="overflow"):
        store.add({"x": 2.0**63})
    ustore = fastper.Storage({"x": np.uint64}, 2)
    with pytest.raises(fastper.FieldTypeError, match="overflow"):
        ustore.add({"x": 2.0**64})
    assert store.size == 0 and ustore.size == 0


def test_alpha_zero_never_samples_zero_priority() -> None:
    # 0.0 ** 0.0 == 1 made zero-priority slots sampleable at alpha = 0
    buf = fastper.PrioritizedReplayBuffer(4, {"x": np.float32}, alpha=0.0, eps=0.0, seed=0)
    buf.add({"x": np.zeros(3)}, priorities=[0.0, 1.0, 2.0])
    drawn = buf.sample(512).indices
    assert 0 not in drawn
    np.testing.assert_allclose(buf.probabilities([0, 1, 2]), [0.0, 0.5, 0.5])
    buf.update_priorities([1, 2], [0.0, 0.0])
    with pytest.raises(fastper.ZeroPriorityError):
        buf.sample(4)


def test_find_at_total_reaches_last_positive_leaf_across_levels() -> None:
    # the rounding clamp used to leave the target at ~0, so the levels below
    # went to their *first* child (returned 512 instead of 998 at capacity 1000)
    tree = fastper.SumTree(1000)
    rng = np.random.default_rng(0)
    values = rng.random(1000)
    values[999] = 0.0
    tree.set(np.arange(1000), values)
    for t in (tree.total, tree.total * (1 - 2**-52), tree.total * (1 - 4 * 2**-52)):
        assert tree.find(t) == 998


def test_leaves_cannot_overflow_the_total() -> None:
    tree = fastper.SumTree(2)
    with pytest.raises(ValueError, match="total stays finite"):
        tree.set([0, 1], [1e308, 1e308])
    assert tree.total == 0.0
    buf = fastper.PrioritizedReplayBuffer(8, {"x": np.float32}, alpha=1.0)
    buf.add({"x": np.zeros(2)})
    with pytest.raises(ValueError, match="stays finite"):
        buf.update_priorities([0], [1e308])
    buf.update_priorities([0], [1e200])
    with pytest.raises(ValueError, match="stays finite"):
        buf.set_alpha(2.0)  # 1e200**2 overflows
    assert buf.alpha == 1.0 and math.isfinite(buf._sampler.total)


def test_find_rejects_2d_targets() -> None:
    tree = fastper.SumTree(4)
    tree.set([0, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="scalar or 1-D"):
        tree.find([[0.0, 1.0], [0.5, 1.5]])


def test_negative_zero_is_stored_as_positive_zero() -> None:
    tree = fastper.SumTree(3)
    tree.set([1], [-0.0])
    assert math.copysign(1.0, tree.get([1])[0]) == 1.0


def _reframe(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    head = _PREFIX.pack(MAGIC, 1, len(raw)) + raw
    body = head + hashlib.sha256(head).digest() + data
    return body + hashlib.sha256(body).digest()


def _split(blob: bytes) -> tuple[dict, bytes]:
    _, _, hlen = struct.unpack_from("<8sIQ", blob)
    start = _PREFIX.size
    header = json.loads(blob[start : start + hlen])
    return header, blob[start + hlen + 32 : -32]


def test_non_finite_number_in_header_is_a_checkpoint_error(tmp_path) -> None:
    # json accepts Infinity / NaN; int(inf) used to escape as OverflowError
    buf = fastper.PrioritizedReplayBuffer(8, {"x": np.float32}, seed=0)
    buf.add({"x": np.zeros(3)})
    path = tmp_path / "a.fpk"
    buf.save(path)
    header, data = _split(path.read_bytes())
    header["capacity"] = float("inf")
    path.write_bytes(_reframe(header, data))
    with pytest.raises(fastper.CheckpointError, match="non-finite"):
        fastper.load(path)


def test_incomplete_rank_order_is_rejected(tmp_path) -> None:
    # an order missing slots (none marked changed) used to load and never sample them
    buf = fastper.RankBasedReplayBuffer(8, {"x": np.float32}, seed=0)
    buf.add({"x": np.zeros(8)}, priorities=np.arange(8.0, 0.0, -1.0))
    buf.sample(2)  # merge the order
    path = tmp_path / "r.fpk"
    buf.save(path)
    header, data = _split(path.read_bytes())
    table = {a["name"]: a for a in header["arrays"]}
    order = table["sampler/order"]
    cut = order["nbytes"] // 2
    # shrink the order to its first half and shift the arrays after it
    new_data = data[: order["offset"] + cut] + data[order["offset"] + order["nbytes"] :]
    for a in header["arrays"]:
        if a["offset"] > order["offset"]:
            a["offset"] -= cut
    order["nbytes"] = cut
    order["shape"] = [4]
    path.write_bytes(_reframe(header, new_data))
    with pytest.raises(fastper.CheckpointError, match="misses stored slots"):
        fastper.load(path)
