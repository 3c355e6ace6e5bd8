"""Blind Cliffwalk (Schaul et al. 2016, Sec. 3.1, Figs. 1-2, App. B.1) on fastper's buffers.

A chain of ``n`` states with two actions each. In state ``s`` the *right*
action (``s % 2``: it alternates, so nothing generalises) moves to ``s + 1``
with reward 0, or, in the last state, ends the episode with reward 1; the
*wrong* action ends the episode with reward 0. The memory holds every one of
the ``2^n`` action sequences run to termination, in random order:
``2^(n+1) - 2`` transitions, exactly one of which is rewarded. Learning is
replay only: tabular Q-learning, one transition per update, step size
``eta = 1/4``, ``gamma = 1 - 1/n``, ``theta ~ N(0, 0.1)`` (0.1 read as the
standard deviation). The measure is the
number of updates until the mean squared error between the Q table and the
true Q-values (over all ``2n`` state-action pairs) falls below ``1e-3``.

Replay schemes (``run(..., scheme=...)``):

* ``uniform``: :class:`fastper.ReplayBuffer`.
* ``proportional``: :class:`fastper.PrioritizedReplayBuffer`, P(i) ~ p_i^alpha.
* ``rank``: :class:`fastper.RankBasedReplayBuffer`, exact ranks and exact
  draws (the paper's ``k`` equal-probability segments with ``k = 1`` would be
  uniform).
* ``greedy``: always the largest stored |delta| (ties: lowest slot); a numpy
  argmax over the priorities, not a fastper buffer.
* ``oracle``: the transition whose update lowers the global loss the most, in
  hindsight (every candidate update evaluated, vectorised).

Prioritized schemes follow the paper's protocol: every transition enters
with the largest priority seen so far (1.0), so each is replayed before its
|delta| is known; after a replay ``p_i = |delta_i| + eps``; priorities of the
other copies are not refreshed (``init="td"`` starts from the initial
|delta| instead). IS weights are off by default (``beta = 0``): in a
deterministic, tabular problem every sampling distribution with full
support has the same fixed point Q*, so there is no bias to correct.

Command line (``python -m fastper.agents.cliffwalk --help``)::

    python -m fastper.agents.cliffwalk --n 4 5 6 --runs 10 --out results/cliffwalk

writes ``results.csv``, ``summary.md`` and ``blind_cliffwalk.png`` (tables
and plot in :mod:`fastper.agents._cliffwalk_report`; matplotlib is imported
only for the plot). Imports only numpy and fastper. Results, commands and
findings: ``docs/results/blind_cliffwalk/README.md``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import fastper

# the settings shared with the report live there, so that it needs nothing from here
from ._cliffwalk_report import DEFAULT_ALPHA, SCHEMES, THRESHOLD

__all__ = [
    "ETA",
    "SCHEMES",
    "THRESHOLD",
    "BlindCliffwalk",
    "Memory",
    "RunResult",
    "TabularQ",
    "default_max_updates",
    "gamma_for",
    "main",
    "make_memory",
    "oracle_choice",
    "run",
    "true_q",
]

#: step size of the Q-learning update (paper: 1/4)
ETA = 0.25
#: standard deviation of the initial Q-values (paper: N(0, 0.1))
INIT_STD = 0.1

_FIELDS = {
    "obs": ((), np.int64),
    "action": ((), np.int64),
    "reward": ((), np.float64),
    "next_obs": ((), np.int64),
    "terminated": ((), np.bool_),
}


# -- environment -------------------------------------------------------------------


def gamma_for(n: int) -> float:
    """The paper's discount for a chain of ``n`` states: ``1 - 1/n``."""
    return 1.0 - 1.0 / n


def right_action(s: int) -> int:
    """The action that moves on from state ``s``; it alternates: ``s % 2``."""
    return s % 2


def true_q(n: int, gamma: float | None = None) -> np.ndarray:
    """True action values, shape ``(n, 2)``: ``gamma^(n-1-s)`` for the right action, 0 else.

    Args:
        n: number of states (>= 1).
        gamma: discount; by default :func:`gamma_for` ``(n)``.
    """
    g = gamma_for(n) if gamma is None else gamma
    q = np.zeros((n, 2))
    s = np.arange(n)
    q[s, s % 2] = g ** (n - 1 - s)
    return q


