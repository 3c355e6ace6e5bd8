"""Frame streams: every sampled stack against a naive reference.

The reference keeps each episode's frames in a Python list and numbers every
frame in the order it is first seen; a transition that starts at step ``t``
of an episode has the stack of frames ``t-k+1 .. t`` and, for its next
observation, ``j-k+1 .. j`` with ``j = min(t + n, episode length)``, padded
before the episode's first frame. Random episode lengths, several streams
interleaved, both rings wrapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import fastper
from fastper import PrioritizedReplayBuffer, ReplayBuffer

SHAPE = (3, 2)


@dataclass
class Episode:
    frames: list[np.ndarray] = field(default_factory=list)
    gids: list[int] = field(default_factory=list)  # global frame ids, in write order
    length: int | None = None  # rows, once it ended


@dataclass
class Row:
    stream: int
    step_id: int
    obs: np.ndarray
    next_obs: np.ndarray
    terminated: bool
    truncated: bool
    ep: Episode | None  # None: an autoreset row (not a transition)
    t: int
    new_ep: Episode | None = None  # the episode an autoreset row starts


def stream_rows(rng: np.random.Generator, stream: int, n_rows: int, autoreset: bool,
                counter: list[int], max_len: int) -> list[Row]:  # fmt: skip
    rows: list[Row] = []
    ep = Episode(frames=[rng.integers(0, 256, SHAPE, dtype=np.uint8)])
    length = int(rng.integers(1, max_len + 1))
    t = 0
    while len(rows) < n_rows:
        nxt = rng.integers(0, 256, SHAPE, dtype=np.uint8)
        ep.frames.append(nxt)
        end = t + 1 == length
        term = bool(end and rng.random() < 0.5)
        counter[0] += 1
        rows.append(Row(stream, counter[0], ep.frames[t], nxt, term, end and not term, ep, t))
        t += 1
        if end:
            ep.length = t
            new = Episode(frames=[rng.integers(0, 256, SHAPE, dtype=np.uint8)])
            if autoreset and len(rows) < n_rows:
                counter[0] += 1
                rows.append(Row(stream, counter[0], nxt, new.frames[0], False, False, None, 0, new))
            ep, t = new, 0
            length = int(rng.integers(1, max_len + 1))
    return rows


def interleave(rng: np.random.Generator, per_stream: list[list[Row]]) -> list[list[Row]]:
    """Random batches of 1-5 rows; each stream's rows stay in order."""
    left = [list(r) for r in per_stream]
    order: list[Row] = []
    while any(left):
        sizes = np.array([len(x) for x in left], dtype=float)
        s = int(rng.choice(len(left), p=sizes / sizes.sum()))
        order.append(left[s].pop(0))
    batches = []
    i = 0
    while i < len(order):
        b = int(rng.integers(1, 6))
        batches.append(order[i : i + b])
        i += b
    return batches


def assign_gids(batches: list[list[Row]]) -> int:
    """Number frames in the order the buffer first writes them; returns the count."""
    gid = 0
    started: set[int] = set()
    for batch in batches:
        for row in batch:
            if row.ep is None:  # autoreset row: its next frame starts an episode
                assert row.new_ep is not None
                row.new_ep.gids.append(gid)
                gid += 1
                started.add(id(row.new_ep))
                continue
            if row.t == 0 and id(row.ep) not in started:
                row.ep.gids.append(gid)
                gid += 1
                started.add(id(row.ep))
            row.ep.gids.append(gid)
            gid += 1
    return gid


def to_batch(rows: list[Row]) -> dict[str, np.ndarray]:
    return {
        "obs": np.stack([r.obs for r in rows]),
        "next_obs": np.stack([r.next_obs for r in rows]),
        "action": np.array([r.step_id for r in rows], dtype=np.int64),
        "reward": np.ones(len(rows), dtype=np.float32),
        "terminated": np.array([r.terminated for r in rows]),
        "truncated": np.array([r.truncated for r in rows]),
    }


FIELDS = {
    "obs": (SHAPE, np.uint8), "next_obs": (SHAPE, np.uint8), "action": ((), np.int64),
    "reward": ((), np.float32), "terminated": ((), bool), "truncated": ((), bool),
}  # fmt: skip


def ref_stack(ep: Episode, j: int, k: int, pad: str) -> tuple[np.ndarray, list[int]]:
    frames, gids = [], []
    for i in range(j - k + 1, j + 1):
        if i >= 0:
            frames.append(ep.frames[i])
            gids.append(ep.gids[i])
        else:
            frames.append(ep.frames[0] if pad == "repeat" else np.zeros(SHAPE, np.uint8))
    return np.stack(frames), gids


