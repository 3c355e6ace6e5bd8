"""Reference agents: vector envs, evaluation episodes, image observations (MinAtar), the CLI."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gym = pytest.importorskip("gymnasium")

from fastper.agents import _common, dqn, runner, sac  # noqa: E402
from fastper.cli import main  # noqa: E402

EVAL_COLUMNS = ["step", "episode", "return", "length"]


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny networks: one thread is fastest, and a shared machine is not oversubscribed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def spy_on_replay(module, monkeypatch) -> dict:
    """Patch ``module.agent_replay`` to keep the buffer and a copy of every batch added."""
    seen: dict = {"adds": []}

    def replay(cfg, envs):
        buf = _common.agent_replay(cfg, envs)
        add = buf.add

        def recording_add(transition, *args, **kwargs):
            seen["adds"].append({k: np.array(v, copy=True) for k, v in transition.items()})
            return add(transition, *args, **kwargs)

        buf.add = recording_add  # type: ignore[method-assign]
        seen["buffer"] = buf
        return buf

    monkeypatch.setattr(module, "agent_replay", replay)
    return seen


def naive_nstep(adds: list[dict], n: int, gamma: float) -> list[tuple]:
    """Every complete n-step transition, computed env by env from the raw rows (an oracle).

    Also checks that each env's rows form its own trajectory: the next row
    starts where this one ended, unless the episode ended (then a new one
    starts: no reset row in between).
    """
    out = []
    n_envs = len(adds[0]["reward"])
    for i in range(n_envs):
        rows = [{k: v[i] for k, v in a.items()} for a in adds]
        for a, b in zip(rows, rows[1:], strict=False):
            if a["terminated"] or a["truncated"]:
                assert not np.array_equal(b["obs"], a["next_obs"])  # a fresh episode
            else:
                np.testing.assert_array_equal(b["obs"], a["next_obs"])
        for t in range(len(rows)):
            ret, m = 0.0, 0
            while t + m < len(rows):
                ret += gamma**m * float(rows[t + m]["reward"])
                m += 1
                last = rows[t + m - 1]
                if m == n or last["terminated"] or last["truncated"]:
                    break
            else:  # the window is still open when the run stops: not stored yet
                continue
            discount = 0.0 if last["terminated"] else gamma**m
            out.append((rows[t]["obs"].tobytes(), rows[t]["action"].tobytes(),
                        last["next_obs"].tobytes(), bool(last["terminated"]),
                        bool(last["truncated"]), ret, discount))  # fmt: skip
    return sorted(out)


def stored(buf) -> list[tuple]:
    d = buf.storage.gather(np.arange(len(buf)))
    return sorted(
        (d["obs"][k].tobytes(), d["action"][k].tobytes(), d["next_obs"][k].tobytes(),
         bool(d["terminated"][k]), bool(d["truncated"][k]), float(d["reward"][k]),
         float(d["discount"][k]))
        for k in range(len(buf))
    )  # fmt: skip


def check_buffer_matches_oracle(seen: dict, n: int, gamma: float) -> None:
    """The buffer holds exactly the oracle's transitions (the rows' dtypes are the stored ones)."""
    buf = seen["buffer"]
    want, got = naive_nstep(seen["adds"], n, gamma), stored(buf)
    assert len(got) == len(want) > 0 and buf.n_dropped == 0
    for g, w in zip(got, want, strict=True):
        assert g[:5] == w[:5]
        assert g[5:] == pytest.approx(w[5:], rel=1e-6, abs=1e-6)


def read_csv(path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def test_dqn_four_envs_keeps_one_nstep_window_per_env(tmp_path, monkeypatch) -> None:
    seen = spy_on_replay(dqn, monkeypatch)
    cfg = dqn.DQNConfig(num_envs=4, n_step=3, gamma=0.9, total_steps=400, learning_starts=200,
                        batch_size=16, hidden=(16,), replay="per", eval_every=0)  # fmt: skip
    res = dqn.train(cfg, out_dir=tmp_path, progress=False)
    assert len(seen["adds"]) == 100 and res.steps == 400  # 100 steps of 4 envs
    assert all((a["reward"] == 1.0).all() for a in seen["adds"])  # CartPole: no reset rows
    check_buffer_matches_oracle(seen, n=3, gamma=0.9)
    _, rows = read_csv(tmp_path / "episodes.csv")
    assert len(rows) == len(res.returns) > 4
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps) and all(s % 4 == 0 for s in steps)
    # every env step belongs to one episode: finished lengths + unfinished <= 400
    assert sum(int(r["length"]) for r in rows) <= 400
    assert not (tmp_path / "evaluations.csv").exists()  # eval_every=0: no evaluations


def test_sac_four_envs_smoke_with_nstep_and_evaluations(tmp_path, monkeypatch) -> None:
    seen = spy_on_replay(sac, monkeypatch)
    cfg = sac.SACConfig(num_envs=4, n_step=3, gamma=0.9, total_steps=800, learning_starts=700,
                        batch_size=16, hidden=(16,), eval_every=400, eval_episodes=2)  # fmt: skip
    res = sac.train(cfg, out_dir=tmp_path, progress=False)
    # Pendulum episodes are 200 steps: each env ends one at 4 x 200 = 800 env steps
    assert res.episode_end_steps == [800] * 4 and all(np.isfinite(res.returns))
    check_buffer_matches_oracle(seen, n=3, gamma=0.9)
    assert res.eval_steps == [400, 800] and res.eval_lengths == [[200, 200]] * 2
    columns, rows = read_csv(tmp_path / "evaluations.csv")
    assert columns == EVAL_COLUMNS and len(rows) == 4


@pytest.mark.parametrize(
    ("num_envs", "total", "every", "expected"),
    [(3, 300, 100, [102, 201, 300]), (2, 250, 100, [100, 200, 250]), (1, 50, 20, [20, 40, 50])],
)
def test_evaluations_csv_rows_steps_and_columns(tmp_path, num_envs, total, every, expected):
    cfg = dqn.DQNConfig(num_envs=num_envs, total_steps=total, learning_starts=total,
                        hidden=(8,), eval_every=every, eval_episodes=3,
                        eval_max_steps=15)  # fmt: skip
    res = dqn.train(cfg, out_dir=tmp_path, progress=False)
    assert res.eval_steps == expected  # after each multiple of eval_every passes, and at the end
    columns, rows = read_csv(tmp_path / "evaluations.csv")
    assert columns == EVAL_COLUMNS
    assert [(int(r["step"]), int(r["episode"])) for r in rows] == [
        (s, k) for s in expected for k in (1, 2, 3)
    ]
    assert [float(r["return"]) for r in rows] == pytest.approx(sum(res.eval_returns, []))
    assert all(1 <= int(r["length"]) <= 15 for r in rows)  # capped at eval_max_steps
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["evaluations"] == len(expected) and summary["steps"] == total


def balancing_q(*_args) -> dqn.QNetwork:
    """A fixed linear Q whose argmax pushes the cart towards the pole's fall: 1 iff theta + omega > 0."""
    net = dqn.QNetwork(4, 2, (), dueling=False)
    with torch.no_grad():
        net.head.weight.copy_(torch.tensor([[0.0, 0.0, -1.0, -1.0], [0.0, 0.0, 1.0, 1.0]]))
        net.head.bias.zero_()
    return net


