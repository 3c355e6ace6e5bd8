"""Pipelined sharded sampling and the socket channel, without Ray.

Pipelined mode draws the next batches while the learner trains and carries
priority updates with the next call; strict mode stays exact. The socket
channel (``fastper.distributed.wire``) is tested here with shards served by
threads of this process (``local_channels``), so its format, its errors and
its parity with the in-process transport need no Ray.
"""

from __future__ import annotations

import socket
import threading
import warnings

import numpy as np
import pytest
from scipy import stats

import fastper
from fastper.distributed import (
    LocalTransport,
    Shard,
    ShardedReplayBuffer,
    ShardLostError,
    ShardLostWarning,
    wire,
)
from fastper.distributed.wire import WireError, decode, encode, local_channels

FIELDS = {"x": ((), np.float64), "tag": ((), np.int64)}


def rows(values: np.ndarray, tag: int) -> dict[str, np.ndarray]:
    return {"x": np.asarray(values, dtype=np.float64), "tag": np.full(len(values), tag)}


def shards_with_mass(masses: list[float], n: int = 50, seed: int = 0) -> list[Shard]:
    """Shards of ``n`` items each, shard ``s`` holding ``masses[s]`` in all (alpha 1), random within."""
    rng = np.random.default_rng(seed)
    out = []
    for s, m in enumerate(masses):
        b = fastper.PrioritizedReplayBuffer(n, FIELDS, alpha=1.0, eps=0.0, seed=s)
        p = rng.random(n) + 0.5
        b.add(rows(np.arange(n) + 1000.0 * s, s), priorities=p * (m / p.sum()))
        out.append(Shard(b))
    return out


def make(masses: list[float], *, channel: bool = False, **kw) -> ShardedReplayBuffer:
    t: object = LocalTransport(shards_with_mass(masses), loader=Shard.load)
    if channel:
        t = local_channels(t)
    return ShardedReplayBuffer(t, **kw)  # type: ignore[arg-type]


def shard_priorities(buf: ShardedReplayBuffer, indices: np.ndarray) -> np.ndarray:
    inner = getattr(buf.transport, "inner", buf.transport)
    caps = np.cumsum([0] + [s.buffer.capacity for s in inner.shards])
    owner = np.searchsorted(caps, indices, side="right") - 1
    out = np.empty(len(indices))
    for s, shard in enumerate(inner.shards):
        sel = owner == s
        out[sel] = shard.buffer.priorities(indices[sel] - caps[s])
    return out


# -- exactness -------------------------------------------------------------------------------
@pytest.mark.parametrize("channel", [False, True])
@pytest.mark.parametrize(("depth", "per_call"), [(2, 1), (3, 4), (1, 8)])
def test_pipelined_law_is_exact_without_updates_chi_square_1_10_100(
    channel: bool, depth: int, per_call: int
) -> None:
    buf = make([1.0, 10.0, 100.0], channel=channel, seed=3, depth=depth, batches_per_call=per_call)
    assert buf.pipelined
    counts = np.zeros(3)
    for _ in range(200):
        b = buf.sample(64)
        # with no update in flight every probability is p_i / sum(p): the current law
        p = shard_priorities(buf, b.indices)
        np.testing.assert_allclose(b.probabilities, p / 111.0, rtol=1e-12)
        counts += np.bincount(b.data["tag"], minlength=3)
    expected = counts.sum() * np.array([1.0, 10.0, 100.0]) / 111.0
    assert stats.chisquare(counts, expected).pvalue > 1e-3
    if channel:
        buf.transport.close_channels()


def test_per_shard_sampling_would_fail_the_same_chi_square() -> None:
    """The test above has power: B/K draws per shard (what many libraries do) is refused."""
    counts = np.full(3, 200 * 64 / 3)
    expected = counts.sum() * np.array([1.0, 10.0, 100.0]) / 111.0
    assert stats.chisquare(counts, expected).pvalue < 1e-6