def reference(row: Row, k: int, n: int, pad: str) -> tuple[np.ndarray, np.ndarray, list[int]]:
    assert row.ep is not None
    j = row.t + n if row.ep.length is None else min(row.t + n, row.ep.length)
    obs, g1 = ref_stack(row.ep, row.t, k, pad)
    nxt, g2 = ref_stack(row.ep, j, k, pad)
    return obs, nxt, g1 + g2


def check_buffer(buf: Any, by_id: dict[int, Row], k: int, n: int, pad: str,
                 frames_written: int, frame_cap: int, draws: int = 40) -> int:  # fmt: skip
    """Sampled stacks equal the reference; a transition is sampleable exactly when it
    has all its frames."""
    slots = np.arange(len(buf))
    probs = buf.probabilities(slots)
    assert probs.sum() == pytest.approx(1.0, rel=1e-9)
    data = buf.storage.gather(slots)
    oldest = frames_written - frame_cap
    live = probs > 0
    for slot in range(len(buf)):
        _, _, gids = reference(by_id[int(data["action"][slot])], k, n, pad)
        if live[slot]:
            assert min(gids) >= oldest, "a sampleable transition lost a frame"
        else:  # validity is per transition: only one that lost a frame of its own is invalid
            assert min(gids) < oldest, "a transition with all its frames is not sampleable"
    assert live.sum() == buf.num_valid
    seen = 0
    for _ in range(draws):
        s = buf.sample(32)
        assert s.data["obs"].shape == (32, k, *SHAPE)
        assert np.all(s.probabilities > 0)
        if isinstance(buf, PrioritizedReplayBuffer):  # IS weights count the valid ones only
            p_min = probs[live].min()
            want = (buf.num_valid * s.probabilities) ** -buf.beta
            np.testing.assert_allclose(
                s.weights, want / (buf.num_valid * p_min) ** -buf.beta, rtol=1e-9
            )
        else:
            np.testing.assert_allclose(s.probabilities, 1.0 / buf.num_valid)
        for b in range(32):
            obs, nxt, _ = reference(by_id[int(s.data["action"][b])], k, n, pad)
            np.testing.assert_array_equal(s.data["obs"][b], obs)
            np.testing.assert_array_equal(s.data["next_obs"][b], nxt)
            seen += 1
    return seen


@pytest.mark.parametrize(
    ("cls", "n", "autoreset", "pad", "frame_cap", "max_len"),
    [
        (PrioritizedReplayBuffer, 1, False, "zero", None, 9),
        (PrioritizedReplayBuffer, 3, False, "repeat", None, 9),
        (ReplayBuffer, 3, True, "zero", None, 9),
        (PrioritizedReplayBuffer, 2, True, "zero", 90, 5),  # frame ring tight: invalidations
        (ReplayBuffer, 1, False, "repeat", 80, 4),
    ],
)
def test_stacks_match_reference_env_ids(
    cls: Any, n: int, autoreset: bool, pad: str, frame_cap: int | None, max_len: int
) -> None:
    rng = np.random.default_rng(7 + n)
    k, cap = 4, 64
    counter = [0]
    per_stream = [
        stream_rows(rng, s, int(rng.integers(60, 120)), autoreset, counter, max_len)
        for s in range(3)
    ]
    batches = interleave(rng, per_stream)
    total_frames = assign_gids(batches)
    by_id = {r.step_id: r for rows in per_stream for r in rows}
    buf = cls(
        cap, FIELDS, frame_stack={"obs": k}, frame_capacity=frame_cap, frame_pad=pad,
        n_step=n, autoreset="next_step" if autoreset else None, seed=3,
    )  # fmt: skip
    fcap = buf.frame_store.capacity
    written = 0
    for i, batch in enumerate(batches):
        ids = np.array([r.stream * 11 for r in batch])  # any ids: 0, 11, 22
        buf.add(to_batch(batch), env_ids=ids)
        written += sum(
            (1 if r.ep is None else 1 + (r.t == 0 and r.ep.gids and r.ep.gids[0] >= written))
            for r in batch
        )
        if i % 25 == 24:
            check_buffer(buf, by_id, k, n, pad, buf.frame_store.added, fcap, draws=3)
    assert buf.frame_store.added == total_frames
    assert buf.total_added > cap  # the transition ring wrapped
    assert total_frames > fcap  # so did the frame ring
    check_buffer(buf, by_id, k, n, pad, total_frames, fcap)
    if frame_cap is not None:
        store = buf.frame_store
        assert store.invalidated_total > 0
        assert store.invalidated == store.invalidated_total  # the older name
        # a running total: at least as many as are invalid now (some have left the ring)
        assert store.invalidated_total >= len(buf) - buf.num_valid > 0


