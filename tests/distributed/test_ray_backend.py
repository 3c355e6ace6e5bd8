"""Sharded replay on Ray actors: exact sampling, stale keys, shard losses, checkpoints,
router placement and the cross-process rate limiter. One local cluster for the module.

Starting a Ray worker process costs seconds on a small machine, so the tests
share a pool of shard actors and set each one's contents by loading a fastper
checkpoint made in this process (``ShardHost.reload``); a test that kills a
shard leaves it to the pool to start a new one when it is next needed.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
stats = pytest.importorskip("scipy.stats")

import fastper  # noqa: E402
from fastper.distributed import (  # noqa: E402
    ShardedReplayBuffer,
    ShardLostError,
    ShardLostWarning,
    rendezvous,
)
from fastper.distributed.ray_backend import (  # noqa: E402
    RayTransport,
    load_on_ray,
    ray_shards,
    socket_channels,
)
from fastper.distributed.ray_limiter import RateLimitedSharded, rate_limiter  # noqa: E402
from fastper.limiter import RateLimitTimeout  # noqa: E402

pytestmark = pytest.mark.ray

FIELDS = {"x": ((), np.float64), "tag": ((), np.int64)}
POOL = 4


def rows(values, tag) -> dict[str, np.ndarray]:
    v = np.asarray(values, dtype=np.float64)
    return {"x": v, "tag": np.broadcast_to(np.asarray(tag, dtype=np.int64), v.shape).copy()}


def prioritized(n: int, prios=None, tag: int = 0, start: float = 0.0, **kw):
    """A full local buffer of ``n`` items (alpha = 1, eps = 0 unless given)."""
    b = fastper.PrioritizedReplayBuffer(n, FIELDS, **{"alpha": 1.0, "eps": 0.0, **kw})
    b.add(rows(np.arange(start, start + n), tag), priorities=prios)
    return b


class Pool:
    """Shard actors shared by the tests; ``shards(buffers)`` loads them with the buffers' contents."""

    def __init__(self, t: RayTransport, directory: Path) -> None:
        self.actors, self.nodes, self.dir, self.n_files = t.actors, t.nodes, directory, 0
        self.options = {"num_cpus": 0}

    def shards(self, buffers, **kw) -> RayTransport:
        whole = RayTransport(self.actors, nodes=self.nodes, actor_options=self.options)
        for s, b in enumerate(buffers):
            self.n_files += 1
            path = str(self.dir / f"in-{self.n_files}.fpk")
            b.save(path)
            try:
                whole.results([whole.submit(s, "reload", path)])
            except ShardLostError:  # killed by an earlier test: a new actor
                whole.restart(s, path)
        self.actors, self.nodes = whole.actors, whole.nodes
        n = len(buffers)
        return RayTransport(self.actors[:n], nodes=self.nodes[:n], actor_options=self.options, **kw)

    def adopt(self, t: RayTransport) -> None:
        """Take the actors of ``t`` (restarted ones) back into the pool."""
        self.actors[: t.n_shards] = t.actors
        self.nodes[: t.n_shards] = t.nodes


@pytest.fixture(scope="module")
def pool(ray_cluster, tmp_path_factory) -> Pool:
    t = ray_shards(POOL, 8, FIELDS, num_cpus=0, placement="local")
    return Pool(t, tmp_path_factory.mktemp("pool"))


def mass_draws(t: RayTransport, shard: int, n: int, rng) -> np.ndarray:
    """``n`` draws inside one shard by its own mass (the shard's half of a sample)."""
    view = t.results([t.submit(shard, "view")])[0]
    r = t.results([t.submit(shard, "sample_mass", rng.random(n) * view.total, view.total)])[0]
    return np.asarray(r.indices)