def test_evaluation_is_greedy_and_seeded_apart_from_training(monkeypatch) -> None:
    monkeypatch.setattr(dqn, "make_q_network", balancing_q)
    cfg = dqn.DQNConfig(seed=3, total_steps=20, learning_starts=20, eval_every=10,
                        eval_episodes=2, eval_max_steps=300)  # fmt: skip
    res = dqn.train(cfg, progress=False)  # learning_starts = total_steps: the net never moves
    env = gym.make("CartPole-v1")
    returns, lengths = [], []
    for k in range(2):  # by hand: the greedy action of the fixed net, eval_seed seeds
        rets, lens = [], []
        for j in range(2):
            seed = _common.eval_seed(cfg.seed, k, j)
            assert seed >= 2**31  # never one of the training envs' seeds (seed + i)
            obs, _ = env.reset(seed=seed)
            ret, n, done = 0.0, 0, False
            while not done and n < 300:
                obs, r, term, trunc, _ = env.step(int(obs[2] + obs[3] > 0))
                ret, n, done = ret + r, n + 1, term or trunc
            rets.append(ret)
            lens.append(n)
        returns.append(rets)
        lengths.append(lens)
    assert res.eval_steps == [10, 20]
    assert res.eval_returns == returns and res.eval_lengths == lengths
    assert min(sum(lengths, [])) > 100  # greedy balances; random actions last ~20 steps
    assert len({_common.eval_seed(cfg.seed, k, j) for k in range(2) for j in range(2)}) == 4