@pytest.mark.parametrize("n", [1, 3])
def test_stacks_match_reference_vector_env(n: int) -> None:
    rng = np.random.default_rng(11)
    k, cap, envs, steps = 3, 50, 4, 60
    counter = [0]
    per_stream = [stream_rows(rng, s, steps, True, counter, 8) for s in range(envs)]
    batches = [[per_stream[s][t] for s in range(envs)] for t in range(steps)]
    total = assign_gids(batches)
    by_id = {r.step_id: r for rows in per_stream for r in rows}
    buf = PrioritizedReplayBuffer(
        cap, FIELDS, frame_stack={"obs": k}, n_step=n, n_envs=envs, autoreset="next_step",
        seed=1,
    )  # fmt: skip
    for batch in batches:
        buf.add(to_batch(batch))
    assert buf.frame_store.added == total
    check_buffer(buf, by_id, k, n, "zero", total, buf.frame_store.capacity)


def test_memory_per_slot_atari_shape() -> None:
    """1M Atari transitions (84x84 uint8, stack 4) fit in 7.2 GB: bytes per slot, exactly."""
    fields = {
        "obs": ((84, 84), np.uint8), "next_obs": ((84, 84), np.uint8),
        "action": ((), np.uint8), "reward": ((), np.float32), "terminated": ((), bool),
        "truncated": ((), bool),
    }  # fmt: skip
    cap = 10_000
    buf = PrioritizedReplayBuffer(cap, fields, frame_stack={"obs": 4})
    nb = buf.nbytes()
    per_slot = (nb["data"] + nb["index"]) / cap
    fcap = buf.frame_store.capacity
    frame = 84 * 84
    # frames (+1 padding frame) with 16 bytes of links each; per slot 2 ids, 8 bytes of
    # validity links (each transition filed under the oldest frame it needs), 7 bytes of
    # fields; the ids and fields are one record, 23 bytes padded to 24
    assert buf.storage.layout == "records"
    assert nb["data"] == (fcap + 1) * frame + fcap * 16 + cap * (24 + 8)
    # the same formula at 1M slots (index bytes per slot as measured here)
    big = 1_000_000
    fbig = fastper.frames.default_frame_capacity(big)
    index_per_slot = nb["index"] / cap
    assert index_per_slot < 20
    total = (fbig + 1) * frame + fbig * 16 + big * (24 + 8) + index_per_slot * big
    assert total < 7.2e9, total
    assert per_slot < 7300  # the +64 frames of margin weigh more at 10k slots


def test_obs_must_continue_its_stream() -> None:
    buf = PrioritizedReplayBuffer(10, FIELDS, frame_stack={"obs": 2}, seed=0)
    a, b, c = (np.full(SHAPE, v, np.uint8) for v in (1, 2, 3))
    row = {"action": 0, "reward": 0.0, "terminated": False, "truncated": False}
    buf.add({"obs": a, "next_obs": b, **row})
    before = buf.state_dict()
    with pytest.raises(ValueError, match="consecutive steps"):
        buf.add({"obs": c, "next_obs": a, **row})
    after = buf.state_dict()
    assert after["frames"]["added"] == before["frames"]["added"] == 2
    assert buf.total_added == 1
    buf.drop_pending()  # an env reset by hand: the next row starts an episode
    buf.add({"obs": c, "next_obs": a, **row})
    s = buf.sample(8)
    firsts = {int(x) for x in s.data["obs"][:, 1, 0, 0]}
    assert firsts <= {1, 3}
    zero_pad = s.data["obs"][:, 0]
    assert np.all(zero_pad == 0)


def test_ambiguous_batches_and_bad_settings_refused() -> None:
    buf = PrioritizedReplayBuffer(10, FIELDS, frame_stack={"obs": 2})
    two = to_batch(
        [
            Row(0, i, np.zeros(SHAPE, np.uint8), np.zeros(SHAPE, np.uint8), False, False, None, 0)
            for i in range(2)
        ]  # fmt: skip
    )
    with pytest.raises(ValueError, match="stream information"):
        buf.add(two)
    assert buf.total_added == 0 and buf.frame_store.added == 0
    with pytest.raises(ValueError, match="episodes end"):
        PrioritizedReplayBuffer(
            10, {"obs": (SHAPE, np.uint8), "next_obs": (SHAPE, np.uint8)}, frame_stack={"obs": 2}
        )
    with pytest.raises(ValueError, match="both must be fields"):
        PrioritizedReplayBuffer(10, FIELDS, frame_stack={"state": 2})
    with pytest.raises(ValueError, match="frame_pad"):
        PrioritizedReplayBuffer(10, FIELDS, frame_stack={"obs": 2}, frame_pad="edge")