def test_pipelined_probabilities_are_the_ones_the_draw_used_under_churn() -> None:
    """Horvitz-Thompson: mean over draws of 1/P(i) is N exactly when P is the law used.

    Priorities change every step (shard 0's mass swings tenfold), so the
    shares a pipelined draw uses are stale; the probabilities it reports
    must still be the ones used, or the mean of 1/P drifts away from N.
    """
    rng = np.random.default_rng(1)
    buf = make([1.0, 1.0, 1.0], seed=5, depth=2, batches_per_call=2)
    n = len(buf)
    inv, stale = [], []
    for step in range(3000):
        b = buf.sample(16)
        inv.append(np.mean(1.0 / b.probabilities))
        stale.append(b.staleness)
        scale = 10.0 if step % 2 else 0.1
        td = np.where(b.data["tag"] == 0, scale, 1.0) * (rng.random(16) + 0.5)
        buf.update_priorities(b, td)
    inv_a = np.asarray(inv)
    z = (inv_a.mean() - n) / (inv_a.std(ddof=1) / np.sqrt(len(inv_a)))
    assert abs(z) < 4.0, (inv_a.mean(), n)
    assert max(stale) == buf.max_staleness == 7


def test_reporting_current_probabilities_instead_would_fail_that_test() -> None:
    """The churn test has power: P recomputed from the shards after the draw is biased."""
    rng = np.random.default_rng(1)
    buf = make([1.0, 1.0, 1.0], seed=5, depth=2, batches_per_call=2)
    n = len(buf)
    inv = []
    for step in range(3000):
        b = buf.sample(16)
        buf.flush()
        p = shard_priorities(buf, b.indices)
        total = sum(v.total for v in buf.views())
        inv.append(np.mean(total / p))  # the law of the shards' state now, not the draw's
        scale = 10.0 if step % 2 else 0.1
        td = np.where(b.data["tag"] == 0, scale, 1.0) * (rng.random(16) + 0.5)
        buf.update_priorities(b, td)
    inv_a = np.asarray(inv)
    z = (inv_a.mean() - n) / (inv_a.std(ddof=1) / np.sqrt(len(inv_a)))
    assert abs(z) > 6.0


def test_strict_mode_is_unchanged_and_reports_no_staleness() -> None:
    buf = make([1.0, 10.0, 100.0], seed=3)
    assert not buf.pipelined and buf.max_staleness == 0
    for _ in range(20):
        b = buf.sample(32)
        assert b.staleness == 0
        np.testing.assert_allclose(b.probabilities, shard_priorities(buf, b.indices) / sum(
            v.total for v in buf.views()), rtol=1e-12)  # fmt: skip
        buf.update_priorities(b, np.random.default_rng(0).random(32) + 0.1)


def test_pipelined_updates_reach_the_shards_on_the_next_call_and_on_flush() -> None:
    buf = make([1.0, 1.0], seed=0, depth=2, batches_per_call=2)
    b = buf.sample(8)
    sent = buf.update_priorities(b, np.full(8, 7.0))
    assert sent == 8
    buf.flush()
    np.testing.assert_allclose(shard_priorities(buf, np.unique(b.indices)), 7.0)
    b2 = buf.sample(8)
    applied = buf.update_priorities(b2, np.full(8, 3.0), wait=True)
    assert applied == 8
    np.testing.assert_allclose(shard_priorities(buf, np.unique(b2.indices)), 3.0)


def test_pipelined_and_strict_batches_over_the_channel_equal_in_process() -> None:
    for kw in ({}, {"depth": 3, "batches_per_call": 2}):
        a = make([1.0, 3.0, 9.0], seed=11, **kw)
        c = make([1.0, 3.0, 9.0], channel=True, seed=11, **kw)
        rng = np.random.default_rng(2)
        for _ in range(30):
            x, y = a.sample(40), c.sample(40)
            for name in ("indices", "keys", "probabilities", "weights"):
                np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
            np.testing.assert_array_equal(x.data["x"], y.data["x"])
            td = rng.random(40) + 0.1
            a.update_priorities(x, td)
            c.update_priorities(y, td)
        c.transport.close_channels()


def test_a_changed_batch_size_draws_again_from_the_rewound_generator() -> None:
    a = make([1.0, 2.0], seed=4, depth=2, batches_per_call=3)
    b = make([1.0, 2.0], seed=4, depth=2, batches_per_call=3)
    a.sample(8)
    b.sample(8)
    a.sample(16)  # the 8-row batches drawn ahead are dropped and drawn again at 16
    ref = make([1.0, 2.0], seed=4, depth=2, batches_per_call=3)
    ref.sample(8)
    ref._abandon()  # noqa: SLF001 - the same rewind, by hand
    np.testing.assert_array_equal(ref.sample(16).indices, b.sample(16).indices)


