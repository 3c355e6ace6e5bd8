"""Sharded replay on Ray beside one process and one Ray actor: channels, pipelining, a scale model.

Usage:
    python benchmarks/distributed.py                       # 2-4 min on 2 cores
    python benchmarks/distributed.py --quick               # smoke test: tiny sizes, K = 2 only
    python benchmarks/distributed.py --out benchmarks/results/distributed.md

Workload (the same for every set-up): the CartPole-like rows of ``fastper
bench`` (obs and next_obs of 4 float32, action int64, reward and done float32:
48 bytes a row), ``--capacity`` slots in total (split evenly over K shards),
proportional replay with alpha 0.6, priorities given with every insert.

Stores (what the rows are inserted into) and learner set-ups over them:

* ``local``: one :class:`fastper.PrioritizedReplayBuffer` in this process;
* ``1 actor``: the obvious Ray alternative, one Ray actor holding one
  fastper buffer, reached by ``.remote()`` calls (:class:`BufferActor`);
* ``K shards`` for K in ``--shards``: K shard actors (``ray_shards``),
  inserts through a :class:`ShardRouter`, and over the same shards three
  learners (:class:`fastper.distributed.ShardedReplayBuffer`):

  - ``strict, socket``: ``depth=1, batches_per_call=1`` (exact), the per-step
    calls on the direct socket channel (``ray_shards``'s default);
  - ``strict, ray``: the same over plain Ray actor calls (K = 1 and 4 only,
    where in ``--shards``);
  - ``pipelined, socket``: ``depth=--depth``, ``batches_per_call=--per-call``.

What is timed, every set-up in turn inside each repeat (so a change in the
machine's load hits them alike), medians over the repeats: inserts/s (rows a
second, batches of ``--add-batch`` rows, up to 4 calls in flight for Ray);
learner steps/s (``sample(B)`` then ``update_priorities`` of the B indices with
keys, the update not awaited) and the learner's CPU per step (this process,
all its threads, ``time.process_time``); a ``sample(B)`` alone; a call that
does nothing (for K shards ``refresh()``: one parallel call to all K). The
pipelined rows also give the largest ``SampleBatch.staleness`` seen beside the
buffer's ``max_staleness``.

Then a K-way fan-out of one shard ``step`` (B/K priority updates and B/K
points) over plain Ray calls, the socket channel and a Ray compiled graph
(``ray.dag``), on the same shard actors; and the inputs of a scale model for
K = 100 shards, one per machine (see :func:`scale_model`), measured here.

Before timing, each set-up is checked. Strict: the probabilities a sample
returns are ``p_i ** alpha / sum_j p_j ** alpha`` over all its shards (each
``p_i`` read back from its shard). Pipelined: after learner steps that leave
stale draws, ``flush()``, and the batches drawn before it handed out, the
batches drawn since (no update in between) must give the same law exactly.

All actors ask Ray for 0 CPUs: with 2 cores, K shards plus this process
oversubscribe the machine, and the numbers say what one learner process gets
from K shard processes on the same cores, not what K machines give; the
scale model says what K machines would give, from per-call costs.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import fastper
from fastper._bench import FIELDS, _batch  # the CartPole-like workload of `fastper bench`

ALPHA = 0.6


# -- the set-ups -------------------------------------------------------------------------
class BufferActor:
    """What a user would write first: one Ray actor holding one fastper buffer."""

    def __init__(self, capacity: int, seed: int) -> None:
        self.buffer = fastper.PrioritizedReplayBuffer(capacity, FIELDS, alpha=ALPHA, seed=seed)

    def add(self, rows: dict[str, np.ndarray], priorities: np.ndarray) -> np.ndarray:
        return self.buffer.add(rows, priorities)

    def sample(self, batch_size: int) -> fastper.SampleBatch:
        return self.buffer.sample(batch_size)

    def update_priorities(self, indices: np.ndarray, td: np.ndarray, keys: np.ndarray) -> int:
        return self.buffer.update_priorities(indices, td, keys=keys)

    def probabilities(self, indices: np.ndarray) -> np.ndarray:
        return self.buffer.probabilities(indices)

    def noop(self) -> None:
        return None


@dataclass
class Store:
    """Where rows are inserted: one buffer, one actor, or K shards (shared by their learners)."""

    name: str
    add: Callable[[dict[str, np.ndarray], np.ndarray], None]
    flush_adds: Callable[[], None]
    times: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Setup:
    """One learner over a store: a step (returns the batch's staleness), a sample, a no-op, a check."""

    name: str
    step: Callable[[int, np.ndarray], int]
    flush_steps: Callable[[], None]
    sample: Callable[[int], Any]
    noop: Callable[[], None]
    check: Callable[[int], None]
    k: int = 0  # shards (0: not sharded)
    channel: str = ""
    per_call: int = 1
    pipelined: bool = False
    max_staleness: int = 0
    seen_staleness: int = 0
    times: dict[str, list[float]] = field(default_factory=dict)

    @property
    def calls_per_step(self) -> float:
        """Calls to shards per learner step: strict 2K (a sample and an update call per
        shard), pipelined K / M (the updates ride on the next call)."""
        if not self.k:
            return float("nan")
        return self.k / self.per_call if self.pipelined else 2.0 * self.k


def local_setup(capacity: int) -> tuple[Store, list[Setup]]:
    buf = fastper.PrioritizedReplayBuffer(capacity, FIELDS, alpha=ALPHA, seed=0)

    def step(b: int, td: np.ndarray) -> int:
        s = buf.sample(b)
        buf.update_priorities(s.indices, td, keys=s.keys)
        return 0

    def check(b: int) -> None:
        s = buf.sample(b)
        np.testing.assert_allclose(s.probabilities, buf.probabilities(s.indices), rtol=1e-9)

    def add(rows: dict[str, np.ndarray], p: np.ndarray) -> None:
        buf.add(rows, p)

    store = Store("local (1 process)", add, lambda: None)
    return store, [
        Setup("local (1 process)", step, lambda: None, buf.sample, buf.mass_stats, check)
    ]


class InFlight:
    """Ray calls not yet answered, at most ``limit`` (the oldest is waited for first)."""

    def __init__(self, ray: Any, limit: int) -> None:
        self.ray, self.limit, self.refs = ray, limit, []

    def push(self, ref: Any) -> None:
        self.refs.append(ref)
        if len(self.refs) > self.limit:
            self.ray.get(self.refs.pop(0))

    def drain(self) -> None:
        self.ray.get(self.refs)
        self.refs = []


def actor_setup(ray: Any, capacity: int) -> tuple[Store, list[Setup]]:
    actor = ray.remote(BufferActor).options(num_cpus=0).remote(capacity, 0)
    adds, updates = InFlight(ray, 4), InFlight(ray, 1 << 30)

    def step(b: int, td: np.ndarray) -> int:
        s = ray.get(actor.sample.remote(b))
        updates.push(actor.update_priorities.remote(s.indices, td, s.keys))  # not awaited
        return 0

    def check(b: int) -> None:
        s = ray.get(actor.sample.remote(b))
        expected = ray.get(actor.probabilities.remote(s.indices))
        np.testing.assert_allclose(s.probabilities, expected, rtol=1e-9)

    store = Store("1 Ray actor, 1 buffer", lambda rows, p: adds.push(actor.add.remote(rows, p)),
                  adds.drain)  # fmt: skip
    setup = Setup("1 Ray actor, 1 buffer", step, updates.drain,
                  lambda b: ray.get(actor.sample.remote(b)), lambda: ray.get(actor.noop.remote()),
                  check)  # fmt: skip
    return store, [setup]


@dataclass
class Group:
    """K shard actors, their router, and the learners over them."""

    k: int
    transport: Any  # ray_shards' socket-channel transport (``.inner``: the plain Ray one)
    store: Store
    setups: list[Setup]
    strict: Any  # the strict socket learner (its views give the shards' totals)


def sharded_group(k: int, args: argparse.Namespace, with_ray: bool) -> Group:
    from fastper.distributed import ShardedReplayBuffer
    from fastper.distributed.ray_backend import ray_shards

    capacity = args.capacity
    t = ray_shards(k, capacity // k, FIELDS, buffer_kwargs={"alpha": ALPHA},
                   placement="local", num_cpus=0)  # channel="socket", the default  # fmt: skip
    router = t.router(placement="key", max_in_flight=4)
    offsets = np.cumsum([0] + [capacity // k] * k)
    n_adds = [0]

    def add(rows: dict[str, np.ndarray], p: np.ndarray) -> None:
        router.add(rows, key=n_adds[0], priorities=p)  # a key per batch: spread over the shards
        n_adds[0] += 1

    def raw_priorities(indices: np.ndarray) -> np.ndarray:
        """Each row's p_i, read back from the shard that holds it (plain Ray calls)."""
        shard = np.searchsorted(offsets, indices, side="right") - 1
        p = np.empty(indices.shape[0])
        for j in range(k):
            sel = np.flatnonzero(shard == j)
            if sel.size:
                p[sel] = t.inner.results(
                    [t.inner.submit(j, "priorities", indices[sel] - offsets[j])]
                )[0]
        return p

    def exact(buf: Any, b: int) -> None:
        """The next batch's probabilities are p_i^alpha / sum_j p_j^alpha over all shards."""
        s = buf.sample(b)
        total = sum(v.total for v in buf.views())
        np.testing.assert_allclose(s.probabilities, raw_priorities(s.indices) ** ALPHA / total,
                                   rtol=1e-9)  # fmt: skip

    def learner(buf: Any, name: str, channel: str) -> Setup:
        def step(b: int, td: np.ndarray) -> int:
            s = buf.sample(b)
            buf.update_priorities(s.indices, td, s.keys)  # not awaited
            return int(s.staleness)

        def check(b: int) -> None:
            buf.refresh()
            if not buf.pipelined:
                exact(buf, b)
                return
            # leave draws made over views that miss updates, then flush, hand out the
            # batches drawn before the flush: the draws since saw every update
            td = np.random.default_rng(1).random(b) * 2
            for _ in range(2 * buf.depth * buf.batches_per_call):
                step(b, td)
            buf.flush()
            ahead = buf.depth * buf.batches_per_call
            for _ in range(ahead):  # at most this many were drawn before the flush
                buf.sample(b)
            for _ in range(ahead):
                exact(buf, b)
            buf.flush()

        return Setup(name, step, buf.flush, buf.sample, buf.refresh, check, k=k, channel=channel,
                     per_call=buf.batches_per_call, pipelined=buf.pipelined,
                     max_staleness=buf.max_staleness)  # fmt: skip

    shards = f"{k} shard{'s' if k > 1 else ''}"
    strict = ShardedReplayBuffer(t, seed=0)
    setups = [learner(strict, f"{shards}, strict, socket", "socket")]
    if with_ray:
        setups.append(
            learner(ShardedReplayBuffer(t.inner, seed=0), f"{shards}, strict, ray", "ray")
        )
    piped = ShardedReplayBuffer(t, seed=0, depth=args.depth, batches_per_call=args.per_call)
    setups.append(learner(piped, f"{shards}, pipelined D={args.depth} M={args.per_call}, socket",
                          "socket"))  # fmt: skip
    store = Store(f"{shards} (router into ShardedReplayBuffer shards)", add, router.flush)
    return Group(k, t, store, setups, strict)


# -- timing ------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: every thread, Ray's own included)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def cpu3_timed(fn: Callable[[], Any]) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this process, CPU seconds of this thread alone)."""
    t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - h0


# -- a K-way fan-out: Ray calls, the socket channel, a Ray compiled graph ----------------
def fanout(ray: Any, g: Group, args: argparse.Namespace) -> dict[str, Any]:
    """One shard ``step`` (n = B/K keyless updates and n points) sent to all K shards at once.

    Plain Ray calls and the socket channel are timed in turns, before and
    after the compiled graph (which holds the actors while it exists); then
    the same call through a compiled graph (``ray.dag``, one ``step`` node
    per shard actor). While compiled, an ordinary Ray call to a shard is made
    and waited for ``--blocked-wait`` seconds: whether the shard still
    answers its other callers (inserts, saves) while the graph is up.
    """
    t, k, b = g.transport, g.k, args.batch_size
    n = max(1, math.ceil(b / k))
    g.strict.refresh()
    vt = min(v.total for v in g.strict.views())
    rng = np.random.default_rng(2)
    slots, td, targets = (
        np.arange(n, dtype=np.int64),
        rng.random(n) + 0.1,
        np.sort(rng.random(n)) * vt,
    )
    actors = t.inner.actors
    paths: dict[str, Callable[[], Any]] = {
        "Ray actor calls": lambda: ray.get(
            [a.step.remote(slots, td, None, targets, vt) for a in actors]
        ),
        "socket channel": lambda: t.results(
            [t.submit(s, "step", slots, td, None, targets, vt) for s in range(k)]
        ),  # fmt: skip
    }
    out: dict[str, Any] = {"k": k, "n": n, "rows": {}}
    walls: dict[str, list[float]] = {p: [] for p in paths}
    cpus: dict[str, list[float]] = {p: [] for p in paths}

    def plain_rounds(count: int) -> None:
        for _ in range(count):
            for p, fn in paths.items():
                w, c = cpu_timed(fn)
                walls[p].append(w)
                cpus[p].append(c)

    for fn in paths.values():
        fn()
    plain_rounds(args.calls // 2)
    name = "Ray compiled graph"
    try:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            dag = MultiOutputNode(
                [a.step.bind(inp[0], inp[1], None, inp[2], inp[3]) for a in actors]
            )
        t0 = time.perf_counter()
        cdag = dag.experimental_compile()
        out["compile_s"] = time.perf_counter() - t0
        try:

            def run_compiled(timeout: float | None = None) -> None:
                ray.get(cdag.execute(slots, td, targets, vt), timeout=timeout)  # replies dropped
                # at once: a result kept alive holds its channel's buffer, blocking the next call

            t0 = time.perf_counter()
            run_compiled(timeout=120.0)  # the first call sets the graph up: seconds, more than
            out["first_s"] = time.perf_counter() - t0  # Ray's default 10 s wait on 2 busy cores
            run_compiled()
            ws, cs = [], []
            for _ in range(args.calls):
                w, c = cpu_timed(run_compiled)
                ws.append(w)
                cs.append(c)
            walls[name], cpus[name] = ws, cs
            ref = actors[0].view.remote()
            t0 = time.perf_counter()
            try:
                ray.get(ref, timeout=args.blocked_wait)
                out["other_call"] = f"answered in {1e3 * (time.perf_counter() - t0):.1f} ms"
            except ray.exceptions.GetTimeoutError:
                out["other_call"] = f"not answered within {args.blocked_wait:g} s"
        finally:
            cdag.teardown()
        if "not answered" in out.get("other_call", ""):
            t0 = time.perf_counter()
            ray.get(ref, timeout=60)
            out["other_call"] += f" (answered {time.perf_counter() - t0:.2f} s after the teardown)"
    except Exception as exc:  # noqa: BLE001 - reported in the table, the run goes on
        out["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    plain_rounds(args.calls - args.calls // 2)
    for p, ws in walls.items():
        w = np.array(ws) * 1e3
        out["rows"][p] = (float(np.median(w)), float(np.percentile(w, 90)),
                          1e3 * statistics.median(cpus[p]))  # fmt: skip
    return out


# -- scale model inputs: frames and a shard's service time -------------------------------
def frame_bytes(parts: list[Any]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def shard_service(capacity: int, n_updates: int, n_points: int, reps: int) -> dict[str, float]:
    """A shard's side of one channel ``step``, in this process: decode the request frame,
    apply ``n_updates`` keyed priority updates, find ``n_points`` points, encode the reply.

    Returns the request and reply frame sizes (bytes, :func:`fastper.distributed.wire.encode`)
    and the service time (seconds, median and 99th percentile over ``reps`` calls).
    """
    from fastper.distributed.shard import Shard
    from fastper.distributed.wire import decode, encode, step_call

    rng = np.random.default_rng(3)
    buf = fastper.PrioritizedReplayBuffer(capacity, FIELDS, alpha=ALPHA, seed=0)
    for _ in range(capacity // 1024 or 1):
        m = min(1024, capacity)
        buf.add(_batch(rng, m), rng.random(m) + 0.1)
    shard = Shard(buf)
    total = buf.mass_stats()[0]
    found = buf.sample_mass(np.sort(rng.random(max(n_updates, 1))) * total, total)
    slots, keys = (found.indices, found.keys) if n_updates else (None, None)
    td = rng.random(n_updates) + 0.1 if n_updates else None
    targets = np.sort(rng.random(n_points)) * total if n_points else None
    meta, arrays = step_call((slots, td, keys, targets, total))
    req = encode({"seq": 0, "method": "step", "args": meta}, arrays)
    head, body = bytes(req[1]), b"".join(bytes(p) for p in req[2:])

    def serve() -> list[Any]:
        m, a = decode(head, body)
        out_meta, out = shard.channel_step(m["args"], a)
        return encode({"seq": 0, **out_meta}, out)

    reply = serve()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        serve()
        times.append(time.perf_counter() - t0)
    return {"req": frame_bytes(req), "rep": frame_bytes(reply),
            "median": float(np.median(times)), "p99": float(np.percentile(times, 99))}  # fmt: skip


def coordinator_cpu(args: argparse.Namespace, k: int, depth: int, per_call: int) -> float:
    """CPU of this thread per learner step of a ShardedReplayBuffer over K shards in this
    process (``ShardedReplayBuffer.local``: no network, no Ray; the shards' own work included)."""
    from fastper.distributed import ShardedReplayBuffer

    cap = max(args.capacity // k, 64)
    buf = ShardedReplayBuffer.local(k, cap, FIELDS, buffer_kwargs={"alpha": ALPHA}, seed=0,
                                    depth=depth, batches_per_call=per_call)  # fmt: skip
    rng = np.random.default_rng(4)
    for s in range(k):
        buf.add(_batch(rng, cap), shard=s, priorities=rng.random(cap) + 0.1)
    b, n = args.batch_size, max(args.steps, 2 * depth * per_call)
    td = rng.random(b) * 2

    def steps(count: int) -> None:
        for _ in range(count):
            batch = buf.sample(b)
            buf.update_priorities(batch.indices, td, batch.keys)
        buf.flush()

    steps(2 * depth * per_call)
    h0 = time.thread_time()
    steps(n)
    return (time.thread_time() - h0) / n


M_GRID = (1, 2, 4, 8, 16, 32, 64)
D_GRID = (1, 2, 4, 8)


def model_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """Frames and service times at K = ``--model-shards`` for strict mode and each M of the grid."""
    k, b, reps = args.model_shards, args.batch_size, args.service_reps
    n = max(1, math.ceil(b / k))
    out: dict[str, Any] = {
        "strict_update": shard_service(args.capacity, n, 0, reps),
        "strict_sample": shard_service(args.capacity, 0, n, reps),
        "piped": {m: shard_service(args.capacity, max(1, math.ceil(m * b / k)),
                                   max(1, math.ceil(m * b / k)), reps) for m in M_GRID},
        "batch_reply": shard_service(args.capacity, 0, b, reps),  # B rows in one reply
        "coordinator": {
            (kk, d, mm): coordinator_cpu(args, kk, d, mm)
            for kk, d, mm in ((1, 1, 1), (1, args.depth, args.per_call),
                              (k, args.depth, args.per_call))
        },
    }  # fmt: skip
    return out


def scale_model(setups: list[Setup], local_rate: float, inputs: dict[str, Any],
                args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """Predicted learner rate at K = ``--model-shards`` shards, one per machine.

    From this run's measured costs and the stated RTT and link speed; the
    formulas are printed with the table (:func:`model_report`).
    """
    k = args.model_shards
    rtt, link = args.rtt_ms * 1e-3, args.link_gbit * 1e9 / 8  # seconds, bytes/s
    socket = [s for s in setups if s.k and s.channel == "socket"]
    pts = [(s.calls_per_step, statistics.median(s.times["learner_cpu"]), s.pipelined)
           for s in socket]  # fmt: skip
    # least squares: CPU = a_strict [strict] + a_piped [pipelined] + c_call x calls a step
    design = np.array([[not p[2], p[2], p[0]] for p in pts], dtype=np.float64)
    y = np.array([p[1] for p in pts])
    if len(pts) >= 4:
        a_strict, a_piped, c_call = np.linalg.lstsq(design, y, rcond=None)[0]
    else:  # too few rows for an intercept per mode (--quick): one for both
        c_call, a_strict = np.polyfit(design[:, 2], y, 1)
        a_piped = a_strict
    fit_rms = float(np.sqrt(np.mean((design @ [a_strict, a_piped, c_call] - y) ** 2)))
    t_local = 1.0 / local_rate
    res: dict[str, Any] = {"a_strict": float(a_strict), "a_piped": float(a_piped),
                           "a": max(float(a_piped), 0.0), "c_call": float(c_call),
                           "fit_rms": fit_rms, "points": pts, "t_local": t_local, "k": k,
                           "rtt": rtt, "link": link}  # fmt: skip
    a_st = max(float(a_strict), 0.0)
    ray_pts = [(s.calls_per_step, statistics.median(s.times["learner_cpu"]))
               for s in setups if s.k and s.channel == "ray"]  # fmt: skip
    if len({p[0] for p in ray_pts}) > 1:
        rx, ry = np.array([p[0] for p in ray_pts]), np.array([p[1] for p in ray_pts])
        res["c_call_ray"] = float(np.polyfit(rx, ry, 1)[0])
    su, ss = inputs["strict_update"], inputs["strict_sample"]
    a = res["a"]
    cpu = a_st + 2 * k * c_call
    wait = 2 * rtt + su["p99"] + ss["p99"] + k * (su["rep"] + ss["rep"]) / link
    t = cpu + wait
    res["strict"] = {"cpu": cpu, "wait": wait, "rate": 1 / t, "ratio": t_local / t,
                     "in": k * (su["rep"] + ss["rep"]) / t, "out": k * (su["req"] + ss["req"]) / t}  # fmt: skip
    rows = []
    for m in M_GRID:
        f = inputs["piped"][m]
        cpu = a + k * c_call / m
        lat = rtt + f["p99"] + k * f["rep"] / link
        for d in D_GRID:
            t = cpu + max(0.0, lat - (d - 1) * m * cpu) / m
            t = max(t, (k / m) * f["rep"] / link, (k / m) * f["req"] / link)
            rows.append({"m": m, "d": d, "stale": 2 * d * m - 1, "cpu": cpu, "lat": lat, "t": t,
                         "rate": 1 / t, "ratio": t_local / t, "in": (k / m) * f["rep"] / t,
                         "out": (k / m) * f["req"] / t, "hidden": lat <= (d - 1) * m * cpu})  # fmt: skip
    res["piped"] = rows
    return res


def run(args: argparse.Namespace) -> tuple[list[Store], list[Setup], dict[str, Any]]:
    import ray

    if not any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # keeps ~/.ray/auth_token unwritten
    tmp = tempfile.mkdtemp(prefix="fpbench-")
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=tmp, log_to_driver=False, configure_logging=False,
             object_store_memory=200 * 2**20, namespace="fastper-bench")  # fmt: skip
    info: dict[str, Any] = {"load_before": os.getloadavg()}
    t0 = time.perf_counter()
    groups: list[Group] = []
    try:
        stores, setups = [], []
        for store, ss in (local_setup(args.capacity), actor_setup(ray, args.capacity)):
            stores.append(store)
            setups += ss
        for k in args.shards:
            groups.append(sharded_group(k, args, with_ray=k in args.ray_shards))
            stores.append(groups[-1].store)
            setups += groups[-1].setups
        info["start_s"] = time.perf_counter() - t0
        b, a, r = args.batch_size, args.add_batch, args.repeats
        rng = np.random.default_rng(0)

        # inserts: r timed chunks per store, interleaved, that fill every store (nearly)
        per_chunk = args.capacity // (a * r)
        for _ in range(r):
            chunk = [(_batch(rng, a), rng.random(a) + 0.1) for _ in range(per_chunk)]
            for st in stores:

                def adds(st: Store = st, chunk: list = chunk) -> None:
                    for rows, prios in chunk:
                        st.add(rows, prios)
                    st.flush_adds()

                st.times.setdefault("insert", []).append(per_chunk * a / timed(adds))
        for s in setups:
            s.check(b)  # correct probabilities first, then time

        # learner steps: sample B + update B priorities, interleaved repeats
        td = rng.random((args.steps, b)) * 2
        for s in setups:  # warm-up (and the first update's compile in each process)
            for i in range(5):
                s.step(b, td[i])
            s.flush_steps()
        for _ in range(r):
            for s in setups:

                def steps(s: Setup = s) -> None:
                    for i in range(args.steps):
                        s.seen_staleness = max(s.seen_staleness, s.step(b, td[i]))
                    s.flush_steps()

                wall, cpu, own = cpu3_timed(steps)
                s.times.setdefault("learner", []).append(args.steps / wall)
                s.times.setdefault("learner_cpu", []).append(cpu / args.steps)
                s.times.setdefault("learner_thread_cpu", []).append(own / args.steps)

        # latency of one sample, and of a call that does nothing
        for _ in range(args.calls):
            for s in setups:
                s.times.setdefault("sample", []).append(timed(lambda s=s: s.sample(b)))
                wall, cpu = cpu_timed(s.noop)
                s.times.setdefault("noop", []).append(wall)
                s.times.setdefault("noop_cpu", []).append(cpu)
        for s in setups:
            s.flush_steps()

        # a call to the rate limiter (an async actor): what a limited insert or sample adds
        from fastper.distributed.ray_limiter import rate_limiter

        limiter = rate_limiter(1.0, 1, None)
        ray.get(limiter.stats.remote())
        info["limiter_ms"] = 1e3 * statistics.median(
            timed(lambda: ray.get(limiter.stats.remote())) for _ in range(args.calls)
        )
        # the fan-outs last: a compiled graph holds its actors while it exists
        info["fanouts"] = [fanout(ray, g, args) for g in groups if g.k in args.fanout_shards]
        info["model_inputs"] = model_inputs(args)
        info["total_s"] = time.perf_counter() - t0
        info["load_after"] = os.getloadavg()
        return stores, setups, info
    finally:
        for g in groups:
            try:
                g.transport.close()
            except Exception:  # noqa: BLE001 - ray.shutdown below ends them anyway
                pass
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


# -- report ------------------------------------------------------------------------------
def report(stores: list[Store], setups: list[Setup], info: dict[str, Any],
           args: argparse.Namespace, cmd: str) -> str:  # fmt: skip
    import ray

    med = statistics.median
    base_ins, base_lrn = med(stores[0].times["insert"]), med(setups[0].times["learner"])
    lines = [
        f"`{cmd}` on {datetime.date.today().isoformat()}: {os.cpu_count()} cores, "
        f"{platform.machine()}, Python {platform.python_version()}, Ray {ray.__version__}, "
        f"numpy {np.__version__}; load average {info['load_before'][0]:.1f} before, "
        f"{info['load_after'][0]:.1f} after (other jobs share this machine). Start-up of the "
        f"Ray set-ups {info['start_s']:.1f} s, whole run {info['total_s']:.1f} s.",
        "",
        f"Capacity {args.capacity} in total per store (split evenly over the K shards), "
        f"48-byte CartPole-like rows, proportional (alpha {ALPHA}), B = {args.batch_size}; "
        f"medians over {args.repeats} interleaved repeats ({args.steps} learner steps each) "
        f"and {args.calls} single calls for the latencies. Ratios are against the local "
        "buffer in the same run. The learners over K shards share the K shard actors.",
        "",
        "| set-up | learner steps/s (sample + update) | vs local "
        "| learner CPU, ms/step (process / its thread) "
        "| calls a step | sample round trip, ms (median / p90) | no-op round trip, ms (wall / CPU) "
        "| staleness: largest seen / max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in setups:
        lrn = med(s.times["learner"])
        smp = np.array(s.times["sample"]) * 1e3
        noop, noop_cpu = med(s.times["noop"]) * 1e3, med(s.times["noop_cpu"]) * 1e3
        calls = f"{s.calls_per_step:g}" if s.k else "-"
        stale = f"{s.seen_staleness} / {s.max_staleness}" if s.pipelined else "0 (exact)"
        lines.append(
            f"| {s.name} | {lrn:,.0f} | {lrn / base_lrn:.3f}x | "
            f"{med(s.times['learner_cpu']) * 1e3:.2f} / "
            f"{med(s.times['learner_thread_cpu']) * 1e3:.2f} | {calls} | "
            f"{np.median(smp):.2f} / {np.percentile(smp, 90):.2f} | {noop:.3f} / {noop_cpu:.3f} "
            f"| {stale} |"
        )
    lines += [
        "",
        "Learner CPU: CPU time of this process per learner step (all its threads, Ray's "
        "included), the part of the step that more machines cannot take off the learner; "
        "and of the learner's own thread alone (its calls on the socket channel included, "
        "Ray's background threads not). "
        "Calls a step: calls to shards per learner step (strict: a sample and an update call "
        "per shard; pipelined: K per M steps, the updates carried). The pipelined sample round "
        "trip is mostly a hand-out of a batch drawn ahead (median), and a wait for the next "
        "call when none is left (p90). No-op: one call that does nothing (for K shards one "
        f"parallel call to all K, `refresh()`). A call to the rate limiter actor: "
        f"{info['limiter_ms']:.2f} ms.",
        "",
        f"Inserts, rows/s (batches of {args.add_batch} rows with priorities, up to 4 calls in "
        "flight for Ray):",
        "",
        "| store | inserts, rows/s | vs local |",
        "|---|---:|---:|",
    ]
    for st in stores:
        ins = med(st.times["insert"])
        lines.append(f"| {st.name} | {ins:,.0f} | {ins / base_ins:.3f}x |")
    lines += fanout_report(info["fanouts"], args)
    lines += model_report(setups, info["model_inputs"], args)
    return "\n".join(lines) + "\n"


def fanout_report(fanouts: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = [
        "",
        "### Why compiled graphs are not the default",
        "",
        "One K-way fan-out of a shard `step` (B/K keyless priority updates and B/K points, "
        "the same call to every shard), on the shard actors above: plain Ray calls and the "
        "socket channel timed in turns before and after the compiled graph, medians over "
        f"{args.calls} fan-outs each.",
        "",
        "| K | path | fan-out, ms (median / p90) | learner CPU, ms per fan-out | notes |",
        "|---:|---|---:|---:|---|",
    ]
    for f in fanouts:
        for path in ("Ray actor calls", "socket channel", "Ray compiled graph"):
            if path in f["rows"]:
                w, p90, c = f["rows"][path]
                note = ""
                if path == "Ray compiled graph":
                    note = (f"compiled in {f['compile_s']:.2f} s, first call {f['first_s']:.2f} s; "
                            f"meanwhile an ordinary Ray call to a shard: {f.get('other_call', '?')}")  # fmt: skip
                lines.append(f"| {f['k']} | {path} | {w:.2f} / {p90:.2f} | {c:.2f} | {note} |")
            elif path == "Ray compiled graph":
                lines.append(f"| {f['k']} | {path} | - | - | failed: {f.get('error', '?')} |")
    return lines


def model_report(
    setups: list[Setup], inputs: dict[str, Any], args: argparse.Namespace
) -> list[str]:
    local_rate = statistics.median(setups[0].times["learner"])
    m = scale_model(setups, local_rate, inputs, args)
    k, b = m["k"], args.batch_size
    su, ss, full = inputs["strict_update"], inputs["strict_sample"], inputs["batch_reply"]
    n = max(1, math.ceil(b / k))
    pts = ", ".join(f"({x:g}, {1e3 * y:.2f}{', pipelined' if pp else ''})"
                    for x, y, pp in m["points"])  # fmt: skip
    lines = [
        "",
        f"### Scale model: K = {k} shards, one per machine",
        "",
        "Measured in this run:",
        "",
        f"* in-process learner step (the local row): {1e3 * m['t_local']:.3f} ms "
        f"({local_rate:,.0f} steps/s);",
        f"* learner CPU per step = a + c_call x (calls a step), one c_call and an a per mode, "
        f"least squares over the socket rows (calls a step, process CPU ms): {pts}: "
        f"a = {1e3 * m['a_strict']:.3f} ms a step strict, {1e3 * m['a_piped']:.3f} ms "
        f"pipelined, c_call = {1e3 * m['c_call']:.3f} ms a call (rms misfit "
        f"{1e3 * m['fit_rms']:.3f} ms)"
        + (
            f" (plain Ray calls, from the strict ray rows: {1e3 * m['c_call_ray']:.3f} ms a call)"
            if "c_call_ray" in m
            else ""
        )
        + ";",
        f"* channel frames (`fastper.distributed.wire.encode`): a step reply with B = {b} rows "
        f"{full['rep']:,} bytes ({full['rep'] / b:.0f} a row); at K = {k}, strict, per shard "
        f"and step: update call {su['req']:,} bytes out / {su['rep']:,} back, sample call "
        f"({n} points) {ss['req']:,} out / {ss['rep']:,} back;",
        f"* a shard's service time for one channel `step` (decode, apply, search, encode; a "
        f"local `Shard` of {args.capacity:,} slots, median / 99th percentile of "
        f"{args.service_reps} calls): strict update call {1e3 * su['median']:.3f} / "
        f"{1e3 * su['p99']:.3f} ms, strict sample call {1e3 * ss['median']:.3f} / "
        f"{1e3 * ss['p99']:.3f} ms; pipelined, M B / K updates and points: "
        + ", ".join(
            f"M = {mm}: {1e3 * f['median']:.3f} / {1e3 * f['p99']:.3f} ms"
            for mm, f in inputs["piped"].items()
        )
        + ".",
        "* the coordinator with its shards in this process (`ShardedReplayBuffer.local`: no "
        "network, no Ray, the shards' searches included), CPU of its thread a step: "
        + ", ".join(
            f"K = {kk} {'strict' if d * mm == 1 else f'D={d} M={mm}'} {1e3 * v:.3f} ms"
            for (kk, d, mm), v in inputs["coordinator"].items()
        )
        + ".",
        "",
        f"Stated, not measured: network round trip {args.rtt_ms:g} ms (LAN), the learner's link "
        f"{args.link_gbit:g} Gbit/s each way, every shard on its own machine serving as fast "
        "as measured here (its 99th percentile stands for the slowest of the K), the learner's "
        "per-call CPU as measured on this machine, each update call sent to every shard "
        f"(at B = {b} some shards get none: fewer calls).",
        "",
        "The model. Learner CPU a step = a + c_call x (calls a step); the learner's CPU is "
        "serial (the K calls of a fan-out are sent, and their replies read, one after another). "
        "Strict: two fan-outs a step, each waited for: time a step = a + 2K c_call + 2 RTT + "
        "the two calls' slowest service times + the replies' transfer over the learner's link "
        "(no overlap of CPU and waiting assumed). Pipelined: K / M calls a step; a call's "
        "replies are needed (D - 1) M steps after it was sent, so the learner waits "
        "max(0, L - (D - 1) M T_cpu) every M steps, with L = RTT + the slowest service time "
        "(M B / K updates and points) + the K replies' transfer over the link; the link must "
        "also carry the replies (bandwidth bound). For each M the table shows the smallest D "
        "of {1, 2, 4, 8} that hides L (else the fastest).",
        "",
        "| mode | D | M | max staleness | learner CPU, ms/step | waits, ms/step "
        "| steps/s | vs in-process | learner link in / out, MB/s (% of link) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lk = m["link"]
    st = m["strict"]
    lines.append(
        f"| strict | 1 | 1 | 0 | {1e3 * st['cpu']:.2f} | {1e3 * st['wait']:.2f} | "
        f"{st['rate']:,.0f} | {st['ratio']:.3f}x | {st['in'] / 1e6:.1f} / {st['out'] / 1e6:.1f} "
        f"({100 * st['in'] / lk:.1f}%) |"
    )
    by_m: dict[int, dict[str, Any]] = {}
    for r in m["piped"]:  # per M: the smallest D of the grid that hides the latency
        if r["m"] not in by_m or (not by_m[r["m"]]["hidden"] and r["rate"] > by_m[r["m"]]["rate"]):
            by_m[r["m"]] = r
    for r in by_m.values():
        lines.append(
            f"| pipelined | {r['d']} | {r['m']} | {r['stale']} | {1e3 * r['cpu']:.3f} | "
            f"{1e3 * (r['t'] - r['cpu']):.3f} | {r['rate']:,.0f} | {r['ratio']:.3f}x | "
            f"{r['in'] / 1e6:.1f} / {r['out'] / 1e6:.1f} ({100 * r['in'] / lk:.1f}%) |"
        )
    target = [r for r in m["piped"] if r["ratio"] >= 0.5]
    lines.append("")
    if m["a"] < m["t_local"]:
        lines.append(
            f"Learner CPU a step below the in-process step ({1e3 * m['t_local']:.3f} ms) "
            f"needs K c_call / M < {1e3 * (m['t_local'] - m['a']):.3f} ms: "
            f"M >= {math.ceil(k * m['c_call'] / (m['t_local'] - m['a']))}."
        )
    else:
        lines.append(
            f"Learner CPU a step below the in-process step ({1e3 * m['t_local']:.3f} ms): "
            f"no M gets there, the fixed part a alone is {1e3 * m['a']:.3f} ms."
        )
    lines.append("")
    if target:
        best = min(target, key=lambda r: (r["stale"], r["m"]))
        lines.append(
            f"Target (pipelined >= 50% of the in-process rate): reached, with the least "
            f"staleness at D = {best['d']}, M = {best['m']} (max staleness {best['stale']}): "
            f"{best['rate']:,.0f} steps/s, {best['ratio']:.2f}x, the learner's link carrying "
            f"{best['in'] / 1e6:.1f} MB/s in ({100 * best['in'] / lk:.1f}% of "
            f"{args.link_gbit:g} Gbit/s). All (D, M) of the grid that reach it: "
            + ", ".join(f"({r['d']}, {r['m']})" for r in target)
            + "."
        )
    else:
        ceiling = m["t_local"] / m["a"] if m["a"] > 0 else float("inf")
        need = ""
        if m["a"] < 2 * m["t_local"]:
            need = f" (M >= {k * m['c_call'] / (2 * m['t_local'] - m['a']):.0f} would)"
        lines.append(
            f"Target (pipelined >= 50% of the in-process rate): not reached on the grid{need}. "
            f"The learner's fixed CPU per step a = {1e3 * m['a']:.3f} ms against "
            f"{1e3 * m['t_local']:.3f} ms for the whole in-process step caps the ratio at "
            f"{ceiling:.2f}x whatever M and D."
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and K = 2 only (a smoke test)")
    p.add_argument("--capacity", type=int, default=2**16, help="slots per store, in total")
    p.add_argument("--batch-size", type=int, default=256, help="learner batch B")
    p.add_argument("--add-batch", type=int, default=64, help="rows per insert call")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4, 8], help="values of K")
    p.add_argument("--ray-shards", type=int, nargs="*", default=[1, 4],
                   help="values of K also run strict over plain Ray calls")  # fmt: skip
    p.add_argument("--fanout-shards", type=int, nargs="*", default=[1, 4],
                   help="values of K whose fan-out is timed over Ray, socket, compiled graph")  # fmt: skip
    p.add_argument("--depth", type=int, default=2, help="pipelined: calls per shard in flight (D)")
    p.add_argument("--per-call", type=int, default=8, help="pipelined: batches per call (M)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats")
    p.add_argument("--steps", type=int, default=100, help="learner steps per repeat")
    p.add_argument("--calls", type=int, default=100, help="single calls timed for the latencies")
    p.add_argument("--blocked-wait", type=float, default=2.0,
                   help="seconds an ordinary call waits while a compiled graph is up")  # fmt: skip
    p.add_argument("--model-shards", type=int, default=100, help="K of the scale model")
    p.add_argument("--rtt-ms", type=float, default=0.1, help="scale model: network round trip")
    p.add_argument("--link-gbit", type=float, default=10.0, help="scale model: learner's link")
    p.add_argument("--service-reps", type=int, default=300, help="scale model: shard calls timed")
    p.add_argument("--out", default="", help="also write the markdown tables to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.capacity, args.shards, args.repeats, args.steps, args.calls = 2**11, [2], 2, 5, 5
        args.ray_shards, args.fanout_shards, args.service_reps = [2], [2], 20
    if args.capacity < args.add_batch * args.repeats:
        p.error("--capacity must hold at least --add-batch * --repeats rows")
    if args.depth < 1 or args.per_call < 1 or args.depth * args.per_call < 2:
        p.error("--depth and --per-call must be >= 1, and not both 1 (that is strict mode)")
    if any(k < 1 or args.capacity // k < 1 for k in args.shards) or args.model_shards < 1:
        p.error("every K must be >= 1 and at most --capacity")
    try:
        import ray  # noqa: F401
    except ImportError:
        print("this benchmark needs Ray: pip install 'fastper[ray]'", file=sys.stderr)
        return 2
    stores, setups, info = run(args)
    cmd = "python benchmarks/distributed.py" + (" " + " ".join(argv) if argv else "")
    if argv is None and len(sys.argv) > 1:
        cmd = "python benchmarks/distributed.py " + " ".join(sys.argv[1:])
    text = report(stores, setups, info, args, cmd)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
