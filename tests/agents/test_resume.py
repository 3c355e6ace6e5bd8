"""Training runs checkpoint themselves; a resumed run ends bit for bit as an uninterrupted one."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gymnasium")

from fastper.agents import _common, dqn, resume, sac  # noqa: E402
from fastper.checkpoint import read_state  # noqa: E402
from fastper.cli import main  # noqa: E402


class Crash(Exception):
    """Stands for the process dying: nothing after it runs, files are left as they are."""


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def crash_after(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Make the next run die when it is about to take env step ``step + 1``."""
    real = _common.Collector.step

    def step_or_die(self: Any, t: int, actions: Any) -> None:
        if t > step:
            monkeypatch.setattr(_common.Collector, "step", real)
            raise Crash
        real(self, t, actions)

    monkeypatch.setattr(_common.Collector, "step", step_or_die)


def dqn_config(**kw: Any) -> dqn.DQNConfig:
    settings: dict[str, Any] = dict(
        total_steps=600, learning_starts=100, buffer_size=400, batch_size=16, hidden=(16,),
        train_freq=2, eval_every=200, eval_episodes=2, eval_max_steps=60, checkpoint_every=250,
    )  # fmt: skip
    settings.update(kw)
    return dqn.DQNConfig(**settings)


def sac_config(**kw: Any) -> sac.SACConfig:
    settings: dict[str, Any] = dict(
        total_steps=300, learning_starts=100, buffer_size=300, batch_size=16, hidden=(16,),
        eval_every=150, eval_episodes=1, eval_max_steps=40, checkpoint_every=120,
    )  # fmt: skip
    settings.update(kw)
    return sac.SACConfig(**settings)