# -- exact global sampling -----------------------------------------------------------------
def test_chi_square_over_shard_masses_1_10_100_and_per_shard_sampling_fails(pool) -> None:
    prios = [np.array([0.1, 0.2, 0.3, 0.4]), np.array([1.0, 2.0, 3.0, 4.0]),
             np.array([10.0, 20.0, 30.0, 40.0])]  # fmt: skip
    t = pool.shards([prioritized(4, p, tag=s) for s, p in enumerate(prios)])
    sharded = ShardedReplayBuffer(t, seed=5)
    expected = np.concatenate(prios) / sum(p.sum() for p in prios)
    counts = np.zeros(12)
    draws = 0
    for _ in range(4):
        b = sharded.sample(250_000)
        g = b.indices  # capacity 4 per shard: global indices 0..11, in shard order
        np.testing.assert_array_equal(b.data["tag"], g // 4)
        np.testing.assert_allclose(b.probabilities, expected[g], rtol=1e-12)
        counts += np.bincount(g, minlength=12)
        draws += b.indices.shape[0]
    assert draws >= 10**6
    assert stats.chisquare(counts, expected * draws).pvalue > 1e-3
    # negative control through the same Ray shards: a shard uniformly, then a draw inside it
    rng = np.random.default_rng(1)
    per_shard = rng.multinomial(draws, [1 / 3] * 3)
    naive = np.zeros(12)
    for s in range(3):
        naive[4 * s : 4 * s + 4] += np.bincount(
            mass_draws(t, s, int(per_shard[s]), rng), minlength=4
        )
    assert naive.sum() == draws
    assert stats.chisquare(naive, expected * draws).pvalue < 1e-12


@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
def test_integer_priorities_give_the_single_buffers_draws_and_weights(pool, norm: str) -> None:
    rng = np.random.default_rng(0)
    sizes = (37, 5, 120, 64)
    prios = [rng.integers(1, 50, size=n).astype(float) for n in sizes]
    starts = np.cumsum([0, *sizes])
    shards = [prioritized(n, p, tag=s, start=starts[s], seed=s) for s, (n, p) in enumerate(zip(sizes, prios, strict=True))]  # fmt: skip
    single = fastper.PrioritizedReplayBuffer(
        sum(sizes), FIELDS, alpha=1.0, eps=0.0, seed=7, weight_norm=norm
    )
    for s, p in enumerate(prios):
        single.add(rows(np.arange(starts[s], starts[s + 1]), s), priorities=p)
    t = pool.shards(shards)
    sharded = ShardedReplayBuffer(t, seed=7, beta=0.7, weight_norm=norm)
    for _ in range(40):
        a, b = sharded.sample(64), single.sample(64, beta=0.7)
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.data["x"], b.data["x"])
        np.testing.assert_allclose(a.probabilities, b.probabilities, rtol=1e-12)
        np.testing.assert_allclose(a.weights, b.weights, rtol=1e-12)
        td = rng.integers(1, 60, size=64).astype(float)  # integer priorities stay integer
        sharded.update_priorities(a.indices, td, a.keys)  # async: applied before the next sample
        single.update_priorities(b.indices, td, keys=b.keys)
    sharded.flush()


def test_stale_updates_are_dropped_after_the_shard_overwrote_the_slot(pool) -> None:
    t = pool.shards([prioritized(4, tag=0, eps=1e-6), prioritized(4, tag=1, eps=1e-6)])
    s = ShardedReplayBuffer(t, seed=0)
    b = s.sample(16)
    s.add(rows(np.arange(4.0, 8.0), 0), shard=0)  # shard 0 wraps: its slots hold new items
    applied = s.update_priorities(b.indices, np.full(16, 50.0), b.keys, wait=True)
    on_1 = int((b.indices >= 4).sum())
    assert applied == on_1
    p0 = t.results([t.submit(0, "priorities", np.arange(4))])[0]
    np.testing.assert_allclose(p0, 1.0)  # the new items kept their own priority
    assert t.results([t.submit(0, "stale_updates")])[0] == 16 - on_1


def test_shard_errors_come_back_as_themselves_and_timeouts_as_lost(pool, tmp_path) -> None:
    t = pool.shards([prioritized(8, np.ones(8))])
    with pytest.raises(ValueError, match="`targets` must be >= 0"):
        t.results([t.submit(0, "sample_mass", np.array([-1.0]), 8.0)])
    (tmp_path / "junk.fpk").write_bytes(b"not a checkpoint")
    with pytest.raises(fastper.CheckpointError):
        t.results([t.submit(0, "reload", str(tmp_path / "junk.fpk"))])
    t.timeout = 0.001  # a search over 2 * 10^6 points takes longer than 1 ms
    with pytest.raises(ShardLostError, match="shard 0 is lost: no reply within"):
        t.results([t.submit(0, "sample_mass", np.linspace(0, 8, 2_000_000), 8.0)])
    t.timeout = None
    assert t.results([t.submit(0, "view")])[0].size == 8  # it was only slow