class BlindCliffwalk:
    """The environment: ``reset() -> 0``, ``step(a) -> (next_state, reward, terminated)``.

    Terminal transitions lead to the absorbing state ``n`` (value 0).
    """

    def __init__(self, n: int) -> None:
        if not isinstance(n, int | np.integer) or isinstance(n, bool) or n < 1:
            raise ValueError(f"`n` must be an integer >= 1, got n={n!r}")
        self.n = int(n)
        self.state = 0

    def reset(self) -> int:
        self.state = 0
        return 0

    def step(self, action: int) -> tuple[int, float, bool]:
        s = self.state
        if s >= self.n:
            raise RuntimeError("step() after the episode ended; call reset()")
        if action not in (0, 1):
            raise ValueError(f"`action` must be 0 or 1, got action={action!r}")
        if action != right_action(s):
            self.state = self.n
            return self.n, 0.0, True
        self.state = s + 1
        if s + 1 == self.n:
            return self.n, 1.0, True
        return s + 1, 0.0, False


@dataclass(frozen=True)
class Memory:
    """The fixed replay memory: one row per transition, in insertion order.

    Attributes:
        n: number of states.
        obs, action, reward, next_obs, terminated: one array each, length
            ``2^(n+1) - 2``; ``next_obs == n`` for terminal transitions.
        sequences: the action sequences (``n`` bits, bit ``t`` = action at step
            ``t``) in the order they were run.
    """

    n: int
    obs: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    next_obs: np.ndarray
    terminated: np.ndarray
    sequences: np.ndarray

    def __len__(self) -> int:
        return int(self.obs.shape[0])

    def columns(self) -> dict[str, np.ndarray]:
        """The transitions as a ``{field: array}`` batch for ``buffer.add``."""
        return {
            "obs": self.obs,
            "action": self.action,
            "reward": self.reward,
            "next_obs": self.next_obs,
            "terminated": self.terminated,
        }


def make_memory(n: int, rng: np.random.Generator | int | None = None) -> Memory:
    """Run all ``2^n`` action sequences to termination, in random order. O(2^n n).

    Args:
        n: number of states, 1..24.
        rng: a generator or a seed for the order of the sequences.

    Returns:
        A :class:`Memory` of ``2^(n+1) - 2`` transitions.
    """
    if not isinstance(n, int | np.integer) or isinstance(n, bool) or not 1 <= n <= 24:
        raise ValueError(f"`n` must be an integer in [1, 24], got n={n!r}")
    n = int(n)
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    seqs = gen.permutation(1 << n).astype(np.int64)
    # Vectorised episodes: bit t of a sequence is the action at step t. The
    # episode reaches step t iff its first t actions were right, so it has
    # length min(first wrong step + 1, n).
    steps = np.arange(n)
    acts = (seqs[:, None] >> steps[None, :]) & 1  # (2^n, n)
    wrong = acts != (steps % 2)[None, :]
    first_wrong = np.where(wrong.any(axis=1), wrong.argmax(axis=1), n)
    length = np.minimum(first_wrong + 1, n)
    taken = steps[None, :] < length[:, None]  # row-major: episodes in order, steps in order
    obs = np.broadcast_to(steps, acts.shape)[taken]
    action = acts[taken]
    right = ~wrong[taken]
    nxt = np.where(right & (obs + 1 < n), obs + 1, n)
    reward = (right & (obs == n - 1)).astype(np.float64)
    terminated = nxt == n
    return Memory(n, obs.astype(np.int64), action.astype(np.int64), reward, nxt, terminated, seqs)


# -- learner ---------------------------------------------------------------------


