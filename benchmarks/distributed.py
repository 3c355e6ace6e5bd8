"""Sharded replay on Ray beside one process and beside one Ray actor: inserts, learner steps, latency.

Usage:
    python benchmarks/distributed.py                       # about 1-2 min on 2 cores
    python benchmarks/distributed.py --quick               # smoke test: tiny sizes, K = 2 only
    python benchmarks/distributed.py --out benchmarks/results/distributed.md

Workload (the same for every set-up): the CartPole-like rows of ``fastper
bench`` (obs and next_obs of 4 float32, action int64, reward and done float32:
48 bytes a row), ``--capacity`` slots in total (split evenly over K shards),
proportional replay with alpha 0.6, priorities given with every insert.

Set-ups:

* ``local``: one :class:`fastper.PrioritizedReplayBuffer` in this process;
* ``1 actor``: the obvious Ray alternative, one Ray actor holding one
  fastper buffer, reached by ``.remote()`` calls to ``add`` / ``sample`` /
  ``update_priorities`` (:class:`BufferActor`);
* ``K shards``: :class:`fastper.distributed.ShardedReplayBuffer` over K shard
  actors (``ray_shards``), inserts through a :class:`ShardRouter`.

What is timed, each set-up in turn inside every repeat (so a change in the
machine's load hits them alike), medians over the repeats:

* **inserts/s**: rows per second, adding batches of ``--add-batch`` rows from
  this process until the buffer is full; the Ray set-ups keep up to 4 calls in
  flight (the router's default; the actor set-up does the same by hand);
* **learner batches/s**: ``sample(B)`` then ``update_priorities`` of the B
  indices with keys, the update not awaited (the sharded buffer's default;
  the actor set-up fires it with ``.remote()`` and does not wait either);
* **sample round trip**: one ``sample(B)`` alone, median and 90th percentile;
* **no-op round trip**: a call that does nothing (a shard's ``view``; for K
  shards one parallel call to all K: ``refresh()``): the per-call price of Ray.

Before timing, each set-up is checked: the probabilities a sample returns are
``p_i ** alpha / sum_j p_j ** alpha`` over all its shards (read back from the
shard that holds each row).

All actors ask Ray for 0 CPUs; with 2 cores, K = 4 shards plus this process
oversubscribe the machine, and the numbers say what one learner process gets
from K shard processes on the same 2 cores, not what K machines give.
"""

from __future__ import annotations

import argparse
import datetime
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
class Setup:
    """One replay set-up: how to insert, take a learner step, sample, and make a no-op call."""

    name: str
    add: Callable[[dict[str, np.ndarray], np.ndarray], None]
    flush_adds: Callable[[], None]
    step: Callable[[int, np.ndarray], None]
    flush_steps: Callable[[], None]
    sample: Callable[[int], Any]
    noop: Callable[[], None]
    check: Callable[[int], None]
    times: dict[str, list[float]] = field(default_factory=dict)


def local_setup(capacity: int) -> Setup:
    buf = fastper.PrioritizedReplayBuffer(capacity, FIELDS, alpha=ALPHA, seed=0)

    def step(b: int, td: np.ndarray) -> None:
        s = buf.sample(b)
        buf.update_priorities(s.indices, td, keys=s.keys)

    def check(b: int) -> None:
        s = buf.sample(b)
        np.testing.assert_allclose(s.probabilities, buf.probabilities(s.indices), rtol=1e-9)

    def add(rows: dict[str, np.ndarray], p: np.ndarray) -> None:
        buf.add(rows, p)

    return Setup("local (1 process)", add, lambda: None, step, lambda: None, buf.sample,
                 buf.mass_stats, check)  # fmt: skip


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


def actor_setup(ray: Any, capacity: int) -> Setup:
    actor = ray.remote(BufferActor).options(num_cpus=0).remote(capacity, 0)
    adds, updates = InFlight(ray, 4), InFlight(ray, 1 << 30)

    def step(b: int, td: np.ndarray) -> None:
        s = ray.get(actor.sample.remote(b))
        updates.push(actor.update_priorities.remote(s.indices, td, s.keys))  # not awaited

    def check(b: int) -> None:
        s = ray.get(actor.sample.remote(b))
        expected = ray.get(actor.probabilities.remote(s.indices))
        np.testing.assert_allclose(s.probabilities, expected, rtol=1e-9)

    return Setup(
        "1 Ray actor, 1 buffer",
        lambda rows, p: adds.push(actor.add.remote(rows, p)),
        adds.drain,
        step,
        updates.drain,
        lambda b: ray.get(actor.sample.remote(b)),
        lambda: ray.get(actor.noop.remote()),
        check,
    )