# -- checkpoints ------------------------------------------------------------------------------
def test_save_and_load_on_ray_continue_with_the_same_draws(pool, tmp_path) -> None:
    t = pool.shards(
        [fastper.PrioritizedReplayBuffer(64, FIELDS, alpha=0.6, seed=s) for s in range(2)]
    )
    s = ShardedReplayBuffer(t, seed=11)
    rng = np.random.default_rng(0)
    for i in range(40):
        s.add(rows(rng.random(3), i), key=i)
    b = s.sample(32)
    s.update_priorities(b.indices, rng.random(32) * 5, b.keys, wait=True)
    s.save(tmp_path)
    assert fastper.read_metadata(tmp_path / "shard-1.fpk")["state"]["kind"] == "proportional"
    back = load_on_ray(tmp_path, num_cpus=0, placement="local", seed=999)
    local = ShardedReplayBuffer.load_local(tmp_path)
    try:
        for _ in range(5):
            x, y, z = s.sample(32), back.sample(32), local.sample(32)
            np.testing.assert_array_equal(x.indices, y.indices)
            np.testing.assert_array_equal(x.indices, z.indices)
            np.testing.assert_array_equal(x.weights, y.weights)
            np.testing.assert_array_equal(x.data["x"], y.data["x"])
    finally:
        back._t.close()  # noqa: SLF001 - the test's own actors, not the pool's


# -- actors: router and rate limiter -------------------------------------------------------------
class Producer:
    """An env actor stand-in: inserts batches through the router it is handed."""

    def whoami(self) -> str:
        import ray as _ray

        return _ray.get_runtime_context().get_actor_id()

    def run(self, router, tag: int, n_batches: int, k: int, key=None) -> dict:
        import numpy as _np

        shards = set()
        for j in range(n_batches):
            x = _np.arange(j * k, (j + 1) * k, dtype=_np.float64)
            shards.add(router.add({"x": x, "tag": _np.full(k, tag)}, key=key))
        inserted = router.flush()
        return {"inserted": inserted, "shards": sorted(shards), "dropped": router.dropped}


@pytest.fixture(scope="module")
def producers(ray_cluster) -> list:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import tests
    actors = [ray.remote(Producer).options(num_cpus=0).remote() for _ in range(2)]
    ray.get([a.whoami.remote() for a in actors])
    return actors