class TabularQ:
    """Tabular (one-hot) Q-learning with a running squared error to the true Q-values.

    ``q`` is a flat list of ``2(n+1)`` floats, entry ``2s + a``; the two
    entries of the absorbing state ``n`` stay 0. The squared error ``sse``
    is kept up to date incrementally (one entry changes per update); the
    runs recompute it exactly when it comes near the threshold and every
    2^16 updates.
    """

    def __init__(self, n: int, rng: np.random.Generator, gamma: float | None = None) -> None:
        self.n = n
        self.gamma = gamma_for(n) if gamma is None else float(gamma)
        theta = rng.normal(0.0, INIT_STD, size=2 * n)
        self.q: list[float] = [float(x) for x in theta] + [0.0, 0.0]
        self.qstar: list[float] = [float(x) for x in true_q(n, self.gamma).reshape(-1)] + [0.0, 0.0]
        self.sse = self.exact_sse()

    def exact_sse(self) -> float:
        """Sum of squared errors to the true Q-values, exactly rounded. O(n)."""
        return math.fsum((a - b) ** 2 for a, b in zip(self.q, self.qstar, strict=True))

    def mse(self) -> float:
        """Mean squared error over the ``2n`` state-action pairs. O(n)."""
        return self.exact_sse() / (2 * self.n)

    def table(self) -> np.ndarray:
        """The Q table as an ``(n, 2)`` array."""
        return np.asarray(self.q[: 2 * self.n]).reshape(self.n, 2)

    def update(self, s: int, a: int, r: float, s2: int, terminated: bool, lr: float = ETA) -> float:
        """One Q-learning step on one transition; returns its TD error (before the step)."""
        q = self.q
        i = 2 * s + a
        boot = 0.0 if terminated else self.gamma * max(q[2 * s2], q[2 * s2 + 1])
        old = q[i]
        delta = r + boot - old
        new = old + lr * delta
        q[i] = new
        t = self.qstar[i]
        self.sse += (new - t) ** 2 - (old - t) ** 2
        return delta


def oracle_choice(
    q: np.ndarray,
    qstar: np.ndarray,
    obs: np.ndarray,
    action: np.ndarray,
    reward: np.ndarray,
    next_obs: np.ndarray,
    terminated: np.ndarray,
    gamma: float,
    eta: float = ETA,
) -> tuple[int, np.ndarray]:
    """The candidate whose update lowers the squared error to ``qstar`` the most. O(C).

    Args:
        q, qstar: flat Q tables, entry ``2s + a`` (``2(n+1)`` entries, the
            last two the absorbing state).
        obs, action, reward, next_obs, terminated: the candidate transitions.
        gamma, eta: discount and step size.

    Returns:
        ``(index of the best candidate (the first on ties), change of the
        squared error for every candidate)``.
    """
    i = 2 * obs + action
    boot = np.where(terminated, 0.0, gamma * np.maximum(q[2 * next_obs], q[2 * next_obs + 1]))
    old = q[i]
    new = old + eta * (reward + boot - old)
    change = (new - qstar[i]) ** 2 - (old - qstar[i]) ** 2
    return int(np.argmin(change)), change