def test_sac_evaluation_is_the_mean_action_and_draws_no_random_numbers() -> None:
    torch.manual_seed(0)
    cfg = sac.SACConfig(hidden=(8,))
    st = sac.make_state(3, 1, np.array([-2.0]), np.array([2.0]), cfg, torch.device("cpu"))
    obs = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    state = torch.random.get_rng_state()
    act = sac.deterministic_policy(st.actor, torch.device("cpu"))(obs)
    assert torch.equal(torch.random.get_rng_state(), state)
    mean, _ = st.actor.net(torch.as_tensor(obs)).chunk(2, dim=-1)
    np.testing.assert_allclose(act, (2.0 * torch.tanh(mean)).detach().numpy(), rtol=1e-6)


@pytest.mark.parametrize("algo", ["dqn", "sac"])
def test_evaluation_does_not_change_training(algo: str) -> None:
    if algo == "dqn":
        kw = {"num_envs": 2, "total_steps": 500, "learning_starts": 100, "batch_size": 16,
              "hidden": (16,), "eval_episodes": 2, "eval_epsilon": 0.5}  # fmt: skip
        train, make = dqn.train, dqn.DQNConfig
    else:
        kw = {"num_envs": 2, "total_steps": 500, "learning_starts": 400, "batch_size": 16,
              "hidden": (16,), "eval_episodes": 1}  # fmt: skip
        train, make = sac.train, sac.SACConfig
    plain = train(make(eval_every=0, **kw), progress=False)
    evaluated = train(make(eval_every=100, **kw), progress=False)
    assert plain.eval_steps == [] and evaluated.eval_steps == [100, 200, 300, 400, 500]
    assert evaluated.episode_end_steps == plain.episode_end_steps
    assert evaluated.returns == plain.returns


def test_cnn_q_network_on_minatar_observations() -> None:
    pytest.importorskip("minatar")
    envs = _common.make_vec_env("MinAtar/Breakout-v1", 2)
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (2, 10, 10, 4) and obs.dtype == np.bool_
    cfg = dqn.DQNConfig(env_id="MinAtar/Breakout-v1", num_envs=2)
    buf = _common.agent_replay(cfg, envs)
    assert buf.storage.fields["obs"].dtype == np.bool_  # one byte per cell, not float32
    envs.close()
    for dueling in (False, True):
        net = dqn.make_q_network(dqn.DQNConfig(dueling=dueling), (10, 10, 4), 3)
        assert isinstance(net, dqn.ConvQNetwork)
        conv, linear = net.body[0], net.body[3]
        assert (conv.in_channels, conv.out_channels, conv.kernel_size) == (4, 16, (3, 3))
        assert (linear.in_features, linear.out_features) == (16 * 8 * 8, 128)
        q = net(torch.as_tensor(obs))
        assert q.shape == (2, 3) and q.dtype == torch.float32
    assert isinstance(dqn.make_q_network(dqn.DQNConfig(), (4,), 2), dqn.QNetwork)
    with pytest.raises(ValueError, match="`network`='cnn' needs 3-D"):
        dqn.make_q_network(dqn.DQNConfig(network="cnn"), (4,), 2)


