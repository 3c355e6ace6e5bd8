"""examples/sb3_per.py: PERDQN learns CartPole-v1 in a few thousand steps (fixed seed)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

pytest.importorskip("stable_baselines3")

ROOT = Path(__file__).resolve().parents[2]


def test_perdqn_learns_cartpole() -> None:
    spec = importlib.util.spec_from_file_location("sb3_per", ROOT / "examples" / "sb3_per.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    start = time.perf_counter()
    model, mean_return, learn_seconds = module.main(total_timesteps=8_000, seed=0)
    print(
        f"learn {learn_seconds:.1f} s, total {time.perf_counter() - start:.1f} s, mean {mean_return}"
    )
    # `python examples/sb3_per.py` (8,000 steps, seed 0) printed a greedy mean return of 257.6
    assert mean_return >= 150  # random play: about 22
    buf = model.replay_buffer
    assert buf.n_steps == 3 and buf.beta > 0.99  # annealed to 1 by the end
    assert buf.fastper_buffer.stale_updates == 0  # nothing overwritten: 8,000 < 100,000 slots
