"""Every blocking call of the Ray back end ends by its timeout, and a known error is raised
at once even while another call hangs. One local cluster for the module.

The shards here are threaded test actors whose calls can be made to hang (until the
test releases them, so no actor stays busy after a test): :meth:`Gated.stick` holds
every data call, :meth:`Gated.release` lets them go.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from fastper.distributed import ShardLostError, ShardLostWarning, rendezvous  # noqa: E402
from fastper.distributed.ray_backend import (  # noqa: E402
    RayTransport,
    ShardHost,
    _await_start,
)
from fastper.distributed.ray_common import LIMITER_GRACE, call_limiter  # noqa: E402
from fastper.limiter import RateLimitTimeout  # noqa: E402

pytestmark = pytest.mark.ray

FIELDS = {"x": ((), np.float64)}
N = 3
HANG = 60.0  # what a held call would wait, were it never released: far above every bound
SLACK = 5.0  # generous: a loaded 2-core machine


class Gated:
    """A shard actor for these tests: a :class:`ShardHost` inside, whose calls can be held.

    A threaded actor (``max_concurrency`` > 1): ``stick``/``release`` run while
    other calls wait. Held: ``describe``, ``add``, ``node_id``, ``hang`` and the
    limiter's ``await_insert`` / ``admit_insert`` / ``settle_insert`` (the actor
    stands in for a stuck rate limiter too).
    """

    def __init__(self) -> None:
        self.host = ShardHost()
        self.go = threading.Event()
        self.go.set()

    def stick(self) -> None:
        self.go.clear()

    def release(self) -> None:
        self.go.set()

    def _gate(self) -> None:
        self.go.wait(HANG)

    def build(self, capacity: int, fields: Any) -> dict:
        return self.host.build(capacity, fields)

    def describe(self) -> dict:
        self._gate()
        return self.host.describe()

    def add(self, transition: Any, env_ids: Any = None) -> Any:
        self._gate()
        return self.host.add(transition, env_ids)

    def node_id(self) -> str:
        self._gate()
        return self.host.node_id()

    def hang(self) -> str:
        self._gate()
        return "late"

    def ping(self) -> str:
        return "pong"

    def fail(self, text: str) -> None:
        raise ValueError(text)

    def await_insert(self, rows: int, timeout: float | None = None, *args: Any) -> float:
        self._gate()
        return 0.0

    admit_insert = await_insert

    def settle_insert(self, landed: int, failed: int = 0, *args: Any) -> None:
        self._gate()


@pytest.fixture(scope="module")
def actors(ray_cluster) -> Iterator[list]:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import tests
    out = [ray.remote(Gated).options(num_cpus=0, max_concurrency=16).remote() for _ in range(N)]
    ray.get([a.build.remote(64, FIELDS) for a in out])
    ray.get([a.add.remote({"x": np.zeros(1)}) for a in out])  # compiled before any timing
    yield out
    for a in out:
        ray.kill(a)


@pytest.fixture
def gated(actors) -> Iterator[list]:
    """The actors, every one released again after the test (whatever it held)."""
    yield actors
    ray.get([a.release.remote() for a in actors])


def stick(actor) -> None:
    ray.get(actor.stick.remote())  # done before the calls it should hold are sent


def transport(actors, **kw) -> RayTransport:
    return RayTransport(actors, nodes=[None] * len(actors), **kw)


def elapsed(t0: float) -> float:
    return time.monotonic() - t0


# -- RayTransport.results -------------------------------------------------------------------
def test_a_known_error_is_raised_at_once_while_another_call_hangs_without_timeout(gated) -> None:
    t = transport(
        gated
    )  # timeout=None: wait for ever, but not for a hung call once an error is known
    assert t.timeout is None
    stick(gated[0])
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="shard 1 refuses"):
        t.results([t.submit(0, "hang"), t.submit(1, "fail", "shard 1 refuses")])
    assert elapsed(t0) < SLACK
    # both errors known before the call: the first in call order is raised, the hung call ignored
    fails = [t.submit(1, "fail", "first"), t.submit(2, "fail", "second")]
    ray.wait([c.ref for c in fails], num_returns=2, timeout=30)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="first"):
        t.results([t.submit(0, "hang"), *fails])
    assert elapsed(t0) < SLACK
    # released, the held call answers: it was only held
    ref = t.submit(0, "hang")
    ray.get(gated[0].release.remote())
    assert t.results([ref, t.submit(1, "ping")]) == ["late", "pong"]


def test_a_hung_call_is_lost_by_the_timeout_one_deadline_for_the_whole_call(gated) -> None:
    t = transport(gated, timeout=1.0)
    assert t.results([t.submit(2, "ping"), t.submit(1, "ping")]) == ["pong", "pong"]
    stick(gated[0])
    stick(gated[1])
    t0 = time.monotonic()
    with pytest.raises(
        ShardLostError, match=r"shard 0 is lost: no reply within timeout=1 s"
    ) as info:
        t.results([t.submit(2, "ping"), t.submit(0, "hang"), t.submit(1, "hang")])
    took = elapsed(t0)
    assert 0.9 <= took < 1.0 + SLACK, took  # one deadline, not one per call
    assert info.value.shard == 0
    assert "shards [0, 1] did not answer" in str(info.value)
    assert "transport.kill(0)" in str(info.value)  # what to do
    # a per-call timeout overrides the transport's
    t0 = time.monotonic()
    with pytest.raises(ShardLostError, match="no reply within timeout=0.3 s"):
        t.results([t.submit(1, "hang")], timeout=0.3)
    assert 0.25 <= elapsed(t0) < 0.3 + SLACK
    with pytest.raises(ValueError, match="`timeout` must be >= 0"):
        t.results([t.submit(2, "ping")], timeout=-1)


def test_node_questions_end_by_their_timeout_and_keep_the_old_answer(gated) -> None:
    t = transport(gated)
    stick(gated[1])
    t0 = time.monotonic()
    with pytest.raises(ShardLostError, match="shard 1 is lost: no reply within timeout=0.5 s"):
        t.refresh_nodes(timeout=0.5)
    assert elapsed(t0) < 0.5 + SLACK
    assert t.nodes == [None] * N  # unchanged
    ray.get(gated[1].release.remote())
    here = ray.get_runtime_context().get_node_id()
    assert t.refresh_nodes(timeout=30) == [here] * N


def test_start_errors_come_at_once_and_a_start_ends_by_its_timeout(gated) -> None:
    t = transport(gated)
    stick(gated[0])
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="bad setting"):  # not held until start_timeout
        _await_start(t, [t.submit(0, "hang"), t.submit(1, "fail", "bad setting")], {}, 30.0)
    assert elapsed(t0) < SLACK
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"1 of 2 shard actors \(shards \[0\]\) were not up "
                                           r"within start_timeout=0.5 s"):  # fmt: skip
        _await_start(t, [t.submit(0, "hang"), t.submit(1, "ping")], {"num_cpus": 0}, 0.5)
    assert elapsed(t0) < 0.5 + SLACK


def test_a_restart_that_cannot_be_scheduled_ends_by_its_start_timeout(ray_cluster) -> None:
    never = {"num_cpus": 0, "resources": {"fastper_test_absent": 1.0}}  # no node has it
    cls = ray.remote(ShardHost)
    t = RayTransport([cls.options(**never).remote()], nodes=[None], actor_options=never)
    t0 = time.monotonic()
    with pytest.raises(ShardLostError, match=r"shard 0 is lost: its new actor was not up in "
                                             r"time: .*start_timeout=1 s") as info:  # fmt: skip
        t.restart(0, "/nonexistent/shard-0.fpk", start_timeout=1.0)
    assert elapsed(t0) < 1.0 + SLACK
    assert "fastper_test_absent=1" in str(info.value)  # what it asks for, against what there is
    t0 = time.monotonic()
    with pytest.raises(ShardLostError, match="shard 0 is lost"):  # it was killed, not left pending
        t.results([t.submit(0, "describe")], timeout=30)
    assert elapsed(t0) < 30
    with pytest.raises(ValueError, match="`start_timeout` must be > 0"):
        t.restart(0, "x.fpk", start_timeout=0)


# -- routers and the limiter ----------------------------------------------------------------------
def test_router_is_made_from_the_first_shard_that_answers_within_the_timeout(gated) -> None:
    t = transport(gated)
    stick(gated[0])
    t0 = time.monotonic()
    r = t.router(placement="key")  # shard 0 is held: shard 1 or 2 answers
    assert elapsed(t0) < SLACK
    assert r.timeout is None and r.n_shards == N
    for a in gated[1:]:
        stick(a)
    t.timeout = 0.5
    t0 = time.monotonic()
    with pytest.raises(ShardLostError, match=r"no shard answered within timeout=0.5 s \(shards "
                                             r"\[0, 1, 2\] silent"):  # fmt: skip
        t.router()
    assert elapsed(t0) < 0.5 + SLACK


def key_on(shard: int) -> str:
    """A key that rendezvous hashing sends to ``shard`` (of N)."""
    return next(k for k in (f"k{i}" for i in range(1000)) if rendezvous(k, list(range(N))) == shard)


def test_router_add_and_flush_end_by_the_timeout_and_treat_the_silent_shard_as_lost(gated) -> None:
    t = transport(gated, timeout=1.0)
    r = t.router(placement="key", max_in_flight=2)
    assert r.timeout == 1.0  # the transport's
    k0, k1 = key_on(0), key_on(1)
    assert r.add({"x": np.arange(4.0)}, key=k1) == 1
    assert r.flush() == 4
    stick(gated[0])
    r.add({"x": np.arange(3.0)}, key=k0)
    r.add({"x": np.arange(2.0)}, key=k0)
    t0 = time.monotonic()
    with pytest.warns(
        ShardLostWarning, match="shard 0 did not answer an insert within timeout=1 s"
    ):
        s = r.add({"x": np.arange(5.0)}, key=k0)  # two in flight: waits for the oldest, in vain
    assert elapsed(t0) < 1.0 + SLACK
    assert s != 0 and r.lost_shards == [0] and r.dropped == 5  # both held batches
    assert r.flush() == 9
    # flush: one deadline for all in flight
    r2 = t.router(placement="key", timeout=0.5, max_in_flight=8)
    for _ in range(3):
        r2.add({"x": np.arange(2.0)}, key=k0)
    assert r2.add({"x": np.arange(1.0)}, key=k1) == 1
    t0 = time.monotonic()
    with pytest.warns(ShardLostWarning, match="shard 0 did not answer"):
        assert r2.flush() == 1
    assert elapsed(t0) < 0.5 + SLACK
    assert r2.lost_shards == [0] and r2.dropped == 6 and r2.in_flight == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing more is lost
        assert r2.add({"x": np.arange(1.0)}, key=k0) != 0


def test_limiter_calls_end_by_their_timeout_and_name_the_limiter(gated) -> None:
    stuck = gated[2]
    stick(stuck)
    t0 = time.monotonic()
    with pytest.raises(RateLimitTimeout, match=r"the rate limiter actor did not answer "
                                               r"await_insert\(8 rows\) within 0.5 s"):  # fmt: skip
        call_limiter(stuck.await_insert.remote(8, 0.5), 0.5, what="await_insert(8 rows)")
    assert 0.45 <= elapsed(t0) < 0.5 + SLACK
    assert call_limiter(gated[1].ping.remote(), 5.0) == "pong"
    with pytest.raises(ValueError, match="said no"):  # its errors as themselves
        call_limiter(gated[1].fail.remote("said no"), 5.0)
    # a router whose limiter does not answer: the insert ends by limiter_timeout + the grace
    t = transport(gated[:2])
    r = t.router(placement="key", limiter=stuck, limiter_timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(RateLimitTimeout, match=r"did not answer \w+_insert\(3 rows\) within 1.2 s"):
        r.add({"x": np.arange(3.0)}, key="a")
    assert elapsed(t0) < 0.2 + LIMITER_GRACE + SLACK
    assert r.in_flight == 0  # nothing was sent
