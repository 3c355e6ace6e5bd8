"""Blind Cliffwalk (fastper.agents.cliffwalk): environment, memory, learner, oracle, runs."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from fastper.agents import _cliffwalk_report as report
from fastper.agents import cliffwalk as cw


def _value_iteration(n: int, gamma: float) -> np.ndarray:
    """Q* by value iteration over the environment's own step function."""
    model = {}
    for s in range(n):
        for a in (0, 1):
            env = cw.BlindCliffwalk(n)
            env.state = s
            model[s, a] = env.step(a)
    q = np.zeros((n + 1, 2))
    for _ in range(10 * n):
        new = np.zeros_like(q)
        for (s, a), (s2, r, term) in model.items():
            new[s, a] = r + (0.0 if term else gamma * q[s2].max())
        q = new
    return q[:n]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_true_q_matches_value_iteration_and_formula(n: int) -> None:
    gamma = cw.gamma_for(n)
    assert gamma == pytest.approx(1 - 1 / n)
    q = cw.true_q(n)
    np.testing.assert_allclose(q, _value_iteration(n, gamma), rtol=0, atol=1e-12)
    for s in range(n):
        right = s % 2
        assert q[s, right] == pytest.approx(gamma ** (n - 1 - s))
        assert q[s, 1 - right] == 0.0


def test_environment_steps() -> None:
    env = cw.BlindCliffwalk(3)
    assert env.reset() == 0
    assert env.step(0) == (1, 0.0, False)  # right in state 0 is action 0
    assert env.step(1) == (2, 0.0, False)  # ... and alternates
    assert env.step(0) == (3, 1.0, True)  # right in the last state: reward 1
    env.reset()
    assert env.step(1) == (3, 0.0, True)  # wrong: the episode ends, reward 0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(0)
    with pytest.raises(ValueError, match="`n` must be an integer >= 1, got n=0"):
        cw.BlindCliffwalk(0)


def _episodes(memory: cw.Memory) -> list[tuple[tuple[int, int], ...]]:
    """Split the memory into episodes of (state, action) at terminal transitions."""
    eps, cur = [], []
    for s, a, term in zip(memory.obs, memory.action, memory.terminated, strict=True):
        cur.append((int(s), int(a)))
        if term:
            eps.append(tuple(cur))
            cur = []
    assert not cur
    return eps


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_memory_holds_every_sequence_once(n: int) -> None:
    mem = cw.make_memory(n, 3)
    assert len(mem) == 2 ** (n + 1) - 2
    assert int(mem.reward.sum()) == 1 and np.count_nonzero(mem.reward) == 1
    i = int(np.flatnonzero(mem.reward)[0])
    assert (mem.obs[i], mem.action[i], mem.terminated[i]) == (n - 1, (n - 1) % 2, True)
    assert sorted(mem.sequences.tolist()) == list(range(2**n))
    # Independently: run each sequence, in the memory's order, through the env.
    expected = []
    for seq in mem.sequences.tolist():
        env = cw.BlindCliffwalk(n)
        s, ep, done = env.reset(), [], False
        for t in range(n):
            a = (seq >> t) & 1
            ep.append((s, a))
            s, _, done = env.step(a)
            if done:
                break
        assert done
        expected.append(tuple(ep))
    assert _episodes(mem) == expected
    # transitions agree with the environment
    for s, a, r, s2, term in zip(*mem.columns().values(), strict=True):
        env = cw.BlindCliffwalk(n)
        env.state = int(s)
        assert env.step(int(a)) == (int(s2), float(r), bool(term))


def test_memory_order_is_seeded_and_random() -> None:
    a, b, c = cw.make_memory(6, 1), cw.make_memory(6, 1), cw.make_memory(6, 2)
    np.testing.assert_array_equal(a.sequences, b.sequences)
    assert not np.array_equal(a.sequences, c.sequences)
    # every state s appears 2^(n-s) times, half right, half wrong
    counts = Counter(zip(a.obs.tolist(), a.action.tolist(), strict=True))
    assert all(counts[s, act] == 2 ** (6 - s - 1) for s in range(6) for act in (0, 1))


