"""The CleanRL-style examples train end to end: examples/dqn_per.py and examples/sac_per.py.

Each runs in-process for a few hundred env steps of a Gymnasium vector env;
the checks are on what fastper was fed and gave back: every env's rows
accounted for (stored, pending in a window, or a dropped reset row), n-step
rewards and discounts as fastper defines them, priorities updated, beta
annealed to 1 over the run, finite losses and returns.
"""

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("gymnasium")

ROOT = Path(__file__).resolve().parents[2]


#: torch on one thread (tests/conftest.py): the examples' networks are tiny
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_replay(out: dict[str, Any]) -> dict[str, np.ndarray]:
    """Checks shared by both examples; returns the stored rows."""
    args, buf = out["args"], out["buffer"]
    n, n_envs, last_step = len(buf), args.num_envs, out["steps"] * args.num_envs
    # every row of every env is stored, waiting in its env's window, or a dropped reset row
    assert n < args.buffer_size
    assert n + buf.n_pending + buf.n_dropped == out["steps"] * n_envs
    assert buf.n_pending <= n_envs * (args.n_step - 1)
    # one reset row per episode end, except for episodes ending on the very last step
    ended_before_last = sum(1 for step, _ in out["episodes"] if step < last_step)
    assert ended_before_last > 0 and buf.n_dropped == ended_before_last
    # every sample call was followed by a priority update: beta reached 1 on the last one
    assert out["n_updates"] > 0 and buf.step == out["n_updates"]
    assert buf.beta == pytest.approx(1.0)
    p = buf.priorities(np.arange(n))
    assert len(np.unique(p)) > 10  # sampled transitions got their |td| back (new ones: max)
    assert buf.sample(16).weights.max() <= 1.0
    assert len(out["losses"]) == out["n_updates"] and np.isfinite(out["losses"]).all()
    assert np.isfinite(out["abs_td"]).all()
    assert np.isfinite([r for _, r in out["episodes"]]).all()

    rows = buf.storage.gather(np.arange(n))
    gamma, n_step = args.gamma, args.n_step
    disc = rows["discount"].astype(np.float64)
    window = np.zeros(n, dtype=np.int64)  # m, read off the bootstrap discount gamma^m
    live = disc > 0
    window[live] = np.rint(np.log(disc[live]) / np.log(gamma))
    assert np.allclose(disc[live], gamma ** window[live], rtol=1e-6)
    assert ((window[live] >= 1) & (window[live] <= n_step)).all()
    # discount 0 exactly after a termination; shorter windows only at an episode's end
    assert np.array_equal(~live, rows["terminated"])
    assert (rows["truncated"] | rows["terminated"])[live & (window < n_step)].all()
    rows["window"] = window
    return rows


def test_dqn_per_cartpole_streams_nstep_and_priorities() -> None:
    dqn = load_example("dqn_per")
    argv = ["--total-timesteps", "400", "--learning-starts", "100", "--batch-size", "32",
            "--log-every", "200", "--seed", "0"]  # fmt: skip
    out = dqn.main(argv)
    args = out["args"]
    assert (args.num_envs, args.n_step, args.env_id) == (4, 3, "CartPole-v1")
    assert out["steps"] == 100 and out["n_updates"] == 100 - 25  # learns after 25 envs.step
    rows = check_replay(out)
    # CartPole pays 1 a step: an m-step window holds sum_{j<m} gamma^j; a reset row
    # (reward 0) or another env's step inside a window would break this
    gamma = args.gamma
    expected = np.array([sum(gamma**j for j in range(m)) for m in range(args.n_step + 1)])
    live = rows["discount"] > 0
    assert np.allclose(rows["reward"][live], expected[rows["window"][live]], atol=1e-5)
    assert rows["terminated"].any() and (rows["window"][live] == 3).any()
    # a terminal row's window can be any length: its reward says which
    term = rows["reward"][~live][:, None]
    assert (np.abs(term - expected[1:]) < 1e-5).any(axis=1).all()

    # seeded: the same arguments give the same run
    again = dqn.main(argv)
    assert again["episodes"] == out["episodes"] and again["losses"] == out["losses"]


def test_sac_per_pendulum_streams_nstep_and_priorities() -> None:
    sac = load_example("sac_per")
    out = sac.main(
        ["--total-timesteps", "300", "--num-envs", "2", "--learning-starts", "100",
         "--batch-size", "32", "--gradient-steps", "1", "--hidden", "32",
         "--max-episode-steps", "40", "--log-every", "100", "--seed", "0"]
    )  # fmt: skip
    args = out["args"]
    assert (args.n_step, args.env_id) == (3, "Pendulum-v1")
    assert out["steps"] == 150 and out["n_updates"] == 150 - 50
    assert len(out["episodes"]) == 2 * 3  # 150 steps of 40-step episodes, per env
    rows = check_replay(out)
    # Pendulum never terminates; truncated episodes still bootstrap, with shorter windows
    assert not rows["terminated"].any()
    assert set(np.unique(rows["window"])) == {1, 2, 3}
    assert rows["action"].shape == (len(out["buffer"]), 1)
    assert (np.abs(rows["action"]) <= 2.0).all()
