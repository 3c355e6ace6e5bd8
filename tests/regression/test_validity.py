"""Validity is per slot: one mask plus zero mass in the index, under every scheme.

Regression tests for a frame buffer whose validity was one watermark for
the whole buffer (an idle stream invalidated every transition), and checks
that uniform and rank-based replay respect invalid slots as proportional
replay does (chi-square against the law over the valid slots, fixed seeds).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from scipy.stats import chisquare

import fastper
from fastper import PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer

SHAPE = (2, 2)
FRAME_FIELDS = {
    "obs": (SHAPE, np.uint8), "next_obs": (SHAPE, np.uint8), "action": ((), np.int64),
    "reward": ((), np.float32), "terminated": ((), bool), "truncated": ((), bool),
}  # fmt: skip
FIELDS = {"obs": ((2,), np.float32), "action": ((), np.int64)}
CLASSES = [ReplayBuffer, PrioritizedReplayBuffer, RankBasedReplayBuffer]


def frame_row(stream: int, t: int, action: int) -> dict[str, Any]:
    """Step ``t`` of ``stream``'s endless episode: frame ``t`` -> frame ``t + 1``."""

    def frame(i: int) -> np.ndarray:
        return np.full(SHAPE, (stream * 97 + i) % 251, dtype=np.uint8)

    return {"obs": frame(t), "next_obs": frame(t + 1), "action": action, "reward": 0.0,
            "terminated": False, "truncated": False}  # fmt: skip


@pytest.mark.parametrize("cls", CLASSES)
def test_defect_idle_stream_invalidates_only_its_own_transitions(cls: Any) -> None:
    """Stream 1 adds once, idles while stream 0 fills the frame ring, then adds again.

    With one watermark for the whole buffer, that second add made every
    stored transition invalid (``num_valid`` 0, ``sample`` raising
    EmptyBufferError). Only stream 1's transitions lost frames of their own.
    """
    buf = cls(64, FRAME_FIELDS, frame_stack={"obs": 2}, frame_capacity=40, seed=0)
    buf.add(frame_row(1, 0, action=1000), env_ids=1)
    for t in range(50):  # 51 frames: stream 1's two frames are overwritten
        buf.add(frame_row(0, t, action=t), env_ids=0)
    buf.add(frame_row(1, 1, action=1001), env_ids=1)
    assert len(buf) == 52
    # 55 frames were written (stream 1 rewrote its observation: its frame was gone),
    # so frames 0..14 are overwritten. Stream 0's step t needs frames t+1 .. t+3:
    # steps 14..49 keep all theirs. Stream 1's second step needs its lost frame 1.
    assert buf.frame_store.added == 55 and buf.frame_store.oldest == 15
    data = buf.storage.gather(np.arange(len(buf)))
    valid = buf.is_valid(np.arange(len(buf)))
    actions = data["action"]
    np.testing.assert_array_equal(valid, (actions >= 14) & (actions < 1000))
    assert buf.num_valid == 36
    batch = buf.sample(256)
    assert buf.is_valid(batch.indices).all()
    assert np.all(batch.data["action"] < 1000)
    assert np.all(batch.probabilities > 0)


@pytest.mark.parametrize("cls", CLASSES)
def test_invalid_slots_are_never_drawn_and_the_law_is_over_the_valid_ones(cls: Any) -> None:
    buf = cls(256, FIELDS, seed=5)
    buf.add({"obs": np.zeros((200, 2)), "action": np.arange(200)})
    rng = np.random.default_rng(1)
    buf.update_priorities(np.arange(200), rng.exponential(size=200) + 0.05)
    bad = rng.choice(200, size=60, replace=False)
    assert buf.invalidate(bad) == 60
    assert buf.invalidate(bad[:10]) == 0  # already invalid
    assert buf.num_valid == 140
    slots = np.arange(200)
    probs = buf.probabilities(slots)
    assert np.all(probs[bad] == 0) and probs.sum() == pytest.approx(1.0, rel=1e-12)
    counts = np.zeros(200)
    for _ in range(300):
        s = buf.sample(128)
        np.add.at(counts, s.indices, 1)
        np.testing.assert_allclose(s.probabilities, probs[s.indices], rtol=1e-12)
    assert counts[bad].sum() == 0
    live = probs > 0
    assert chisquare(counts[live], probs[live] * counts.sum()).pvalue > 1e-3
    # updates to invalid slots are dropped; a new add makes the slot valid again
    before = buf.stale_updates
    assert buf.update_priorities(bad[:5], np.full(5, 9.0)) == 0
    assert buf.stale_updates == before + 5
    assert np.all(buf.probabilities(bad[:5]) == 0)
    buf.add({"obs": np.zeros((56, 2)), "action": np.arange(56)})  # fills slots 200..255
    buf.add({"obs": np.zeros((200, 2)), "action": np.arange(200)})  # wraps over 0..199
    assert buf.num_valid == 256 and buf.is_valid(slots).all()


@pytest.mark.parametrize("cls", CLASSES)
def test_invalid_slots_survive_checkpoints_and_clear_resets_them(cls: Any, tmp_path: Any) -> None:
    buf = cls(64, FIELDS, seed=2)
    buf.add({"obs": np.zeros((40, 2)), "action": np.arange(40)})
    buf.invalidate([3, 7, 11])
    path = tmp_path / "v.fpk"
    buf.save(path)
    back = fastper.load(path)
    assert back.num_valid == 37
    assert not back.is_valid([3, 7, 11]).any()
    a, b = buf.sample(64), back.sample(64)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.weights, b.weights)
    back.clear()
    assert back.num_valid == 0 and len(back) == 0
    back.add({"obs": np.zeros((40, 2)), "action": np.arange(40)})
    assert back.num_valid == 40