# -- runs ------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    """One run. ``updates`` is the count at which the MSE first fell below the
    threshold, or ``max_updates`` with ``censored=True`` if it never did."""

    n: int
    scheme: str
    alpha: float
    beta: float
    init: str
    seed: int
    memory_size: int
    updates: int
    censored: bool
    final_mse: float
    seconds: float


def default_max_updates(n: int) -> int:
    """A budget far above what uniform replay needs: ``200 * (2^(n+1) - 2) + 10^5``."""
    return 200 * ((1 << (n + 1)) - 2) + 100_000


def _streams(n: int, seed: int) -> tuple[np.random.Generator, np.random.Generator, int]:
    """Memory order, initial Q-values and the buffer's seed: the same for every
    scheme at a given ``(n, seed)``, so schemes are compared on paired runs."""
    mem_ss, init_ss, buf_ss = np.random.SeedSequence([seed, n]).spawn(3)
    return (
        np.random.default_rng(mem_ss),
        np.random.default_rng(init_ss),
        int(buf_ss.generate_state(1, dtype=np.uint32)[0]),
    )


def run(
    n: int,
    scheme: str,
    seed: int,
    max_updates: int | None = None,
    *,
    alpha: float | None = None,
    beta: float = 0.0,
    eps: float = 1e-6,
    init: str = "max",
    threshold: float = THRESHOLD,
) -> RunResult:
    """Replay until the Q error falls below ``threshold``.

    Args:
        n: number of states (memory of ``2^(n+1) - 2`` transitions).
        scheme: one of :data:`SCHEMES`.
        seed: seeds the memory order, the initial Q-values and the buffer
            (the first two do not depend on ``scheme``).
        max_updates: budget; by default :func:`default_max_updates`.
        alpha: priority exponent (proportional, rank); default
            :data:`DEFAULT_ALPHA`.
        beta: IS exponent; 0 (default) applies no correction, otherwise the
            step size is ``eta * w_i``.
        eps: added to |delta| for the priorities.
        init: initial priorities of the prioritized schemes: ``"max"`` (the
            paper's rule for new transitions: all 1.0, the largest so far) or
            ``"td"`` (``|delta| + eps`` under the initial Q-values, as if
            every transition's TD error were known up front).
        threshold: MSE to reach.

    Returns:
        A :class:`RunResult`.

    Cost: per update one ``sample(1)`` and one ``update_priorities`` (O(log N)
    proportional, O(N) rank with exact ranks, O(N) greedy, O(n) oracle);
    uniform draws are taken from the buffer in chunks (i.i.d., the same
    distribution as one at a time).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"`scheme` must be one of {list(SCHEMES)}, got scheme={scheme!r}")
    budget = default_max_updates(n) if max_updates is None else int(max_updates)
    if budget < 0:
        raise ValueError(f"`max_updates` must be >= 0, got max_updates={max_updates!r}")
    if init not in ("max", "td"):
        raise ValueError(f"`init` must be 'max' or 'td', got init={init!r}")
    a = DEFAULT_ALPHA[scheme] if alpha is None else float(alpha)
    mem_rng, init_rng, buf_seed = _streams(n, seed)
    memory = make_memory(n, mem_rng)
    learner = TabularQ(n, init_rng)
    t0 = time.perf_counter()
    limit = threshold * 2 * n  # on the sum of squared errors
    p0 = _initial_td(learner, memory) + eps if init == "td" else None
    if scheme == "oracle":
        updates = _run_oracle(learner, memory, budget, limit)
    elif scheme == "greedy":
        updates = _run_greedy(learner, memory, budget, limit, eps, p0)
    elif scheme == "uniform":
        buf = fastper.ReplayBuffer(len(memory), _FIELDS, seed=buf_seed, stratified=False)
        buf.add(memory.columns())
        updates = _run_uniform(learner, buf, budget, limit)
    else:
        cls: type[fastper.PrioritizedReplayBuffer] | type[fastper.RankBasedReplayBuffer]
        cls = (
            fastper.PrioritizedReplayBuffer
            if scheme == "proportional"
            else fastper.RankBasedReplayBuffer
        )
        pbuf = cls(len(memory), _FIELDS, alpha=a, beta=beta, eps=eps, seed=buf_seed)
        pbuf.add(memory.columns(), priorities=p0)
        updates = _run_prioritized(learner, pbuf, budget, limit, beta > 0.0)
    seconds = time.perf_counter() - t0
    censored = updates < 0
    return RunResult(
        n=n,
        scheme=scheme,
        alpha=a,
        beta=float(beta),
        init=init,
        seed=int(seed),
        memory_size=len(memory),
        updates=budget if censored else updates,
        censored=censored,
        final_mse=learner.mse(),
        seconds=seconds,
    )


# The running squared error drifts from the exact one by a few ulps per update
# (values are <= 1): under 1e-10 between resyncs every 2^16 updates. It is
# checked exactly whenever it comes within _SLACK of the limit, so the
# reported count is exactly the first update whose exact error is under it.
_RESYNC = 1 << 16
_SLACK = 1e-8


def _converged(learner: TabularQ, limit: float) -> bool:
    """Called when the running error is near or under ``limit``: check exactly."""
    learner.sse = learner.exact_sse()
    return learner.sse < limit


def _run_uniform(learner: TabularQ, buf: fastper.ReplayBuffer, budget: int, limit: float) -> int:
    near = limit + _SLACK
    if learner.sse < near and _converged(learner, limit):
        return 0
    update = learner.update
    t = 0
    while t < budget:
        k = min(4096, budget - t)
        d = buf.sample(k).data
        rows = zip(
            d["obs"].tolist(), d["action"].tolist(), d["reward"].tolist(),
            d["next_obs"].tolist(), d["terminated"].tolist(), strict=True,
        )  # fmt: skip
        for s, a, r, s2, term in rows:
            update(s, a, r, s2, term)
            t += 1
            if learner.sse < near and _converged(learner, limit):
                return t
        learner.sse = learner.exact_sse()
    return -1


def _run_prioritized(
    learner: TabularQ,
    buf: fastper.PrioritizedReplayBuffer | fastper.RankBasedReplayBuffer,
    budget: int,
    limit: float,
    weighted: bool,
) -> int:
    near = limit + _SLACK
    if learner.sse < near and _converged(learner, limit):
        return 0
    update = learner.update
    sample = buf.sample
    set_priorities = buf.update_priorities
    td = np.empty(1)
    for t in range(1, budget + 1):
        b = sample(1)
        d = b.data
        lr = ETA * float(b.weights[0]) if weighted else ETA
        td[0] = update(
            int(d["obs"][0]), int(d["action"][0]), float(d["reward"][0]),
            int(d["next_obs"][0]), bool(d["terminated"][0]), lr,
        )  # fmt: skip
        set_priorities(b.indices, td, keys=b.keys)
        if learner.sse < near and _converged(learner, limit):
            return t
        if t % _RESYNC == 0:
            learner.sse = learner.exact_sse()
    return -1


def _initial_td(learner: TabularQ, memory: Memory) -> np.ndarray:
    """|delta| of every memory row under the current Q-values. O(N)."""
    q = np.asarray(learner.q)
    nxt = memory.next_obs
    boot = np.where(memory.terminated, 0.0, learner.gamma * np.maximum(q[2 * nxt], q[2 * nxt + 1]))
    return np.abs(memory.reward + boot - q[2 * memory.obs + memory.action])


def _run_greedy(
    learner: TabularQ,
    memory: Memory,
    budget: int,
    limit: float,
    eps: float,
    p0: np.ndarray | None = None,
) -> int:
    near = limit + _SLACK
    if learner.sse < near and _converged(learner, limit):
        return 0
    # new transitions: the largest priority so far, 1.0 (or the given ones)
    prio = np.ones(len(memory)) if p0 is None else p0.copy()
    cols = memory.columns().values()
    rows = list(zip(*(c.tolist() for c in cols), strict=True))
    update = learner.update
    argmax = prio.argmax
    for t in range(1, budget + 1):
        i = int(argmax())
        prio[i] = abs(update(*rows[i])) + eps
        if learner.sse < near and _converged(learner, limit):
            return t
        if t % _RESYNC == 0:
            learner.sse = learner.exact_sse()
    return -1


def _run_oracle(learner: TabularQ, memory: Memory, budget: int, limit: float) -> int:
    near = limit + _SLACK
    if learner.sse < near and _converged(learner, limit):
        return 0
    # Copies of one transition give identical updates: the distinct ones are
    # the candidates (every state-action pair occurs in the memory).
    keys = np.unique(2 * memory.obs + memory.action, return_index=True)[1]
    obs, act, rew = memory.obs[keys], memory.action[keys], memory.reward[keys]
    nxt, term = memory.next_obs[keys], memory.terminated[keys]
    q = np.asarray(learner.q)
    qstar = np.asarray(learner.qstar)
    for t in range(1, budget + 1):
        j, _ = oracle_choice(q, qstar, obs, act, rew, nxt, term, learner.gamma)
        learner.update(int(obs[j]), int(act[j]), float(rew[j]), int(nxt[j]), bool(term[j]))
        q[:] = learner.q
        if learner.sse < near and _converged(learner, limit):
            return t
    return -1


# -- command line ------------------------------------------------------------------


def _parse_scheme(spec: str) -> tuple[str, float | None]:
    """``"rank"`` or ``"rank:0.5"`` -> (scheme, alpha or None)."""
    name, _, a = spec.partition(":")
    if name not in SCHEMES:
        raise argparse.ArgumentTypeError(f"unknown scheme {name!r}; choose from {list(SCHEMES)}")
    if not a:
        return name, None
    try:
        alpha = float(a)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad alpha in {spec!r}") from exc
    if not alpha >= 0.0:
        raise argparse.ArgumentTypeError(f"alpha must be >= 0 in {spec!r}")
    return name, alpha


_Job = tuple[int, str, float | None, int, int, int | None, float, float, str]


_WARM: set[str] = set()


def _one(job: _Job) -> tuple[int, RunResult]:
    n, scheme, alpha, run_i, seed, budget, beta, eps, init = job
    if scheme not in _WARM:  # load the numba kernels outside the timed runs
        run(2, scheme, 0, 100, alpha=alpha, beta=beta, eps=eps, init=init)
        _WARM.add(scheme)
    return run_i, run(n, scheme, seed, budget, alpha=alpha, beta=beta, eps=eps, init=init)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastper.agents.cliffwalk",
        description="Blind Cliffwalk (Schaul et al. 2016, Fig. 1) on fastper's buffers.",
    )
    p.add_argument("--n", type=int, nargs="+", default=list(range(4, 13)), help="chain lengths")
    p.add_argument("--runs", type=int, default=10, help="runs per (n, scheme)")
    p.add_argument(
        "--schemes",
        type=_parse_scheme,
        nargs="+",
        default=[(s, None) for s in SCHEMES],
        help="schemes, optionally with alpha: uniform rank:0.7 proportional:1 greedy oracle",
    )
    p.add_argument("--beta", type=float, default=0.0, help="IS exponent (0: no correction)")
    p.add_argument("--eps", type=float, default=1e-6, help="priority = |delta| + eps")
    p.add_argument(
        "--init",
        choices=("max", "td"),
        default="max",
        help="initial priorities: max (1.0, the paper's rule) or td (initial |delta| + eps)",
    )
    p.add_argument("--seed", type=int, default=0, help="run r uses seed SEED + r")
    p.add_argument(
        "--max-updates", type=int, default=None, help="budget per run (default 200 N + 1e5)"
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--out", type=Path, default=Path("blind_cliffwalk"), help="output folder")
    p.add_argument("--append", action="store_true", help="add to an existing results.csv")
    p.add_argument(
        "--plot-only", action="store_true", help="redo summary and plot from results.csv"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument("--title", default=None, help="plot / summary title")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the experiment and write results.csv, summary.md and blind_cliffwalk.png."""
    from . import _cliffwalk_report as report

    args = _parser().parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "results.csv"
    if not args.plot_only:
        jobs = [
            (n, scheme, alpha, r, args.seed + r, args.max_updates, args.beta, args.eps, args.init)
            for n in args.n
            for scheme, alpha in args.schemes
            for r in range(args.runs)
        ]
        mode = "a" if args.append and csv_path.exists() else "w"
        with open(csv_path, mode, newline="") as fh:
            writer = csv.writer(fh)
            if mode == "w":
                writer.writerow(report.CSV_COLUMNS)
            results: Iterable[tuple[int, RunResult]]
            if args.jobs > 1:
                import multiprocessing

                pool = multiprocessing.get_context("spawn").Pool(args.jobs)
                results = pool.imap(_one, jobs)
            else:
                pool = None
                results = map(_one, jobs)
            t0 = time.perf_counter()
            for r_i, res in results:
                writer.writerow(
                    [
                        res.n, res.memory_size, res.scheme, f"{res.alpha:g}", f"{res.beta:g}",
                        res.init, r_i, res.seed, res.updates, int(res.censored), f"{res.final_mse:.6g}",
                        f"{res.seconds:.3f}",
                    ]
                )  # fmt: skip
                fh.flush()
                tag = " (censored)" if res.censored else ""
                print(
                    f"n={res.n:2d} {res.scheme:12s} a={res.alpha:g} run {r_i}: "
                    f"{res.updates:,} updates{tag}, {res.seconds:.2f} s "
                    f"[{time.perf_counter() - t0:.0f} s]",
                    flush=True,
                )
            if pool is not None:
                pool.close()
                pool.join()
    rows = report.read_results(csv_path)
    text = report.summary_markdown(rows, args.title or "Blind Cliffwalk")
    (out / "summary.md").write_text(text)
    print(text)
    if not args.no_plot:
        report.plot(rows, out / "blind_cliffwalk.png", args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