def test_router_places_a_key_on_one_shard_and_actors_on_their_local_shard(pool, producers) -> None:
    # room for both producers' 320 rows even when their actor ids pick the same shard
    t = pool.shards([fastper.PrioritizedReplayBuffer(512, FIELDS, seed=s) for s in range(POOL)])
    by_key = t.router(placement="key")
    assert len({by_key.shard_for("actor-7") for _ in range(5)}) == 1
    keys = [f"k{i}" for i in range(400)]
    assert [by_key.shard_for(k) for k in keys] == [rendezvous(k, list(range(POOL))) for k in keys]
    local = t.router(placement="local", max_in_flight=2)
    ids = ray.get([p.whoami.remote() for p in producers])
    out = ray.get([p.run.remote(local, i, 20, 8) for i, p in enumerate(producers)])
    s = ShardedReplayBuffer(t, seed=0, weight_norm="none")
    s.refresh()
    assert len(s) == 2 * 20 * 8, s.views()
    b = s.sample(4000)
    for i, (actor_id, o) in enumerate(zip(ids, out, strict=True)):
        # every shard is on this node: the tie is broken by the actor's own id
        expected = {"inserted": 160, "shards": [rendezvous(actor_id, list(range(POOL)))]}
        assert o == {**expected, "dropped": 0}, (i, actor_id, o)
        mine = b.indices[b.data["tag"] == i]
        assert set((mine // 512).tolist()) == set(o["shards"])
    # a key given per insert wins over the actor's own
    out = ray.get(producers[0].run.remote(by_key, 5, 3, 4, key="episode-3"))
    assert out["shards"] == [rendezvous("episode-3", list(range(POOL)))]


def test_rate_limiter_holds_the_ratio_across_actors_and_the_learner(pool, producers) -> None:
    spi, min_size, err = 2.0, 64, 96.0
    t = pool.shards([fastper.PrioritizedReplayBuffer(512, FIELDS, seed=s) for s in range(2)])
    limiter = rate_limiter(spi, min_size, err, capacity=1024)
    lo, hi = min_size * spi - err, min_size * spi + err
    # up to 16 batches in flight per actor: more rows than the range allows, so the
    # routers must report landed rows while they wait, or actors and learner deadlock
    router = t.router(placement="key", limiter=limiter, limiter_timeout=30.0, max_in_flight=16)
    s = ShardedReplayBuffer(t, seed=0)
    rb = RateLimitedSharded(s, limiter, timeout=0.2)
    t0 = time.monotonic()
    runs = [p.run.remote(router, i, 40, 8, f"actor-{i}") for i, p in enumerate(producers)]
    while rb.stats()["insert_waits"] == 0:  # the actors run ahead until the limiter holds them
        assert time.monotonic() - t0 < 30, "the actors were never held back"
        time.sleep(0.01)
    st = rb.stats()
    assert spi * (st["inserts"] + st["pending"]) <= hi  # admitted: at most what the range allows
    sampled, checked = 0, 0
    while True:
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        if len(done) == len(runs):
            break
        assert time.monotonic() - t0 < 40, "actors and learner did not finish in time"
        try:
            rb.sample(32)
        except RateLimitTimeout:
            continue  # the actors are behind (or done): look again
        sampled += 32
        s.refresh()  # what the shards really hold now, against what was sampled
        actual = sum(v.added for v in s.views())
        assert lo <= spi * actual - sampled <= hi, (actual, sampled)
        checked += 1
    out = ray.get(runs)
    elapsed = time.monotonic() - t0
    st = rb.stats()
    assert [o["inserted"] for o in out] == [320, 320] and st["inserts"] == 640
    assert st["samples"] == sampled and lo <= st["diff"] <= hi
    assert st["pending"] == 0 and st["insert_waits"] > 0
    assert checked >= 10 and elapsed < 40
    # the learner alone drains the allowance, then waits (and gives up after its timeout)
    with pytest.raises(RateLimitTimeout, match="sample waited 0.05 s .* the actors must insert"):
        for _ in range(int((hi - lo) // 32) + 2):
            rb.sample(32, timeout=0.05)
    st = rb.stats()
    assert st["samples"] >= sampled and st["sample_waits"] > 0 and lo <= st["diff"] <= hi
    with pytest.raises(ValueError, match="can never pass this rate limiter"):
        rb.sample(int(hi - lo) + 1)  # wider than the range: refused at once
    ray.kill(limiter)


# -- shard losses --------------------------------------------------------------------------
def prioritized_cap(n: int, capacity: int, tag: int) -> fastper.PrioritizedReplayBuffer:
    b = fastper.PrioritizedReplayBuffer(capacity, FIELDS, alpha=1.0, seed=tag)
    b.add(rows(np.arange(float(n)), tag))
    return b


def test_loss_policy_raise_changes_nothing_and_a_restart_brings_it_back(pool, tmp_path) -> None:
    t = pool.shards([prioritized_cap(10, 50, s) for s in range(3)])
    s = ShardedReplayBuffer(t, on_shard_loss="raise", seed=3)
    s.sample(8)
    s.save(tmp_path)
    state, views = s._rng.bit_generator.state, s.views()  # noqa: SLF001
    kill_and_wait(t.actors[1])
    with pytest.raises(ShardLostError, match="shard 1 is lost"):
        s.sample(64)
    assert s._rng.bit_generator.state == state and s.step == 1  # noqa: SLF001
    assert s.lost_shards == [] and s.views() == views
    t.restart(1, str(tmp_path / "shard-1.fpk"))  # by hand, from the saved set
    pool.adopt(t)
    b = s.sample(600)
    assert set((b.indices // 50).tolist()) == {0, 1, 2}


def kill_and_wait(actor) -> None:
    """``ray.kill`` and wait until the actor is gone: the kill is asynchronous, and a
    call sent right after it can still be answered."""
    ray.kill(actor)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        try:
            ray.get(actor.view.remote(), timeout=5.0)
        except Exception:  # noqa: BLE001 - any failure: the actor no longer answers
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers after 30 s")


def test_loss_policy_restore_reloads_the_last_checkpoint(pool, tmp_path) -> None:
    t = pool.shards([prioritized_cap(10, 50, s) for s in range(3)])
    s = ShardedReplayBuffer(t, on_shard_loss="restore", seed=3)
    s.save(tmp_path)
    s.add(rows(np.arange(5.0), 1), shard=1)  # not in the checkpoint
    old = t.actors[1]
    kill_and_wait(old)
    with pytest.warns(ShardLostWarning, match="shard 1 was lost and restored"):
        b = s.sample(600)
    pool.adopt(t)
    assert t.actors[1] != old and t.nodes[1] == ray.get_runtime_context().get_node_id()
    assert s.views()[1].size == 10  # the 5 added after the checkpoint are gone
    assert set((b.indices // 50).tolist()) == {0, 1, 2}
    np.testing.assert_allclose(b.probabilities, 1.0 / 30)


def test_loss_policy_continue_samples_exactly_over_the_survivors(pool) -> None:
    t = pool.shards([prioritized_cap(10, 50, s) for s in range(3)])
    s = ShardedReplayBuffer(t, on_shard_loss="continue", seed=3)
    kill_and_wait(t.actors[1])
    with pytest.warns(ShardLostWarning, match="shard 1 was lost"):
        b = s.sample(3000)
    assert s.lost_shards == [1] and len(s) == 20
    assert set((b.indices // 50).tolist()) == {0, 2}
    np.testing.assert_allclose(b.probabilities, 1.0 / 20.0)
    assert int(s.add(rows([5.0], 9), key="somebody")[0] // 50) in (0, 2)
    assert s.update_priorities(b.indices[:4], np.ones(4), b.keys[:4], wait=True) == 4


# -- the socket channel and pipelined sampling on Ray ---------------------------------------------
def test_pipelined_over_sockets_chi_square_1_10_100_and_same_draws_as_ray_calls(pool) -> None:
    prios = [np.array([0.1, 0.2, 0.3, 0.4]), np.array([1.0, 2.0, 3.0, 4.0]),
             np.array([10.0, 20.0, 30.0, 40.0])]  # fmt: skip
    t = pool.shards([prioritized(4, p, tag=s) for s, p in enumerate(prios)])
    sock = socket_channels(t)
    try:
        fast = ShardedReplayBuffer(sock, seed=5, depth=3, batches_per_call=4)
        slow = ShardedReplayBuffer(t, seed=5, depth=3, batches_per_call=4)
        expected = np.concatenate(prios) / sum(p.sum() for p in prios)
        counts = np.zeros(12)
        for i in range(40):
            b = fast.sample(5000)
            np.testing.assert_allclose(b.probabilities, expected[b.indices], rtol=1e-12)
            counts += np.bincount(b.indices, minlength=12)
            if i < 3:  # the same draws through Ray's own calls
                c = slow.sample(5000)
                np.testing.assert_array_equal(b.indices, c.indices)
                np.testing.assert_array_equal(b.weights, c.weights)
        assert stats.chisquare(counts, expected * counts.sum()).pvalue > 1e-3
    finally:
        sock.close_channels()


def test_a_shard_killed_with_batches_in_flight_over_sockets(pool) -> None:
    t = pool.shards([prioritized_cap(10, 50, s) for s in range(3)])
    sock = socket_channels(t)
    try:
        s = ShardedReplayBuffer(sock, on_shard_loss="continue", seed=3, depth=2,
                                batches_per_call=2)  # fmt: skip
        b = s.sample(300)
        s.update_priorities(b, np.full(300, 2.0))  # queued for the next call
        kill_and_wait(t.actors[1])
        seen = False
        for _ in range(8):
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                c = s.sample(300)
            seen = seen or any(issubclass(w.category, ShardLostWarning) for w in got)
            if seen:
                assert set((c.indices // 50).tolist()) == {0, 2}
                np.testing.assert_allclose(c.probabilities, 1.0 / 20.0)
        assert seen and s.lost_shards == [1]
        assert s.dropped_updates >= int((b.indices // 50 == 1).sum())
    finally:
        sock.close_channels()