def test_checkpoint_round_trip(tmp_path: Any) -> None:
    rng = np.random.default_rng(3)
    counter = [0]
    per_stream = [stream_rows(rng, s, 80, False, counter, 7) for s in range(2)]
    batches = interleave(rng, per_stream)
    buf = PrioritizedReplayBuffer(
        40, FIELDS, frame_stack={"obs": 4}, frame_capacity=70, n_step=2, seed=5
    )
    half = len(batches) // 2
    for batch in batches[:half]:
        buf.add(to_batch(batch), env_ids=[r.stream for r in batch])
    s = buf.sample(16)
    buf.update_priorities(s.indices, rng.random(16), keys=s.keys)
    buf.save(tmp_path / "f.fpk")
    other = fastper.load(tmp_path / "f.fpk")
    for batch in batches[half:]:
        for b in (buf, other):
            b.add(to_batch(batch), env_ids=[r.stream for r in batch])
    x, y = buf.sample(32), other.sample(32)
    for name in x.data:
        np.testing.assert_array_equal(x.data[name], y.data[name])
    np.testing.assert_array_equal(x.weights, y.weights)
    assert other.num_valid == buf.num_valid


def test_updates_to_invalid_transitions_are_dropped() -> None:
    rng = np.random.default_rng(0)
    counter = [0]
    rows = stream_rows(rng, 0, 200, False, counter, 1)  # one-step episodes: 2 frames a row
    buf = PrioritizedReplayBuffer(100, FIELDS, frame_stack={"obs": 2}, frame_capacity=120)
    for r in rows:
        buf.add(to_batch([r]))
    assert buf.num_valid == 60  # 120 frames hold 60 one-step episodes
    slots = np.arange(100)
    invalid = slots[buf.probabilities(slots) == 0]
    assert invalid.size == 40
    stale = buf.stale_updates
    applied = buf.update_priorities(slots, np.full(100, 5.0))
    assert applied == 60
    assert buf.stale_updates == stale + 40
    assert np.all(buf.priorities(invalid) == 0)


def test_bad_frames_and_corrupt_frame_state_are_refused(tmp_path: Any) -> None:
    buf = PrioritizedReplayBuffer(10, FIELDS, frame_stack={"obs": 2}, seed=0)
    row = {"action": 0, "reward": 0.0, "terminated": False, "truncated": False}
    with pytest.raises(ValueError, match="obs"):
        buf.add({"obs": np.zeros((3, 3), np.uint8), "next_obs": np.zeros(SHAPE, np.uint8), **row})
    with pytest.raises(fastper.FieldTypeError):
        buf.add({"obs": np.full(SHAPE, 0.5), "next_obs": np.zeros(SHAPE, np.uint8), **row})
    assert buf.frame_store.added == 0 and buf.total_added == 0
    a, b = np.full(SHAPE, 1, np.uint8), np.full(SHAPE, 2, np.uint8)
    buf.add({"obs": a, "next_obs": b, **row})
    state = buf.state_dict()
    bad = {**state, "frames": {**state["frames"], "prev": np.array([5, 0], dtype=np.int64)}}
    with pytest.raises(ValueError, match="prev"):
        fastper.from_state_dict(bad)
    missing = {k: v for k, v in state.items() if k != "frames"}
    with pytest.raises(ValueError, match="frame"):
        fastper.from_state_dict(missing)
    buf.save(tmp_path / "ok.fpk")
    meta = fastper.read_metadata(tmp_path / "ok.fpk")
    assert meta["state"]["settings"]["frame_stack"] == {"obs": 2}
    again = fastper.load(tmp_path / "ok.fpk")
    np.testing.assert_array_equal(
        again.sample(4).data["obs"][:, 1], np.broadcast_to(a, (4, *SHAPE))
    )


def test_frames_with_a_disk_storage(tmp_path: Any) -> None:
    from fastper.disk import DiskBufferError, DiskStorage, open_buffer

    rng = np.random.default_rng(2)
    counter = [0]
    rows = stream_rows(rng, 0, 60, False, counter, 6)
    by_id = {r.step_id: r for r in rows}
    assign_gids([rows])
    d = tmp_path / "disk"

    def make(f: Any, c: int) -> Any:
        return DiskStorage(f, c, d)

    buf = PrioritizedReplayBuffer(40, FIELDS, frame_stack={"obs": 3}, seed=0, storage=make)
    for r in rows[:50]:
        buf.add(to_batch([r]))
    check_buffer(buf, by_id, 3, 1, "zero", buf.frame_store.added, buf.frame_store.capacity, 3)
    buf.save(tmp_path / "c.fpk")
    for r in rows[50:]:
        buf.add(to_batch([r]))
    buf.storage.close()
    with pytest.raises(DiskBufferError, match="frame_stack"):
        open_buffer(d, tmp_path / "c.fpk")


