"""Reference agents: one update checked by hand, smoke runs with tiny budgets, the CLI."""

from __future__ import annotations

import copy
import csv
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gymnasium")

import fastper  # noqa: E402
from fastper.agents import dqn, sac  # noqa: E402
from fastper.cli import main  # noqa: E402

#: torch on one thread (tests/agents/conftest.py): the networks are tiny, and OpenMP
#: threads that spin while other processes share the cores make these tests slower
pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIELDS = {
    "obs": ((2,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((2,), np.float32),
    "terminated": ((), np.bool_),
}


def linear_q(w: np.ndarray, b: np.ndarray) -> dqn.QNetwork:
    net = dqn.QNetwork(2, 2, (), dueling=False)
    with torch.no_grad():
        net.head.weight.copy_(torch.as_tensor(w, dtype=torch.float32))
        net.head.bias.copy_(torch.as_tensor(b, dtype=torch.float32))
    return net


def test_dqn_update_matches_hand_computation_and_feeds_priorities_back() -> None:
    obs = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], np.float32)
    nxt = np.array([[0.5, 0.5], [2.0, 0.0], [0.0, 0.0]], np.float32)
    act = np.array([0, 1, 1])
    rew = np.array([1.0, -3.0, 0.5], np.float32)
    term = np.array([False, False, True])
    buf = fastper.PrioritizedReplayBuffer(8, FIELDS, alpha=0.6, beta=0.4, seed=1)
    buf.add({"obs": obs, "action": act, "reward": rew, "next_obs": nxt, "terminated": term},
            priorities=[0.5, 2.0, 1.0])  # fmt: skip
    s = buf.sample(3)

    # the buffer's IS weights by hand: w = (N P)^-beta / max over the buffer
    p = np.array([0.5, 2.0, 1.0]) ** 0.6
    prob = p / p.sum()
    w_all = (3 * prob) ** -0.4
    np.testing.assert_allclose(s.weights, w_all[s.indices] / w_all.max(), rtol=1e-12)

    W, b = np.array([[0.2, -0.1], [0.4, 0.3]]), np.array([0.05, -0.02])
    Wt, bt = np.array([[1.0, 0.5], [-0.5, 2.0]]), np.array([0.1, 0.0])
    q, q_t = linear_q(W, b), linear_q(Wt, bt)
    opt = torch.optim.SGD(q.parameters(), lr=0.1)
    gamma = 0.9
    abs_td, loss = dqn.td_step(q, q_t, opt, s.to_torch(), gamma, max_grad_norm=1e9)

    # Double DQN target and weighted Huber gradient, by hand in float64
    i = s.indices
    o, n, a = obs[i].astype(np.float64), nxt[i].astype(np.float64), act[i]
    q_sa = (o @ W.T + b)[np.arange(3), a]
    best = (n @ W.T + b).argmax(axis=1)
    target = rew[i] + gamma * (1 - term[i]) * (n @ Wt.T + bt)[np.arange(3), best]
    delta = q_sa - target
    huber = np.where(np.abs(delta) < 1, 0.5 * delta**2, np.abs(delta) - 0.5)
    assert np.abs(delta).max() > 1  # both branches of the Huber loss are exercised
    assert loss == pytest.approx(float(np.mean(s.weights * huber)), rel=1e-5)
    np.testing.assert_allclose(abs_td.numpy(), np.abs(delta), rtol=1e-5)
    g = s.weights * np.clip(delta, -1, 1) / 3
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    for k in range(3):
        gW[a[k]] += g[k] * o[k]
        gb[a[k]] += g[k]
    np.testing.assert_allclose(q.head.weight.detach().numpy(), W - 0.1 * gW, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(q.head.bias.detach().numpy(), b - 0.1 * gb, rtol=1e-5, atol=1e-7)

    # |delta| goes back as the new priority (last duplicate wins)
    buf.update_priorities(s.indices, abs_td, keys=s.keys)
    last = {int(k): float(v) for k, v in zip(s.indices, np.abs(delta), strict=True)}
    for k, v in last.items():
        assert buf.priorities([k])[0] == pytest.approx(v + 1e-6, rel=1e-5)


def sac_batch(weights: np.ndarray) -> dict:
    g = np.random.default_rng(0)
    return {
        "obs": torch.as_tensor(g.normal(size=(4, 3)), dtype=torch.float32),
        "action": torch.as_tensor(g.uniform(-2, 2, size=(4, 1)), dtype=torch.float32),
        "reward": torch.as_tensor(g.normal(size=4), dtype=torch.float32),
        "next_obs": torch.as_tensor(g.normal(size=(4, 3)), dtype=torch.float32),
        "terminated": torch.zeros(4, dtype=torch.bool),
        "weights": torch.as_tensor(weights, dtype=torch.float64),
    }


def test_sac_weights_scale_critic_and_actor_losses_not_the_temperature() -> None:
    torch.manual_seed(0)
    cfg = sac.SACConfig(hidden=(8,))
    base = sac.make_state(3, 1, np.array([-2.0]), np.array([2.0]), cfg, torch.device("cpu"))
    runs = {}
    for scale in (1.0, 2.0):
        st = copy.deepcopy(base)
        st.critic_opt = torch.optim.SGD(st.critic.parameters(), lr=0.0)  # keep nets fixed
        st.actor_opt = torch.optim.SGD(st.actor.parameters(), lr=0.0)
        st.temp_opt = torch.optim.SGD([st.log_temp], lr=0.1)
        torch.manual_seed(1)
        # hand-computed TD errors of both critics against their shared target
        with torch.no_grad():
            b = sac_batch(np.full(4, 1.0))
            gen = torch.random.get_rng_state()
            na, nlp = st.actor(b["next_obs"])
            t1, t2 = st.critic_target(b["next_obs"], na)
            target = b["reward"] + 0.99 * (torch.min(t1, t2) - st.log_temp.exp() * nlp)
            q1, q2 = st.critic(b["obs"], b["action"])
            expected_td = 0.5 * ((q1 - target).abs() + (q2 - target).abs())
            torch.random.set_rng_state(gen)
        td, losses = sac.update(st, sac_batch(np.full(4, scale)), gamma=0.99, tau=0.0)
        np.testing.assert_allclose(td.numpy(), expected_td.numpy(), rtol=1e-5)
        runs[scale] = (losses, float(st.log_temp.detach()))
    assert runs[2.0][0]["critic"] == pytest.approx(2 * runs[1.0][0]["critic"], rel=1e-5)
    assert runs[2.0][0]["actor"] == pytest.approx(2 * runs[1.0][0]["actor"], rel=1e-5)
    assert runs[2.0][1] == runs[1.0][1]  # the temperature step ignores the IS weights
    assert runs[1.0][1] != float(base.log_temp.detach())  # ... and it did move


def read_episodes(path) -> list[dict]:
    with open(path / "episodes.csv", newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.parametrize("replay", ["uniform", "per", "rank"])
def test_dqn_smoke(tmp_path, replay: str) -> None:
    cfg = dqn.DQNConfig(replay=replay, total_steps=400, learning_starts=100, batch_size=16,
                        hidden=(16,), target_update=20, n_step=3 if replay == "rank" else 1,
                        dueling=replay == "per")  # fmt: skip
    res = dqn.train(cfg, out_dir=tmp_path, progress=False)
    rows = read_episodes(tmp_path)
    assert len(rows) == len(res.returns) > 5
    assert [float(r["return"]) for r in rows] == pytest.approx(res.returns)
    assert int(rows[-1]["step"]) <= 400 and res.steps == 400
    assert json.loads((tmp_path / "config.json").read_text())["replay"] == replay


@pytest.mark.parametrize("replay", ["uniform", "per"])
def test_sac_smoke(tmp_path, replay: str) -> None:
    cfg = sac.SACConfig(replay=replay, total_steps=450, learning_starts=150, batch_size=16,
                        hidden=(16,))  # fmt: skip
    res = sac.train(cfg, out_dir=tmp_path, progress=False)
    assert len(res.returns) == 2  # Pendulum episodes are 200 steps
    assert all(np.isfinite(res.returns))


def test_cli_train_compare_plot(tmp_path, capsys) -> None:
    out = tmp_path / "runs"
    rc = main(["train", "dqn", "--replay", "uniform", "per", "--seeds", "2", "--steps", "200",
               "--set", "learning_starts=50", "--set", "hidden=(16,)", "--out", str(out),
               "--threads", "1", "--quiet"])  # fmt: skip
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "dqn-CartPole-v1-per",
        "dqn-CartPole-v1-uniform",
    ]
    assert (out / "dqn-CartPole-v1-per" / "seed-1" / "episodes.csv").is_file()
    capsys.readouterr()
    assert main(["compare", str(out), "--threshold", "20", "--window", "3"]) == 0
    table = capsys.readouterr().out
    assert "| uniform | 2 |" in table and "| per | 2 |" in table and "reached 20" in table
    # a run without summary.json is unfinished: left out unless asked for
    (out / "dqn-CartPole-v1-per" / "seed-1" / "summary.json").unlink()
    assert main(["compare", str(out), "--threshold", "20", "--window", "3"]) == 0
    res = capsys.readouterr()
    assert "| per | 1 |" in res.out and "left out 1 unfinished run" in res.err
    assert main(["compare", str(out), "--window", "3", "--include-unfinished"]) == 0
    assert "| per | 2 |" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    assert main(["plot", str(out), "-o", str(png), "--window", "3"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_train_rejects_unknown_setting(capsys) -> None:
    assert main(["train", "dqn", "--set", "learning_rate=1", "--quiet"]) == 2
    assert "`--set` must name a field of DQNConfig" in capsys.readouterr().err


def test_cli_compare_without_runs(tmp_path, capsys) -> None:
    assert main(["compare", str(tmp_path)]) == 1
    assert "no finished runs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (dqn.DQNConfig, {"replay": "prioritized"}, "`replay` must be one of"),
        (dqn.DQNConfig, {"gradient_steps": 0}, "`gradient_steps` must be > 0"),
        (dqn.DQNConfig, {"tau": 1.5}, r"`tau` must be in \[0, 1\]"),
        (sac.SACConfig, {"batch_size": -1}, "`batch_size` must be > 0"),
        (sac.SACConfig, {"n_step": 0}, "`n_step` >= 1"),
    ],
)
def test_configs_refuse_bad_hyperparameters(cls, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)
