"""examples/apex_dqn.py runs end to end on a local Ray cluster, for a tiny budget.

The example runs in a subprocess (its own Ray cluster, its own token) for a few
hundred learner updates. The checks are on what crossed between processes:
every row an actor inserted reached a shard, the learner sampled and sent
every priority back (stale drops allowed), weights were published and picked
up by every actor, the rate limiter held its range, the shards' checkpoint
holds n-step rows as fastper defines them, and no process of the cluster is
left once the example has exited.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

for _module in ("ray", "torch", "gymnasium"):  # the example's needs; not imported here (slow)
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"the Ape-X example needs {_module}", allow_module_level=True)

from fastper.distributed import ShardedReplayBuffer  # noqa: E402

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "apex_dqn.py"
BENCH = ROOT / "benchmarks" / "distributed.py"


def processes_with(token: str) -> list[int]:
    """Processes of this user whose environment holds ``token`` (the cluster's own)."""
    needle = f"RAY_AUTH_TOKEN={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def run(cmd: list[str], tmp_path: Path, timeout: float) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``cmd`` with a fresh Ray token; returns the result and the token."""
    token = secrets.token_hex(32)  # keeps ~/.ray/auth_token unwritten, and marks the processes
    env = {**os.environ, "RAY_AUTH_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, (
        f"exit status {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    )
    return out, token


def assert_no_process_left(token: str) -> None:
    deadline = time.monotonic() + 30.0  # Ray's workers exit shortly after the raylet (loaded: later)
    while (left := processes_with(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the example's Ray cluster still run: {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_apex_example_inserts_samples_updates_publishes_and_exits_cleanly(tmp_path: Path) -> None:
    summary_path, ckpt = tmp_path / "summary.json", tmp_path / "ckpt"
    updates, batch, publish_every, gamma = 200, 32, 20, 0.99
    cmd = [sys.executable, str(EXAMPLE), "--total-updates", str(updates),
           "--batch-size", str(batch), "--learning-starts", "300", "--samples-per-insert", "4",
           "--num-actors", "2", "--num-shards", "2", "--envs-per-actor", "2",
           "--shard-capacity", "2048", "--publish-every", str(publish_every), "--pull-every", "10",
           "--eval-every", "0", "--eval-episodes", "1", "--log-every", "100",
           "--summary-json", str(summary_path), "--save-dir", str(ckpt)]  # fmt: skip
    out, token = run(cmd, tmp_path, timeout=180)  # about 27-34 s here; 60+ on a loaded machine
    assert "final greedy evaluation" in out.stdout
    s = json.loads(summary_path.read_text())

    # actors -> shards: every row sent was confirmed, none dropped, all of them in the shards
    actors = s["actors"]
    assert len(actors) == 2 and all(a["rows_sent"] > 0 for a in actors)
    assert all(a["inserted"] == a["rows_sent"] and a["dropped"] == 0 for a in actors)
    added = sum(sh["added"] for sh in s["shards"])
    assert added == sum(a["inserted"] for a in actors)
    assert all(sh["added"] > 0 for sh in s["shards"])  # batch keys spread them over both shards
    # the learner sampled and sent every |TD| back; shards may drop stale ones
    assert s["updates"] == updates
    assert s["priority_entries_sent"] == updates * batch
    assert 0 <= s["stale_dropped"] <= s["priority_entries_sent"]
    # the limiter counted what landed and every batch sampled, and held its range
    lim = s["limiter"]
    assert lim["inserts"] == added and lim["pending"] == 0
    assert lim["samples"] >= updates * batch  # plus the batches the prefetch thread drew ahead
    assert lim["min_diff"] <= lim["diff"] <= lim["max_diff"]
    # weights: published every 20 updates, each actor took in newer ones than the first
    assert s["published_versions"] == updates // publish_every
    assert all(a["weights_loaded"] >= 2 and a["last_version"] >= 1 for a in actors)
    eps = [e for a in actors for e in a["epsilons"]]  # Ape-X's, over all 4 env copies
    np.testing.assert_allclose(eps, [0.4 ** (1 + 7 * i / 3) for i in range(4)])
    assert len(s["evaluations"]) == 1 and s["final_eval_mean"] >= 8  # CartPole lasts >= 8 steps
    assert_no_process_left(token)

    # the checkpoint the example saved: n-step rows as the actors made them
    buf = ShardedReplayBuffer.load_local(ckpt)
    assert len(buf) == added
    rows = buf.sample(2048)
    disc = rows.data["discount"].astype(np.float64)
    live = disc > 0
    m = np.rint(np.log(disc[live]) / np.log(gamma))  # the window's length, from gamma^m
    assert np.allclose(disc[live], gamma**m, rtol=1e-6) and set(m.tolist()) <= {1.0, 2.0, 3.0}
    assert np.array_equal(~live, rows.data["terminated"])  # termination: no bootstrap
    returns = np.array([sum(gamma**j for j in range(k)) for k in range(1, 4)])
    np.testing.assert_allclose(rows.data["reward"][live], returns[m.astype(int) - 1], rtol=1e-5)
    ended = rows.data["reward"][~live].astype(np.float64)[:, None]  # m unknown: one of the three
    assert (np.abs(ended - returns).min(axis=1) < 1e-5).all()
    assert np.unique(rows.probabilities).size > 10  # priorities from |TD|, not one constant


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_distributed_benchmark_quick_mode_runs(tmp_path: Path) -> None:
    """benchmarks/distributed.py --quick (about 30 s here): every set-up measured, the checks
    passed, the compiled-graph fan-out and the scale model reported, no process left."""
    out, token = run([sys.executable, str(BENCH), "--quick"], tmp_path, timeout=240)
    blocks = [[ln for ln in b.splitlines() if ln.startswith("| ")] for b in out.stdout.split("\n\n")]
    learner, stores, fanouts, model = [b for b in blocks if b]
    names = [r.split("|")[1].strip() for r in learner[1:]]
    assert names == ["local (1 process)", "1 Ray actor, 1 buffer", "2 shards, strict, socket",
                     "2 shards, strict, ray", "2 shards, pipelined D=2 M=8, socket"]  # fmt: skip
    for r in learner[1:]:
        cells = [c.strip() for c in r.split("|")[2:-1]]
        assert len(cells) == 7 and all(c and c != "nan" for c in cells), r
    seen, most = (int(v) for v in learner[-1].split("|")[-2].split("/"))
    assert most == 2 * 2 * 8 - 1 and 0 < seen <= most  # D=2, M=8: drawn ahead, never staler
    assert len(stores) == 4 and len(fanouts) == 4  # header + 3 stores; header + 3 paths
    assert "Ray compiled graph" in fanouts[-1]
    assert model[1].split("|")[1].strip() == "strict" and len(model) == 2 + 7  # 7 values of M
    assert "Target (pipelined >= 50% of the in-process rate)" in out.stdout
    assert_no_process_left(token)