@pytest.mark.parametrize("n", [1, 3])
def test_a_full_disk_leaves_frames_and_windows_unchanged(
    tmp_path: Any, monkeypatch: Any, n: int
) -> None:
    import errno

    from fastper import _disk_files
    from fastper.disk import DiskStorage
    from fastper.errors import DiskFullError

    rng = np.random.default_rng(5)
    counter = [0]
    rows = stream_rows(rng, 0, 40, False, counter, 6)
    assign_gids([rows])
    by_id = {r.step_id: r for r in rows}

    def make(f: Any, c: int) -> Any:
        return DiskStorage(f, c, tmp_path / "d")

    buf = PrioritizedReplayBuffer(
        16, FIELDS, frame_stack={"obs": 3}, n_step=n, seed=0, storage=make
    )
    for r in rows[:20]:
        buf.add(to_batch([r]), env_ids=0)

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_disk_files, "pwrite_all", full)
    i = 20
    while True:  # adds that only fill an n-step window write no row and succeed
        fs = buf.frame_store
        snap = (fs.added, buf.n_pending, buf.total_added, fs.state_dict()["stream_last"].copy())
        try:
            buf.add(to_batch([rows[i]]), env_ids=0)
        except DiskFullError:
            break
        i += 1
    fs = buf.frame_store
    assert (fs.added, buf.n_pending, buf.total_added) == snap[:3]
    np.testing.assert_array_equal(fs.state_dict()["stream_last"], snap[3])
    monkeypatch.undo()
    for r in rows[i:]:  # the same row again, and the rest: the stream goes on
        buf.add(to_batch([r]), env_ids=0)
    check_buffer(buf, by_id, 3, n, "zero", fs.added, fs.capacity, draws=5)


def test_frame_shape_errors_say_what_is_expected_and_why() -> None:
    buf = PrioritizedReplayBuffer(10, FIELDS, frame_stack={"obs": 4})
    store = buf.frame_store
    one = {"action": 0, "reward": 0.0, "terminated": False, "truncated": False}
    frame = np.zeros(SHAPE, np.uint8)
    # a stack given where one frame goes: (4, 3, 2) in an add of one row
    stacked = np.zeros((4, *SHAPE), np.uint8)
    with pytest.raises(
        ValueError,
        match=r"`obs` must have shape \(3, 2\) \(one frame\).*"
        r"got shape \(4, 3, 2\).*only the newest frame.*last 4 frames",
    ):
        store.check_frame_shapes({"obs": stacked, "next_obs": frame, **one})
    with pytest.raises(ValueError, match=r"`next_obs` must have shape \(3, 2\).*\(3, 2, 4\)"):
        store.check_frame_shapes({"obs": frame, "next_obs": np.zeros((*SHAPE, 4)), **one})
    # one frame, or a batch of rows (flags of the batch's length), passes
    store.check_frame_shapes({"obs": frame, "next_obs": frame, **one})
    rows = {"action": np.zeros(4), "reward": np.zeros(4), "terminated": np.zeros(4, bool),
            "truncated": np.zeros(4, bool)}  # fmt: skip
    store.check_frame_shapes({"obs": stacked, "next_obs": stacked, **rows})
    assert store.added == 0 and buf.total_added == 0
    fields = {**FIELDS, "next_obs": ((3, 3), np.uint8)}
    with pytest.raises(ValueError, match=r"'next_obs' must have the shape and dtype of field "
                       r"'obs', \(3, 2\) uint8 \(the next observation is the episode's next "
                       r"frame"):  # fmt: skip
        PrioritizedReplayBuffer(10, fields, frame_stack={"obs": 2})


def test_add_of_a_stacked_observation_names_the_frame_shape() -> None:
    buf = PrioritizedReplayBuffer(10, FIELDS, frame_stack={"obs": 4}, seed=0)
    row = {"obs": np.zeros((4, *SHAPE), np.uint8), "next_obs": np.zeros(SHAPE, np.uint8),
           "action": 0, "reward": 0.0, "terminated": False, "truncated": False}  # fmt: skip
    with pytest.raises(ValueError, match=r"one frame.*only the newest frame"):
        buf.add(row)
    assert buf.total_added == 0 and buf.frame_store.added == 0 and len(buf) == 0