def sharded_setup(k: int, capacity: int) -> Setup:
    from fastper.distributed import ShardedReplayBuffer
    from fastper.distributed.ray_backend import ray_shards

    t = ray_shards(k, capacity // k, FIELDS, buffer_kwargs={"alpha": ALPHA},
                   placement="local", num_cpus=0)  # fmt: skip
    buf = ShardedReplayBuffer(t, seed=0)
    router = t.router(placement="key", max_in_flight=4)
    n_adds = [0]

    def add(rows: dict[str, np.ndarray], p: np.ndarray) -> None:
        router.add(rows, key=n_adds[0], priorities=p)  # a key per batch: spread over the shards
        n_adds[0] += 1

    def step(b: int, td: np.ndarray) -> None:
        s = buf.sample(b)
        buf.update_priorities(s.indices, td, s.keys)  # not awaited

    def check(b: int) -> None:
        buf.refresh()
        s = buf.sample(b)
        caps = np.cumsum([0] + [capacity // k] * k)
        shard = np.searchsorted(caps, s.indices, side="right") - 1
        p = np.empty(b)
        for j in range(k):
            sel = np.flatnonzero(shard == j)
            if sel.size:
                p[sel] = t.results([t.submit(j, "priorities", s.indices[sel] - caps[j])])[0]
        total = sum(v.total for v in buf.views())
        np.testing.assert_allclose(s.probabilities, p**ALPHA / total, rtol=1e-9)

    def flush() -> None:
        router.flush()

    return Setup(f"{k} shard{'s' if k > 1 else ''} (ShardedReplayBuffer)", add, flush, step,
                 buf.flush, buf.sample, buf.refresh, check)  # fmt: skip


# -- timing ------------------------------------------------------------------------------
def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: every thread, Ray's own included)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def reply_bytes(batch_size: int) -> tuple[int, int]:
    """Pickled size of a shard's reply to ``sample_mass`` for ``batch_size`` rows, and for 1."""
    import pickle

    buf = fastper.PrioritizedReplayBuffer(1024, FIELDS, alpha=ALPHA, seed=0)
    buf.add(_batch(np.random.default_rng(0), 1024), np.ones(1024))
    sizes = []
    for n in (batch_size, 1):
        reply = buf.sample_mass(np.linspace(0.0, 1023.0, n))
        sizes.append(len(pickle.dumps(reply, protocol=5)))
    return sizes[0], sizes[1]


def run(args: argparse.Namespace) -> tuple[list[Setup], dict[str, Any]]:
    import ray

    if not any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # keeps ~/.ray/auth_token unwritten
    tmp = tempfile.mkdtemp(prefix="fpbench-")
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=tmp, log_to_driver=False, configure_logging=False,
             object_store_memory=200 * 2**20, namespace="fastper-bench")  # fmt: skip
    info: dict[str, Any] = {"load_before": os.getloadavg()}
    t0 = time.perf_counter()
    try:
        setups = [local_setup(args.capacity), actor_setup(ray, args.capacity)]
        setups += [sharded_setup(k, args.capacity) for k in args.shards]
        info["start_s"] = time.perf_counter() - t0
        b, a, r = args.batch_size, args.add_batch, args.repeats
        rng = np.random.default_rng(0)

        # inserts: r timed chunks per set-up, interleaved, that fill every buffer (nearly)
        per_chunk = args.capacity // (a * r)
        for _ in range(r):
            chunk = [(_batch(rng, a), rng.random(a) + 0.1) for _ in range(per_chunk)]
            for s in setups:

                def adds(s: Setup = s, chunk: list = chunk) -> None:
                    for rows, prios in chunk:
                        s.add(rows, prios)
                    s.flush_adds()

                s.times.setdefault("insert", []).append(per_chunk * a / timed(adds))
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
                        s.step(b, td[i])
                    s.flush_steps()

                wall, cpu = cpu_timed(steps)
                s.times.setdefault("learner", []).append(args.steps / wall)
                s.times.setdefault("learner_cpu", []).append(cpu / args.steps)

        # latency of one sample, and of a call that does nothing
        for _ in range(args.calls):
            for s in setups:
                s.times.setdefault("sample", []).append(timed(lambda s=s: s.sample(b)))
                wall, cpu = cpu_timed(s.noop)
                s.times.setdefault("noop", []).append(wall)
                s.times.setdefault("noop_cpu", []).append(cpu)

        # a call to the rate limiter (an async actor): what a limited insert or sample adds
        from fastper.distributed.ray_limiter import rate_limiter

        limiter = rate_limiter(1.0, 1, None)
        ray.get(limiter.stats.remote())
        info["limiter_ms"] = 1e3 * statistics.median(
            timed(lambda: ray.get(limiter.stats.remote())) for _ in range(args.calls)
        )
        info["reply_bytes"] = reply_bytes(b)
        info["total_s"] = time.perf_counter() - t0
        info["load_after"] = os.getloadavg()
        return setups, info
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


# -- report ------------------------------------------------------------------------------
def report(setups: list[Setup], info: dict[str, Any], args: argparse.Namespace, cmd: str) -> str:
    import ray

    med = statistics.median
    base = {k: med(setups[0].times[k]) for k in ("insert", "learner")}
    lines = [
        f"`{cmd}` on {datetime.date.today().isoformat()}: {os.cpu_count()} cores, "
        f"{platform.machine()}, Python {platform.python_version()}, Ray {ray.__version__}, "
        f"numpy {np.__version__}; load average {info['load_before'][0]:.1f} before, "
        f"{info['load_after'][0]:.1f} after (other jobs share this machine). Start-up of the "
        f"Ray set-ups {info['start_s']:.1f} s, whole run {info['total_s']:.1f} s.",
        "",
        f"Capacity {args.capacity} in total per set-up (split evenly over the K shards), "
        f"48-byte CartPole-like rows, proportional (alpha {ALPHA}), B = {args.batch_size}, "
        f"inserts in batches of {args.add_batch} rows with priorities (up to 4 calls in "
        f"flight for Ray); medians over {args.repeats} interleaved repeats "
        f"({args.steps} learner steps each) and {args.calls} single calls for the latencies. "
        "Ratios are against the local buffer in the same run.",
        "",
        "| set-up | inserts, rows/s | vs local | learner steps/s (sample + update) | vs local "
        "| learner CPU, ms/step | sample round trip, ms (median / p90) "
        "| no-op round trip, ms (wall / CPU) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in setups:
        ins, lrn = med(s.times["insert"]), med(s.times["learner"])
        smp = np.array(s.times["sample"]) * 1e3
        noop, noop_cpu = med(s.times["noop"]) * 1e3, med(s.times["noop_cpu"]) * 1e3
        lines.append(
            f"| {s.name} | {ins:,.0f} | {ins / base['insert']:.3f}x | {lrn:,.0f} | "
            f"{lrn / base['learner']:.3f}x | {med(s.times['learner_cpu']) * 1e3:.2f} | "
            f"{np.median(smp):.2f} / {np.percentile(smp, 90):.2f} | {noop:.3f} / {noop_cpu:.3f} |"
        )
    full, one = info["reply_bytes"]
    per_row = (full - one) / (args.batch_size - 1)
    lines += [
        "",
        "Learner CPU: CPU time of this process per learner step (all its threads, Ray's "
        "included), the part of the step that K more machines cannot take off the learner. "
        "No-op: one call that does nothing (for K shards one parallel call to all K, "
        f"`refresh()`). A call to the rate limiter actor: {info['limiter_ms']:.2f} ms. "
        f"A shard's reply to `sample_mass`, pickled: {one} bytes for 1 row, {full} for "
        f"{args.batch_size} ({per_row:.0f} bytes per 48-byte row: the row, index, key, mass).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and K = 2 only (a smoke test)")
    p.add_argument("--capacity", type=int, default=2**16, help="slots per set-up, in total")
    p.add_argument("--batch-size", type=int, default=256, help="learner batch B")
    p.add_argument("--add-batch", type=int, default=64, help="rows per insert call")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="values of K")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats")
    p.add_argument("--steps", type=int, default=100, help="learner steps per repeat")
    p.add_argument("--calls", type=int, default=200, help="single calls timed for the latencies")
    p.add_argument("--out", default="", help="also write the markdown table to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.capacity, args.shards, args.repeats, args.steps, args.calls = 2**11, [2], 2, 5, 5
    if args.capacity < args.add_batch * args.repeats:
        p.error("--capacity must hold at least --add-batch * --repeats rows")
    try:
        import ray  # noqa: F401
    except ImportError:
        print("this benchmark needs Ray: pip install 'fastper[ray]'", file=sys.stderr)
        return 2
    setups, info = run(args)
    cmd = "python benchmarks/distributed.py" + (" " + " ".join(argv) if argv else "")
    if argv is None and len(sys.argv) > 1:
        cmd = "python benchmarks/distributed.py " + " ".join(sys.argv[1:])
    text = report(setups, info, args, cmd)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