def test_a_prefetch_thread_and_the_learner_share_the_buffer() -> None:
    buf = make([1.0, 5.0, 2.0], seed=8, depth=2, batches_per_call=2)
    out: list[fastper.SampleBatch] = []
    errors: list[BaseException] = []

    def prefetch() -> None:
        try:
            for _ in range(150):
                out.append(buf.sample(16))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    th = threading.Thread(target=prefetch)
    th.start()
    done = 0
    rng = np.random.default_rng(0)
    while th.is_alive() or done < len(out):
        if done < len(out):
            buf.update_priorities(out[done], rng.random(16) + 0.1)
            done += 1
    th.join()
    assert not errors and len(out) == 150 and buf.step == 150
    buf.flush()


# -- faults with batches in flight ---------------------------------------------------------------
def test_loss_with_calls_in_flight_raise_changes_nothing() -> None:
    buf = make([1.0, 1.0, 1.0], seed=2, depth=3, batches_per_call=2, on_shard_loss="raise")
    for _ in range(3):
        b = buf.sample(8)
        buf.update_priorities(b, np.ones(8))
    buf.transport.kill(1)
    for _ in range(3 * 2 + 1):  # batches that already arrived are handed out; then it raises
        step, state = buf.step, buf._undrawn_state()  # noqa: SLF001 - the state to come back to
        try:
            buf.sample(8)
        except ShardLostError:
            break
    else:
        pytest.fail("a lost shard was never noticed")
    assert buf.step == step
    assert buf._rng.bit_generator.state == state  # noqa: SLF001
    assert not buf._inflight and not buf._ready  # noqa: SLF001


def test_loss_with_calls_in_flight_continue_drops_the_lost_shards_updates() -> None:
    buf = make([1.0, 1.0, 1.0], seed=2, depth=2, batches_per_call=2, on_shard_loss="continue")
    b = buf.sample(30)
    buf.update_priorities(b, np.full(30, 2.0))  # queued: carried by the next call
    on_1 = int(((b.indices >= 50) & (b.indices < 100)).sum())
    assert on_1 > 0
    before = [s.buffer.priorities(np.arange(50)).copy() for s in buf.transport.shards]
    buf.transport.kill(1)
    seen_loss = False
    for _ in range(20):
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            c = buf.sample(30)
        seen_loss = seen_loss or any(issubclass(w.category, ShardLostWarning) for w in got)
        if seen_loss:  # batches that arrived before the loss are handed out as they are
            assert not ((c.indices >= 50) & (c.indices < 100)).any()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            buf.update_priorities(c, np.full(30, 2.0))
    assert seen_loss
    assert buf.lost_shards == [1]
    assert buf.dropped_updates >= on_1
    # nothing meant for shard 1 landed on another shard: their changed slots are ones they drew
    buf.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        late = buf.update_priorities(b.indices, np.full(30, 9.0), wait=True)
    assert late == 30 - on_1
    assert buf.dropped_updates >= 2 * on_1
    after = [s.buffer.priorities(np.arange(50)) for s in buf.transport.shards]
    assert not np.array_equal(after[0], before[0]) or not np.array_equal(after[2], before[2])


def test_loss_with_calls_in_flight_restore_drops_old_keys(tmp_path) -> None:
    buf = make([1.0, 1.0], seed=2, depth=2, batches_per_call=2, on_shard_loss="restore")
    buf.save(tmp_path / "ckpt")
    b = buf.sample(20)
    buf.transport.kill(0)
    with pytest.warns(ShardLostWarning):
        for _ in range(4 * 2 * 2):  # the batches that arrived first, then the loss
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                c = buf.sample(20)
            for w in got:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            if got:
                break
    assert len(c) == 20
    applied = buf.update_priorities(b, np.full(20, 5.0), wait=True)
    on_0 = int((b.indices < 50).sum())
    assert applied == 20 - on_0 and buf.stale_updates == on_0


# -- the wire format ---------------------------------------------------------------------------
def test_frames_round_trip_numbers_only() -> None:
    arrays = {"a": np.arange(5, dtype=np.int64), "b": np.ones((2, 3), np.float32),
              "e": np.zeros(0), "f": np.array([True, False])}  # fmt: skip
    parts = encode({"x": 1}, arrays)
    head, body = bytes(parts[1]), b"".join(bytes(p) for p in parts[2:])
    meta, out = decode(head, bytearray(body))
    assert meta == {"x": 1}
    for k, v in arrays.items():
        np.testing.assert_array_equal(out[k], v)
        assert out[k].dtype == v.dtype
    with pytest.raises(TypeError, match="numeric"):
        encode({}, {"o": np.array([object()], dtype=object)})