def test_learner_update_by_hand() -> None:
    n = 4
    learner = cw.TabularQ(n, np.random.default_rng(0))
    learner.q[:] = [0.1, -0.2, 0.3, 0.4, 0.5, -0.6, 0.7, 0.8, 0.0, 0.0]
    learner.sse = learner.exact_sse()
    gamma = 0.75
    # state 1, action 1 (right) -> state 2, reward 0: target gamma * max(0.5, -0.6)
    delta = learner.update(1, 1, 0.0, 2, False)
    assert delta == pytest.approx(gamma * 0.5 - 0.4)
    assert learner.q[3] == pytest.approx(0.4 + 0.25 * (gamma * 0.5 - 0.4))
    # terminal: no bootstrap
    delta = learner.update(3, 1, 1.0, 4, True)
    assert delta == pytest.approx(1.0 - 0.8)
    assert learner.q[7] == pytest.approx(0.8 + 0.25 * 0.2)
    # the running squared error is exact
    assert learner.sse == pytest.approx(learner.exact_sse(), abs=1e-15)
    qstar = cw.true_q(n).reshape(-1)
    want = np.mean((np.asarray(learner.q[:8]) - qstar) ** 2)
    assert learner.mse() == pytest.approx(want)
    assert learner.table().shape == (4, 2)


def test_running_error_stays_exact_over_many_updates() -> None:
    n = 6
    learner = cw.TabularQ(n, np.random.default_rng(1))
    mem = cw.make_memory(n, 1)
    rows = list(zip(*(c.tolist() for c in mem.columns().values()), strict=True))
    rng = np.random.default_rng(2)
    for i in rng.integers(0, len(rows), 20_000):
        learner.update(*rows[i])
    # rounding drift only: far below the slack at which the error is rechecked exactly
    assert abs(learner.sse - learner.exact_sse()) < cw._SLACK / 100


def test_oracle_picks_the_loss_minimising_transition() -> None:
    n = 3
    rng = np.random.default_rng(5)
    mem = cw.make_memory(n, 0)
    keys = np.unique(2 * mem.obs + mem.action, return_index=True)[1]
    cand = [c[keys] for c in mem.columns().values()]
    for _ in range(20):
        learner = cw.TabularQ(n, rng)
        learner.q[:6] = rng.normal(0.0, 0.5, 6).tolist()
        learner.sse = learner.exact_sse()
        q, qstar = np.asarray(learner.q), np.asarray(learner.qstar)
        j, change = cw.oracle_choice(q, qstar, *cand, learner.gamma)
        # brute force: apply each candidate to a copy and measure the loss
        losses = []
        for k in range(len(keys)):
            trial = cw.TabularQ(n, np.random.default_rng(0))
            trial.q = list(learner.q)
            trial.update(*(c[k].item() for c in cand))
            losses.append(trial.exact_sse() - learner.exact_sse())
        np.testing.assert_allclose(change, losses, atol=1e-12)
        assert j == int(np.argmin(losses))


@pytest.mark.parametrize("scheme", cw.SCHEMES)
def test_smoke_runs(scheme: str) -> None:
    capped = cw.run(4, scheme, seed=0, max_updates=5)
    assert capped.censored and capped.updates == 5 and capped.memory_size == 30
    res = cw.run(4, scheme, seed=0, max_updates=20_000)
    assert not res.censored and 0 < res.updates < 20_000
    assert res.final_mse < cw.THRESHOLD
    assert cw.run(4, scheme, seed=0, max_updates=20_000).updates == res.updates  # seeded


