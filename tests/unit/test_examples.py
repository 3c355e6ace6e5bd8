"""The examples run as documented."""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_runs_and_learns_priorities(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    scope = runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    buf, q = scope["buf"], scope["q"]
    assert len(buf) == scope["steps"] == 2_000
    # sampled transitions got their |td| back as priorities: no longer all equal
    assert len(set(buf.priorities(range(len(buf))).round(9))) > 1
    assert buf.sample(16).weights.max() <= 1.0
    # the toy learner learned that action 1 pays more (reward = action)
    assert q[1] > q[0] + 0.5
    assert list(tmp_path.iterdir()) == []  # its checkpoint went to a scratch folder


def test_vector_env_example_keeps_streams_and_drops_reset_rows() -> None:
    spec = importlib.util.spec_from_file_location("vector_env", ROOT / "examples" / "vector_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    steps, n_envs, gamma = 300, 8, 0.99
    buf = module.main(steps=steps, n_envs=n_envs)
    n = len(buf)
    assert n + buf.n_pending + buf.n_dropped == steps * n_envs and buf.n_dropped > 0
    batch = buf.storage.gather(np.arange(n))
    disc = batch["discount"].astype(np.float64)
    # CartPole pays 1 per step: an m-step window holds sum_{j<m} gamma^j, and m is
    # read off the bootstrap discount gamma^m (0 after a termination). A reset row
    # (reward 0) or another env's step inside a window would break this.
    sums = {m: sum(gamma**j for j in range(m)) for m in (1, 2, 3)}
    for r, d, term in zip(batch["reward"], disc, batch["terminated"], strict=True):
        if d > 0:
            m = round(np.log(d) / np.log(gamma))
            assert m in sums and abs(r - sums[m]) < 1e-5
            assert not term
        else:
            assert term and min(abs(r - s) for s in sums.values()) < 1e-5


def test_device_example_learns_on_the_cpu_device(one_torch_thread) -> None:
    torch = pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(
        "device_replay", ROOT / "examples" / "device_replay.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses, buf = module.main(steps=300, device="cpu")
    # the Q-network fits the rewards: the TD error falls well below its start
    assert np.mean(losses[-50:]) < 0.5 * np.mean(losses[:20])
    p = buf.priorities(torch.arange(len(buf)))
    assert p.unique().numel() > 100  # sampled transitions got their |td| back
    assert buf.invalid_updates == 0 and buf.device.type == "cpu"