def test_everything_invalid_raises_a_clear_error() -> None:
    buf = PrioritizedReplayBuffer(8, FIELDS, seed=0)
    buf.add({"obs": np.zeros((4, 2)), "action": np.arange(4)})
    buf.invalidate(np.arange(4))
    state = buf._rng.bit_generator.state  # noqa: SLF001 - the RNG must not move
    with pytest.raises(fastper.EmptyBufferError, match="none of the 4 stored transitions"):
        buf.sample(2)
    assert buf._rng.bit_generator.state == state  # noqa: SLF001


def test_switching_scheme_keeps_invalid_slots_out() -> None:
    buf = PrioritizedReplayBuffer(64, FIELDS, seed=0)
    buf.add({"obs": np.zeros((50, 2)), "action": np.arange(50)})
    buf.invalidate(np.arange(0, 50, 5))
    buf.switch_scheme("rank")
    assert buf.num_valid == 40
    s = buf.sample(512)
    assert np.all(s.indices % 5 != 0)
    buf.switch_scheme("proportional")
    s = buf.sample(512)
    assert np.all(s.indices % 5 != 0)


def test_sample_refuses_an_absurd_batch_size_before_allocating() -> None:
    buf = ReplayBuffer(8, FIELDS, seed=0)
    buf.add({"obs": np.zeros((4, 2)), "action": np.arange(4)})
    with pytest.raises(ValueError, match="batch_size"):
        buf.sample(10**12)


def test_defect_first_wrap_of_the_frame_ring_loses_the_right_frames() -> None:
    """An add that fills the frame ring and overwrites its first frames in one call.

    The overwritten frames are the last ones of the add: their transitions were
    kept valid (and served a stack with the new frame's pixels in it) when the
    first ones, which went to empty slots, were taken as the overwritten ones.
    """
    buf = ReplayBuffer(32, FRAME_FIELDS, frame_stack={"obs": 2}, frame_capacity=6, seed=0)
    buf.add(
        {k: np.stack([np.asarray(frame_row(0, t, t)[k]) for t in range(4)]) for k in FRAME_FIELDS},
        env_ids=np.zeros(4, dtype=np.int64),
    )  # frames 0..4
    buf.add(
        {k: np.stack([np.asarray(frame_row(0, t, t)[k]) for t in (4, 5)]) for k in FRAME_FIELDS},
        env_ids=np.zeros(2, dtype=np.int64),
    )  # frames 5 and 6: frame 6 overwrites frame 0
    assert buf.frame_store.added == 7 and buf.frame_store.oldest == 1
    # step t's stacks need frames t-1 .. t+1 (step 0: 0 .. 1): steps 0 and 1 lost frame 0
    np.testing.assert_array_equal(buf.is_valid(np.arange(6)), [False, False] + [True] * 4)
    for _ in range(20):
        s = buf.sample(16)
        t = s.data["action"]
        assert np.all(t >= 2)
        # obs stack = frames t-1, t of stream 0 (frame i holds the value i)
        np.testing.assert_array_equal(s.data["obs"][:, 1, 0, 0], t)
        np.testing.assert_array_equal(s.data["obs"][:, 0, 0, 0], t - 1)


def test_ranks_refuse_invalid_slots_and_adopt_refuses_frame_buffers() -> None:
    buf = RankBasedReplayBuffer(16, FIELDS, seed=0)
    buf.add({"obs": np.zeros((10, 2)), "action": np.arange(10)})
    buf.invalidate([3])
    with pytest.raises(ValueError, match="invalid slots"):
        buf.ranks([2, 3])
    assert sorted(buf.ranks([0, 1, 2, 4, 5, 6, 7, 8, 9]).tolist()) == list(range(1, 10))
    frames = PrioritizedReplayBuffer(8, FRAME_FIELDS, frame_stack={"obs": 2}, seed=0)
    with pytest.raises(ValueError, match="frame_stack"):
        frames.adopt(2)
    assert len(frames) == 0


def test_bad_input_to_invalidate_and_gather_is_refused_and_changes_nothing() -> None:
    buf = PrioritizedReplayBuffer(16, FIELDS, seed=0)
    buf.add({"obs": np.zeros((6, 2)), "action": np.arange(6)})
    buf.invalidate([1])
    before = buf.state_dict()
    with pytest.raises(fastper.InvalidIndexError):
        buf.invalidate([2, 9])  # slot 9 never written: nothing invalidated, not even 2
    with pytest.raises(TypeError, match="`indices`"):
        buf.invalidate([2.0])
    drawn = buf.draw(4)
    after_draw = buf.state_dict()
    with pytest.raises(ValueError, match="`keys` must have 4 entries"):
        buf.gather(drawn.indices, drawn.keys[:3])
    with pytest.raises(fastper.InvalidIndexError):
        buf.gather([99], [0])
    assert buf.num_valid == 5 and buf.is_valid([2]).all()
    assert after_draw["buffer"] == buf.state_dict()["buffer"]
    np.testing.assert_array_equal(
        before["sampler"]["priorities"], buf.state_dict()["sampler"]["priorities"]
    )
    data, fresh = buf.gather(drawn.indices, drawn.keys)
    assert fresh.all() and data["action"].shape == (4,)