@pytest.mark.parametrize("scheme", ["proportional", "rank", "greedy"])
def test_smoke_variants(scheme: str) -> None:
    for kw in ({"beta": 0.5}, {"init": "td"}, {"alpha": 0.5, "eps": 1e-3}):
        res = cw.run(4, scheme, seed=1, max_updates=50_000, **kw)  # type: ignore[arg-type]
        assert not res.censored and res.final_mse < cw.THRESHOLD


def test_run_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="`scheme` must be one of .* got scheme='best'"):
        cw.run(4, "best", 0)
    with pytest.raises(ValueError, match="`init` must be 'max' or 'td', got init='zero'"):
        cw.run(4, "rank", 0, init="zero")
    with pytest.raises(ValueError, match="`n` must be an integer in \\[1, 24\\], got n=0"):
        cw.make_memory(0)


def test_prioritized_needs_fewer_updates_than_uniform() -> None:
    # n = 6 (126 transitions), 5 paired seeds: uniform needs ~1,500 updates,
    # proportional ~350, rank ~500 (docs/results/blind_cliffwalk).
    med = {
        s: np.median([cw.run(6, s, seed).updates for seed in range(5)])
        for s in ("uniform", "proportional", "rank", "oracle")
    }
    assert med["proportional"] * 2 < med["uniform"]
    assert med["rank"] * 2 < med["uniform"]
    assert med["oracle"] < med["proportional"]


def test_cli_writes_results_and_summary(tmp_path) -> None:
    out = tmp_path / "cw"
    argv = ["--n", "3", "4", "--runs", "2", "--out", str(out), "--no-plot"]
    assert cw.main([*argv, "--schemes", "uniform", "rank:1", "oracle"]) == 0
    with open(out / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 * 3 * 2
    assert {r["scheme"] for r in rows} == {"uniform", "rank", "oracle"}
    assert {r["seed"] for r in rows} == {"0", "1"}
    assert all(r["censored"] == "0" and r["memory_size"] in ("14", "30") for r in rows)
    summary = (out / "summary.md").read_text()
    assert "| n | memory | uniform | rank a=1 | oracle |" in summary
    assert "Speed-up" in summary
    # appending keeps the old rows; plot-only rereads them
    assert cw.main([*argv, "--append", "--runs", "1", "--schemes", "greedy"]) == 0
    assert len(report.read_results(out / "results.csv")) == 12 + 2
    assert cw.main(["--out", str(out), "--plot-only", "--no-plot"]) == 0
    assert "greedy" in (out / "summary.md").read_text()


def test_summary_counts_censored_runs_as_infinite() -> None:
    def row(scheme: str, updates: int, censored: bool) -> dict:
        return {
            "n": 5, "memory_size": 62, "scheme": scheme, "alpha": cw.DEFAULT_ALPHA[scheme],
            "beta": 0.0, "init": "max", "run": 0, "seed": 0, "updates": updates,
            "censored": censored, "final_mse": 0.0, "seconds": 0.0,
        }  # fmt: skip

    rows = [row("uniform", u, c) for u, c in [(10, False), (20, False), (30, False), (99, True)]]
    rows += [row("rank", u, c) for u, c in [(1, False), (99, True), (99, True)]]
    summ = report.summarise(rows)
    uni, rank = summ["uniform"][5], summ["rank"][5]
    assert (uni["median"], uni["q25"], uni["q75"], uni["censored"]) == (25.0, 17.5, np.inf, 1)
    assert rank["median"] == np.inf and rank["q25"] == np.inf  # 0.5 of the way to inf
    text = report.summary_markdown(rows)
    assert "| 5 | 62 | 25.0 [17.5-censored] (1/4 censored) | censored" in text


def test_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "cw"
    assert cw.main(["--n", "3", "--runs", "2", "--out", str(out), "--schemes", "uniform"]) == 0
    assert (out / "blind_cliffwalk.png").stat().st_size > 1000


def test_module_imports_only_numpy_and_fastper() -> None:
    code = (
        "import sys, fastper.agents.cliffwalk; "
        "bad = [m for m in ('torch', 'matplotlib', 'gymnasium') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