def episodes_without_wall(path: Path) -> list[list[str]]:
    """episodes.csv without its wall_s column (seconds differ between any two runs)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][-1] == "wall_s"
    return [r[:-1] for r in rows]


def final_state(run_dir: Path) -> dict[str, Any]:
    path = resume.latest(run_dir)
    assert path is not None
    state, _ = read_state(path / resume.RUN_FILE)
    assert state["run"]["final"]
    return state


def assert_same_run(a: Path, b: Path, res_a: Any, res_b: Any) -> None:
    assert (a / "evaluations.csv").read_bytes() == (b / "evaluations.csv").read_bytes()
    assert episodes_without_wall(a / "episodes.csv") == episodes_without_wall(b / "episodes.csv")
    assert res_a.returns == res_b.returns and res_a.episode_end_steps == res_b.episode_end_steps
    assert res_a.eval_returns == res_b.eval_returns and res_a.eval_steps == res_b.eval_steps
    sa, sb = final_state(a), final_state(b)
    for part in ("modules", "optim", "torch", "collector"):
        assert sa[part].keys() == sb[part].keys()
        for key, va in sa[part].items():
            vb = sb[part][key]
            if isinstance(va, np.ndarray):
                assert va.dtype == vb.dtype and np.array_equal(va, vb), (part, key)
            else:
                assert va == vb, (part, key)
    assert sa["run"]["counters"] == sb["run"]["counters"]
    buf_a = (resume.latest(a) / resume.BUFFER_FILE).read_bytes()  # type: ignore[operator]
    buf_b = (resume.latest(b) / resume.BUFFER_FILE).read_bytes()  # type: ignore[operator]
    assert buf_a == buf_b
    sum_a = json.loads((a / "summary.json").read_text())
    sum_b = json.loads((b / "summary.json").read_text())
    assert {k: v for k, v in sum_a.items() if k != "wall_s"} == {
        k: v for k, v in sum_b.items() if k != "wall_s"
    }


def test_dqn_resumed_after_a_crash_ends_bit_for_bit_as_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = dqn_config()
    whole = dqn.train(cfg, tmp_path / "whole", progress=False)
    crashed = tmp_path / "crashed"
    crash_after(monkeypatch, 420)  # checkpoint at 250, then 170 more steps logged
    with pytest.raises(Crash):
        dqn.train(cfg, crashed, progress=False)
    saved = resume.read(crashed, "dqn", cfg, load_buffer=False)
    assert saved.meta["step"] == 250 and not saved.final
    # rows of episodes past the checkpoint were written: resume must cut them off
    logged = (crashed / "episodes.csv").stat().st_size
    assert logged > saved.meta["csv_bytes"]["episodes.csv"]
    again = dqn.train(cfg, crashed, progress=False, resume=True)
    assert_same_run(tmp_path / "whole", crashed, whole, again)


def test_dqn_resume_with_two_envs_and_n_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = dqn_config(num_envs=2, n_step=3, replay="rank", total_steps=400, checkpoint_every=150)
    whole = dqn.train(cfg, tmp_path / "whole", progress=False)
    crash_after(monkeypatch, 200)
    with pytest.raises(Crash):
        dqn.train(cfg, tmp_path / "b", progress=False)
    again = dqn.train(cfg, tmp_path / "b", progress=False, resume=True)
    assert_same_run(tmp_path / "whole", tmp_path / "b", whole, again)


def test_sac_resumed_after_a_crash_ends_bit_for_bit_as_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = sac_config()
    whole = sac.train(cfg, tmp_path / "whole", progress=False)
    crash_after(monkeypatch, 130)  # after the checkpoint at 120, past learning_starts
    with pytest.raises(Crash):
        sac.train(cfg, tmp_path / "b", progress=False)
    again = sac.train(cfg, tmp_path / "b", progress=False, resume=True)
    assert_same_run(tmp_path / "whole", tmp_path / "b", whole, again)


def test_checkpoints_replace_each_other_and_a_fresh_start_removes_them(tmp_path: Path) -> None:
    cfg = dqn_config(total_steps=300, eval_every=0, checkpoint_every=100)
    dqn.train(cfg, tmp_path, progress=False)
    names = sorted(p.name for p in (tmp_path / resume.CHECKPOINTS).iterdir())
    assert names == ["step-000000000300"]
    assert sorted(p.name for p in resume.latest(tmp_path).iterdir()) == [  # type: ignore[union-attr]
        resume.BUFFER_FILE,
        resume.RUN_FILE,
    ]
    off = dqn_config(total_steps=300, eval_every=0, checkpoint_every=0)
    dqn.train(off, tmp_path, progress=False)
    assert resume.latest(tmp_path) is None


def test_resume_refuses_a_directory_without_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(resume.ResumeError, match="holds no checkpoint"):
        dqn.train(dqn_config(), tmp_path, progress=False, resume=True)
    with pytest.raises(ValueError, match="needs the run's `out_dir`"):
        dqn.train(dqn_config(), None, progress=False, resume=True)


def test_resume_refuses_another_config_and_names_the_fields(tmp_path: Path) -> None:
    dqn.train(dqn_config(total_steps=300, eval_every=0), tmp_path, progress=False)
    other = dqn_config(total_steps=300, eval_every=0, lr=1e-3, hidden=(8,))
    with pytest.raises(
        resume.ResumeError, match=r"config differs .* hidden=\[16\] \(now \[8\]\), lr="
    ):
        dqn.train(other, tmp_path, progress=False, resume=True)
    with pytest.raises(resume.ResumeError, match="checkpoint is of `dqn`, not `sac`"):
        resume.read(tmp_path, "sac", other)
    # checkpoint_every may change between sittings: it changes nothing computed
    same = dqn_config(total_steps=300, eval_every=0, checkpoint_every=50)
    assert resume.read(tmp_path, "dqn", same, load_buffer=False).final


@pytest.mark.parametrize("name", [resume.RUN_FILE, resume.BUFFER_FILE])
def test_resume_refuses_a_damaged_checkpoint(tmp_path: Path, name: str) -> None:
    cfg = dqn_config(total_steps=300, eval_every=0)
    dqn.train(cfg, tmp_path, progress=False)
    path = resume.latest(tmp_path) / name  # type: ignore[operator]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(resume.ResumeError, match="damaged"):
        dqn.train(cfg, tmp_path, progress=False, resume=True)
    with pytest.raises(resume.ResumeError, match="damaged"):
        resume.verify(tmp_path, "dqn", cfg)


def test_resume_refuses_an_env_that_does_not_replay_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = dqn_config(total_steps=300, eval_every=0, checkpoint_every=200)
    crash_after(monkeypatch, 250)
    with pytest.raises(Crash):
        dqn.train(cfg, tmp_path, progress=False)
    real = _common.make_vec_env

    def other_seeds(env_id: str, num_envs: int) -> Any:
        envs = real(env_id, num_envs)
        reset = envs.reset
        envs.reset = lambda seed=None, **kw: reset(seed=None if seed is None else seed + 7, **kw)
        return envs

    monkeypatch.setattr(dqn, "make_vec_env", other_seeds)
    with pytest.raises(resume.ResumeError, match="not deterministic"):
        dqn.train(cfg, tmp_path, progress=False, resume=True)


def test_resume_refuses_logs_shorter_than_the_checkpoint(tmp_path: Path) -> None:
    cfg = dqn_config(total_steps=300, eval_every=0)
    dqn.train(cfg, tmp_path, progress=False)
    (tmp_path / "episodes.csv").write_text("step,episode,return,length,wall_s\n")
    with pytest.raises(
        resume.ResumeError, match=r"episodes.csv has 34 bytes, fewer than the \d+ its checkpoint"
    ):
        dqn.train(cfg, tmp_path, progress=False, resume=True)


CLI = [
    "train", "dqn", "--steps", "300", "--quiet", "--threads", "1", "--set", "learning_starts=100",
    "--set", "hidden=16", "--set", "batch_size=16", "--set", "eval_every=0",
    "--set", "checkpoint_every=100",
]  # fmt: skip


def test_cli_resume_continues_refuses_and_skips_finished_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main([*CLI, "--out", str(whole)]) == 0
    crash_after(monkeypatch, 150)
    with pytest.raises(Crash):
        main([*CLI, "--out", str(cut)])
    capsys.readouterr()
    assert main([*CLI, "--out", str(cut), "--resume"]) == 0
    run = Path("dqn-CartPole-v1-per") / "seed-0"
    a, b = whole / run, cut / run
    assert episodes_without_wall(a / "episodes.csv") == episodes_without_wall(b / "episodes.csv")
    assert np.array_equal(
        final_state(a)["modules"]["q/body.0.weight"], final_state(b)["modules"]["q/body.0.weight"]
    )
    printed = capsys.readouterr().out
    # a finished run is not run again: its result is read back
    assert main([*CLI, "--out", str(cut), "--resume"]) == 0
    assert capsys.readouterr().out.split("\n")[1][:40] == printed.split("\n")[1][:40]

    assert main([*CLI, "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "no run under" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    assert main([*CLI, "--out", str(cut), "--resume", "--set", "lr=0.001"]) == 2
    assert (
        "config differs from its checkpoint's in lr=0.0005 (now 0.001)" in capsys.readouterr().err
    )


def test_replaying_sub_envs_one_by_one_equals_stepping_the_vector_env() -> None:
    def fresh(num: int) -> tuple[Any, Any]:
        envs = _common.make_vec_env("CartPole-v1", num)
        obs, _ = envs.reset(seed=3)
        return envs, obs

    class Whole:  # hides `.envs`: replay_envs steps the vector env itself
        def __init__(self, envs: Any) -> None:
            self.step, self.reset = envs.step, envs.reset

    actions = np.random.default_rng(0).integers(2, size=(300, 3))  # several episodes end
    fast, obs = fresh(3)
    slow, obs2 = fresh(3)
    a = resume.replay_envs(fast, obs, actions)
    b = resume.replay_envs(Whole(slow), obs2, actions)
    assert a.dtype == b.dtype and np.array_equal(a, b)
    # and both go on in step: the vector env was left consistent by the fast path
    step_a = fast.step(actions[0])
    step_b = slow.step(actions[0])
    assert all(np.array_equal(x, y) for x, y in zip(step_a[:4], step_b[:4], strict=True))