@pytest.mark.parametrize(
    ("head", "body", "why"),
    [
        (b"not json", b"", "unreadable header"),
        (b'{"meta": {}, "arrays": [["a", "|O", [1]]]}', b"\0" * 8, "refused"),
        (b'{"meta": {}, "arrays": [["a", "<f8", [4]]]}', b"\0" * 8, "overrun"),
        (b'{"meta": {}, "arrays": [["a", "<f8", [1]]]}', b"\0" * 9, "no array describes"),
        (b'{"meta": {}, "arrays": [["a", "<f8", [-1]]]}', b"", "refused"),
        (b'{"meta": {}, "arrays": [["a", "V8", [1]]]}', b"\0" * 8, "refused"),
    ],
)
def test_corrupt_frames_are_refused(head: bytes, body: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        decode(head, bytearray(body))


def test_a_wrong_token_gets_no_service_and_errors_come_back_as_themselves() -> None:
    shard = shards_with_mass([1.0])[0]
    token = b"k" * wire.TOKEN_BYTES
    server = wire.ChannelServer({"step": shard.channel_step}, token)
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(b"x" * wire.TOKEN_BYTES)
        assert s.recv(2) == b""  # closed without a word
    with pytest.raises(ConnectionError):
        wire.Channel(0, server.address, b"y" * wire.TOKEN_BYTES, timeout=5)
    ch = wire.Channel(0, server.address, token, timeout=5)
    call = ch.send("step", {"keyed": False, "view_total": 1.0}, {"targets": np.array([5.0])})
    with pytest.raises(ValueError, match="view_total"):
        ch.result(call, None)  # a point beyond the view: the shard's own ValueError
    call = ch.send("nope", {}, {})
    with pytest.raises(ValueError, match="no method"):
        ch.result(call, None)
    ok = ch.send("step", {}, {})
    meta, arrays = ch.result(ok, None)
    assert arrays["counts"][0] == 50
    server.close()
    ch.close()
    with pytest.raises(ShardLostError):
        ch.result(ch.send("step", {}, {}), None)


# -- the compiled fast path of update_priorities hands anything unusual to the full checks ---------
@pytest.mark.parametrize("pipelined", [False, True])
def test_bad_updates_are_refused_by_name_and_send_nothing(pipelined: bool) -> None:
    kw = {"depth": 2, "batches_per_call": 2} if pipelined else {}
    buf = make([1.0, 1.0], seed=1, **kw)
    b = buf.sample(8)
    before = [s.buffer.priorities(np.arange(50)).copy() for s in buf.transport.shards]
    bad = [
        (np.r_[b.indices[:-1], 100], np.ones(8), b.keys, "indices"),  # past the capacity
        (np.r_[b.indices[:-1], -1], np.ones(8), b.keys, "indices"),
        (b.indices, np.r_[np.ones(7), np.nan], b.keys, "td_errors"),
        (b.indices, np.r_[np.ones(7), np.inf], b.keys, "td_errors"),
        (b.indices, np.ones(8), np.r_[b.keys[:-1], 50], "keys"),  # never issued
        (b.indices, np.ones(8), np.r_[b.keys[:-1], -3], "keys"),
        (b.indices, np.ones(7), b.keys, "td_errors"),  # one short
        (b.indices.astype(np.uint64), np.ones(8),
         np.r_[b.keys[:-1].astype(np.uint64), np.uint64(2**63)], "keys"),  # fmt: skip
    ]
    for idx, td, keys, name in bad:
        with pytest.raises((ValueError, IndexError), match=name):
            buf.update_priorities(idx, td, keys)
    buf.flush()
    after = [s.buffer.priorities(np.arange(50)) for s in buf.transport.shards]
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x, y)
    assert buf.update_priorities(b.indices.astype(np.uint32), np.full(8, 2), b.keys, wait=True) == 8


def test_replies_larger_than_the_socket_buffers_with_calls_in_flight_do_not_deadlock() -> None:
    """Several calls in flight, each reply far larger than a socket's buffer: the shard keeps
    reading requests while its replies wait to be read, so neither side waits on the other."""
    buf = make([1.0, 3.0, 9.0], channel=True, seed=2, depth=3, batches_per_call=4)
    done: list[int] = []

    def run() -> None:
        for _ in range(12):
            b = buf.sample(20_000)  # 4 batches a call: ~3 MB a reply
            buf.update_priorities(b, np.ones(20_000))
        done.append(1)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout=120)
    assert done, "the learner and a shard waited on each other"
    buf.transport.close_channels()