def test_cli_trains_dqn_on_minatar(tmp_path) -> None:
    pytest.importorskip("minatar")
    out = tmp_path / "runs"
    rc = main(["train", "dqn", "--env", "MinAtar/Breakout-v1", "--steps", "300",
               "--num-envs", "2", "--set", "learning_starts=100", "--set", "batch_size=16",
               "--set", "eval_every=150", "--set", "eval_episodes=2",
               "--set", "eval_max_steps=100", "--threads", "1", "--out", str(out),
               "--quiet"])  # fmt: skip
    assert rc == 0
    run = out / "dqn-MinAtar_Breakout-v1-per" / "seed-0"
    assert {p.name for p in run.iterdir()} >= {
        "config.json", "episodes.csv", "evaluations.csv", "summary.json"
    }  # fmt: skip
    config = json.loads((run / "config.json").read_text())["config"]
    assert config["num_envs"] == 2 and config["network"] == "auto"
    _, rows = read_csv(run / "evaluations.csv")
    assert [int(r["step"]) for r in rows] == [150, 150, 300, 300]
    assert json.loads((run / "summary.json").read_text())["steps"] == 300


def test_missing_minatar_says_how_to_install(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "minatar", None)  # `import minatar` now fails
    monkeypatch.setitem(sys.modules, "minatar.gym", None)
    with pytest.raises(ImportError, match=r"pip install 'fastper\[minatar\]'"):
        _common.make_env("MinAtar/Breakout-v1")
    out = tmp_path / "runs"
    assert main(["train", "dqn", "--env", "MinAtar/Breakout-v1", "--out", str(out),
                 "--quiet"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install "fastper[minatar]"' in err
    assert not out.exists()


class ImageBoxEnv(gym.Env):
    """Image observations with continuous actions: not for SAC."""

    observation_space = gym.spaces.Box(0, 255, (6, 6, 3), np.uint8)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (dqn.DQNConfig, {"num_envs": 0}, "`num_envs` must be an integer >= 1"),
        (sac.SACConfig, {"num_envs": 2.5}, "`num_envs` must be an integer >= 1"),
        (dqn.DQNConfig, {"num_envs": 8, "total_steps": 4}, "`total_steps` must be >= num_envs"),
        (dqn.DQNConfig, {"eval_every": 10, "eval_episodes": 0}, "`eval_episodes` must be >= 1"),
        (sac.SACConfig, {"eval_every": -1}, "`eval_every` must be an integer >= 0"),
        (dqn.DQNConfig, {"eval_max_steps": 0}, "`eval_max_steps` must be an integer >= 1"),
        (dqn.DQNConfig, {"eval_epsilon": 1.5}, r"`eval_epsilon` must be in \[0, 1\]"),
        (dqn.DQNConfig, {"network": "xyz"}, r"`network` must be one of \['auto', 'mlp', 'cnn'\]"),
    ],
)
def test_configs_refuse_bad_vector_and_eval_settings(cls, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)
    cls(eval_every=0, eval_episodes=0)  # no evaluation: no episodes needed


def test_cli_and_check_env_refuse_settings_that_do_not_fit(tmp_path, capsys) -> None:
    out = str(tmp_path / "runs")
    assert main(["train", "dqn", "--set", "network=cnn", "--out", out, "--quiet"]) == 2
    assert "`network`='cnn' needs 3-D" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse's own error
        main(["train", "dqn", "--num-envs", "0", "--out", out, "--quiet"])
    assert exit_info.value.code == 2
    assert "--num-envs: must be >= 1" in capsys.readouterr().err
    assert main(["train", "dqn", "--num-envs", "2", "--set", "num_envs=3", "--out", out]) == 2
    assert "`--set num_envs=3` and `--num-envs 2` disagree" in capsys.readouterr().err
    gym.register(id="FastperTest/ImageBox-v0", entry_point=ImageBoxEnv)
    try:
        with pytest.raises(runner.SettingsError, match=r"SAC needs flat \(1-D Box\) observations"):
            runner.check_env("sac", "FastperTest/ImageBox-v0")
    finally:
        gym.registry.pop("FastperTest/ImageBox-v0")
    assert not (tmp_path / "runs").exists()
