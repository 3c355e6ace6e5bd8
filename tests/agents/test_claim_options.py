"""The agents' options for the proposed PER variants: each does what it says.

Config fields ``beta_schedule``, ``weight_norm``, ``alpha_end``, ``switch_at``,
``priority_noise_late``, ``grad_clip_is`` and ``new_priority`` (see
:mod:`fastper.agents.replay`). Their defaults must build the buffer and take
the gradient steps of the paper's recipe exactly as before they existed.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gymnasium")

from fastper import PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer, schedules  # noqa: E402
from fastper.agents import _common, dqn, replay, resume, sac  # noqa: E402
from fastper.agents.runner import parse_overrides  # noqa: E402
from fastper.checkpoint import read_state, write_state  # noqa: E402

NEW_FIELDS = {
    "beta_schedule": "linear",
    "weight_norm": "buffer",
    "alpha_end": None,
    "switch_at": 0.0,
    "priority_noise_late": 0.0,
    "grad_clip_is": 0.0,
    "new_priority": "ever",
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def envs() -> Any:
    e = _common.make_vec_env("CartPole-v1", 1)
    yield e
    e.close()


def cfg(**kw: Any) -> dqn.DQNConfig:
    """3,000 steps, learning from 500, a phase every 2 steps: 1,250 sample calls."""
    settings: dict[str, Any] = dict(total_steps=3000, learning_starts=500, buffer_size=1000)
    settings.update(kw)
    return dqn.DQNConfig(**settings)


def fill(buf: Any, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(n):
        buf.add(
            {
                "obs": rng.normal(size=(1, 4)).astype(np.float32),
                "action": rng.integers(2, size=1),
                "reward": np.ones(1, np.float32),
                "next_obs": rng.normal(size=(1, 4)).astype(np.float32),
                "terminated": np.zeros(1, bool),
                "truncated": np.zeros(1, bool),
            }
        )


# -- the defaults are the old recipe -------------------------------------------------


def test_every_new_field_has_its_default_in_both_configs() -> None:
    for config in (dqn.DQNConfig(), sac.SACConfig()):
        for name, value in NEW_FIELDS.items():
            assert getattr(config, name) == value, (type(config).__name__, name)


@pytest.mark.parametrize("kind", ["uniform", "per", "rank"])
def test_defaults_build_the_buffer_the_committed_code_built(kind: str, envs: Any) -> None:
    """Same settings, schedules and sampled batches as the construction before the options."""
    config = cfg(replay=kind, seed=5)
    new = _common.agent_replay(config, envs)
    # the construction of make_replay before the options existed, spelled out
    fields = new.storage.fields
    common: dict[str, Any] = dict(n_step=1, gamma=0.99, seed=5, eps=1e-6, n_envs=1, autoreset=None)
    old: Any
    if kind == "uniform":
        old = ReplayBuffer(1000, fields, **common)
    else:
        cls: Any = PrioritizedReplayBuffer if kind == "per" else RankBasedReplayBuffer
        beta = schedules.linear(cls._default_beta, 1.0, 1250)
        old = cls(1000, fields, alpha=cls._default_alpha, beta=beta, **common)
    sd_new, sd_old = new.state_dict(), old.state_dict()
    assert sd_new["settings"] == sd_old["settings"]
    assert sd_new["schedules"] == sd_old["schedules"]
    for buf in (new, old):
        fill(buf, 50)
    for _ in range(5):
        a, b = new.sample(16), old.sample(16)
        assert np.array_equal(a.indices, b.indices) and np.array_equal(a.weights, b.weights)
        td = np.abs(a.weights - 0.3) + np.arange(16) / 7
        new.update_priorities(a.indices, td, keys=a.keys)
        old.update_priorities(b.indices, td, keys=b.keys)


def test_grad_clip_off_is_the_max_grad_norm_clip() -> None:
    w = torch.tensor([0.2, 0.9])
    assert replay.clip_threshold(10.0, 0.0, w) == 10.0
    assert replay.clip_threshold(10.0, 0.5, w) == pytest.approx(0.45)
    assert replay.clip_threshold(0.1, 0.5, w) == 0.1  # in addition: the smaller wins
    assert replay.clip_threshold(math.inf, 0.5, w) == pytest.approx(0.45)


# -- each option ---------------------------------------------------------------------


def test_cosine_beta_follows_the_half_cosine(envs: Any) -> None:
    lin = _common.agent_replay(cfg(beta0=0.4), envs)
    cos = _common.agent_replay(cfg(beta0=0.4, beta_schedule="cosine"), envs)
    assert cos.state_dict()["schedules"]["beta"] == {
        "kind": "cosine", "start": 0.4, "end": 1.0, "steps": 1250,
    }  # fmt: skip
    for buf in (lin, cos):
        buf.step = 1250 // 4
    quarter = 1.0 - 0.6 * 0.5 * (1.0 + math.cos(math.pi * 312 / 1250))
    assert cos.beta == pytest.approx(quarter) and cos.beta < lin.beta
    for buf in (lin, cos):
        buf.step = 625  # mid-run: the two agree
    assert cos.beta == pytest.approx(0.7) and lin.beta == pytest.approx(0.7)
    for buf in (lin, cos):
        buf.step = 1250
    assert cos.beta == pytest.approx(1.0) and lin.beta == pytest.approx(1.0)


def test_batch_weight_norm_divides_by_the_batch_max(envs: Any) -> None:
    buf = _common.agent_replay(cfg(weight_norm="batch"), envs)
    assert buf.state_dict()["settings"]["weight_norm"] == "batch"
    fill(buf, 200)
    first = buf.sample(8)
    buf.update_priorities(first.indices, np.linspace(0.01, 5.0, 8), keys=first.keys)
    batch = buf.sample(8)
    assert batch.weights.max() == pytest.approx(1.0)
    n, beta = len(buf), batch.beta  # (the schedule's beta at this sample's step)
    raw = (n * batch.probabilities) ** -beta
    assert np.allclose(batch.weights, raw / raw.max(), rtol=1e-12)


def test_alpha_end_moves_alpha_linearly_over_the_run(envs: Any) -> None:
    buf = _common.agent_replay(cfg(alpha=0.4, alpha_end=0.8), envs)
    sd = buf.state_dict()
    assert sd["schedules"]["alpha"] == {"kind": "linear", "start": 0.4, "end": 0.8, "steps": 1250}
    # buffer default for 1,000 slots: ceil(1000 / 256) = 4 samples between changes
    assert sd["settings"]["alpha_every"] == 4 == replay.alpha_every(1000, 1250)
    assert replay.alpha_every(1000, 2_000_000) == 2000  # long runs: 1,000 changes at most
    fill(buf, 20)
    assert buf.alpha == pytest.approx(0.4)
    buf.step = 1250  # alpha moves at multiples of alpha_every: the schedule at 1248
    assert buf.alpha == pytest.approx(0.4 + 0.4 * 1248 / 1250)
    buf.step = 1252
    assert buf.alpha == pytest.approx(0.8)
    buf.step = 625
    assert buf.alpha == pytest.approx(0.6, abs=0.002)
    # the rank-based scheme starts from its paper default 0.7
    rank = _common.agent_replay(cfg(replay="rank", alpha_end=0.9), envs)
    assert rank.state_dict()["schedules"]["alpha"]["start"] == 0.7


def test_hybrid_samples_rank_based_then_proportional_with_late_noise(envs: Any) -> None:
    config = cfg(replay="rank", switch_at=0.5, priority_noise_late=0.3)
    # env step 1500: phases at 502, 504, ..., 1500 -> 500 sample calls before the switch
    assert _common.samples_by(config, 1500) == 500
    buf = _common.agent_replay(config, envs)
    sd = buf.state_dict()
    noise = sd["schedules"]["priority_noise"]
    assert noise == {"kind": "step", "boundaries": [501], "values": [0.0, 0.3]}
    fill(buf, 100)
    td = np.linspace(0.1, 3.0, 100)
    buf.update_priorities(np.arange(100), td)
    p = td + 1e-6
    buf.step = 499
    assert buf.scheme == "rank"
    batch = buf.sample(8)  # the last rank-based one
    ranks = np.argsort(np.argsort(-p)) + 1
    rank_prob = ranks.astype(float) ** -0.7 / np.sum(np.arange(1, 101, dtype=float) ** -0.7)
    assert np.allclose(batch.probabilities, rank_prob[batch.indices])
    assert buf.scheme == "rank" and buf.step == 500
    batch = buf.sample(8)  # the switch: proportional, alpha the paper's 0.6
    assert buf.scheme == "proportional" and buf.alpha == pytest.approx(0.6)
    prop = p**0.6 / np.sum(p**0.6)
    assert np.allclose(batch.probabilities, prop[batch.indices])
    # the update of the first proportional batch is the first noisy one
    sched = schedules.from_dict(noise)
    assert sched(500) == 0.0 and sched(501) == 0.3 and buf.step == 501
    before = buf.priorities(batch.indices)
    buf.update_priorities(batch.indices, np.ones(8))
    after = buf.priorities(batch.indices)
    assert not np.allclose(after, 1.0 + 1e-6) and not np.array_equal(before, after)


def test_hybrid_switches_at_that_env_step_in_a_training_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, int, str]] = []
    real = _common.Collector.step

    def record(self: Any, t: int, actions: Any) -> None:
        real(self, t, actions)  # recorded before the training phase of step t
        seen.append((t, self.buffer.step, self.buffer.scheme))

    monkeypatch.setattr(_common.Collector, "step", record)
    config = dqn.DQNConfig(
        total_steps=300, learning_starts=100, buffer_size=300, batch_size=8, hidden=(8,),
        replay="rank", switch_at=0.5, eval_every=0, checkpoint_every=0,
    )  # fmt: skip
    dqn.train(config, None, progress=False)
    at = {t: (step, scheme) for t, step, scheme in seen}
    # the switch at env step 150: phases at 102 .. 150 (25 samples) rank, later proportional
    assert _common.samples_by(config, 150) == 25
    assert at[150] == (24, "rank")
    assert at[152] == (25, "rank")  # the next sample switches
    assert at[154] == (26, "proportional")
    assert at[300] == (99, "proportional")


def test_new_priority_max_td_is_the_largest_held_td_plus_eps(envs: Any) -> None:
    ever = _common.agent_replay(cfg(priority_eps=1e-5), envs)
    held = _common.agent_replay(cfg(priority_eps=1e-5, new_priority="max_td"), envs)
    assert held.state_dict()["settings"]["max_priority"] == "current"
    for buf in (ever, held):
        fill(buf, 4)
        buf.update_priorities(np.arange(4), [0.3, 2.0, 0.1, 0.7])
        fill(buf, 1)
    assert held.priorities([4])[0] == pytest.approx(2.0 + 1e-5, abs=1e-12)
    for buf in (ever, held):
        buf.update_priorities(np.arange(5), [0.3, 0.05, 0.1, 0.7, 0.2])
        fill(buf, 1)
    assert held.priorities([5])[0] == pytest.approx(0.7 + 1e-5, abs=1e-12)
    assert ever.priorities([5])[0] == pytest.approx(2.0 + 1e-5, abs=1e-12)  # the paper's


def test_new_priority_last_td_is_the_latest_batch_max_plus_eps(envs: Any) -> None:
    last = _common.agent_replay(cfg(priority_eps=1e-5, new_priority="last_td"), envs)
    held = _common.agent_replay(cfg(priority_eps=1e-5, new_priority="max_td"), envs)
    assert last.state_dict()["settings"]["max_priority"] == "last"
    for buf in (last, held):
        fill(buf, 4)
        buf.update_priorities(np.arange(4), [0.3, 2.0, 0.1, 0.7])
        buf.update_priorities([2], [0.05])  # the latest batch: its max, not the held 2.0
        fill(buf, 1)
    assert last.priorities([4])[0] == pytest.approx(0.05 + 1e-5, abs=1e-12)
    assert held.priorities([4])[0] == pytest.approx(2.0 + 1e-5, abs=1e-12)


def linear_q_step(weights: list[float], grad_clip_is: float, max_grad_norm: float) -> Any:
    """One td_step of a linear Q-network with SGD(lr=1): returns (change, gradient by hand)."""
    torch.manual_seed(0)
    q = dqn.QNetwork(2, 2, (), dueling=False)  # Q(s, a) = W[a] . s + b[a]
    q_target = copy.deepcopy(q)
    obs = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [3.0, -1.0]])
    action = torch.tensor([0, 1, 0])
    reward = torch.tensor([40.0, -30.0, 0.2])
    w = torch.tensor(weights)
    batch = {
        "obs": obs, "action": action, "reward": reward, "next_obs": obs,
        "terminated": torch.ones(3, dtype=torch.bool), "weights": w,
    }  # fmt: skip
    W, b = q.head.weight.detach().clone(), q.head.bias.detach().clone()
    # by hand: target = r (terminal); d/dq of the mean weighted Huber loss = w clamp(delta) / B
    q_sa = (W[action] * obs).sum(1) + b[action]
    g = w * torch.clamp(q_sa - reward, -1.0, 1.0) / 3
    gW, gb = torch.zeros_like(W), torch.zeros_like(b)
    for i in range(3):
        gW[action[i]] += g[i] * obs[i]
        gb[action[i]] += g[i]
    hand = torch.cat([gW.reshape(-1), gb])
    opt = torch.optim.SGD(q.parameters(), lr=1.0)
    dqn.td_step(q, q_target, opt, batch, 0.99, max_grad_norm, grad_clip_is)
    change = torch.cat([(W - q.head.weight).reshape(-1), b - q.head.bias]).detach()
    return change, hand


def test_grad_clip_is_clips_at_the_batch_max_weight_times_c() -> None:
    change, hand = linear_q_step([1.0, 0.5, 0.25], 0.0, math.inf)
    assert torch.allclose(change, hand, atol=1e-6)  # no clip: the gradient by hand
    norm = float(hand.norm())
    assert norm > 0.5  # the clips below bind
    for weights in ([1.0, 0.5, 0.25], [0.4, 0.2, 0.1]):
        change, hand = linear_q_step(weights, 0.5, 10.0)
        limit = 0.5 * max(weights)
        raw = float(hand.norm())
        expect = hand * min(1.0, limit / (raw + 1e-6))
        assert torch.allclose(change, expect, atol=1e-6)
        assert float(change.norm()) == pytest.approx(min(raw, limit), rel=1e-4)
    # max_grad_norm smaller than c * max w: max_grad_norm wins
    change, hand = linear_q_step([1.0, 0.5, 0.25], 0.5, 0.1)
    assert float(change.norm()) == pytest.approx(0.1, rel=1e-4)


def test_sac_grad_clip_is_clips_the_critics() -> None:
    torch.manual_seed(0)
    config = sac.SACConfig(hidden=(8,), grad_clip_is=0.5)
    st = sac.make_state(3, 1, np.array([-2.0]), np.array([2.0]), config, torch.device("cpu"))
    before = [p.detach().clone() for p in st.critic.parameters()]
    st.critic_opt = torch.optim.SGD(st.critic.parameters(), lr=1.0)
    batch = {
        "obs": torch.randn(6, 3), "action": torch.rand(6, 1), "next_obs": torch.randn(6, 3),
        "reward": torch.full((6,), 50.0), "terminated": torch.zeros(6, dtype=torch.bool),
        "weights": torch.tensor([0.2, 0.6, 0.4, 0.1, 0.3, 0.5]),
    }  # fmt: skip
    sac.update(st, batch, 0.99, 0.005, config.grad_clip_is)
    moved = torch.cat(
        [(a - p.detach()).reshape(-1) for a, p in zip(before, st.critic.parameters(), strict=True)]
    )
    assert float(moved.norm()) == pytest.approx(0.5 * 0.6, rel=1e-4)


def test_sac_runs_with_every_option(tmp_path: Path) -> None:
    config = sac.SACConfig(
        total_steps=120, learning_starts=60, buffer_size=200, batch_size=8, hidden=(8,),
        replay="rank", beta_schedule="cosine", weight_norm="batch", alpha_end=0.9,
        switch_at=0.75, priority_noise_late=0.2, grad_clip_is=0.5, new_priority="max_td",
        eval_every=0, checkpoint_every=0,
    )  # fmt: skip
    res = sac.train(config, None, progress=False)
    assert res.steps == 120


# -- the command line and bad values -------------------------------------------------


def test_set_reads_every_new_field() -> None:
    got = parse_overrides(
        dqn.DQNConfig,
        [
            "beta_schedule=cosine", "weight_norm=batch", "alpha_end=0.8", "switch_at=0.25",
            "priority_noise_late=0.1", "grad_clip_is=0.5", "new_priority=max_td",
        ],
    )  # fmt: skip
    assert got == {
        "beta_schedule": "cosine", "weight_norm": "batch", "alpha_end": 0.8, "switch_at": 0.25,
        "priority_noise_late": 0.1, "grad_clip_is": 0.5, "new_priority": "max_td",
    }  # fmt: skip
    assert parse_overrides(sac.SACConfig, ["alpha_end=none"]) == {"alpha_end": None}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"beta_schedule": "exp"}, r"`beta_schedule` must be one of \['linear', 'cosine'\]"),
        ({"weight_norm": "none"}, r"`weight_norm` must be one of \['buffer', 'batch'\]"),
        ({"new_priority": "max"}, r"`new_priority` must be one of \['ever', 'max_td', 'last_td'\]"),
        ({"alpha_end": -0.1}, r"`alpha_end` must be None or a number >= 0, got alpha_end=-0.1"),
        ({"grad_clip_is": -1.0}, r"`grad_clip_is` must be a number >= 0 \(0: off\)"),
        ({"grad_clip_is": math.nan}, r"`grad_clip_is` must be a number >= 0"),
        ({"switch_at": 1.0}, r"`switch_at` must be in \[0, 1\) \(0: never\), got switch_at=1.0"),
        ({"switch_at": 0.5}, r"needs replay='rank', got replay='per'"),
        ({"switch_at": 0.1, "replay": "rank"}, r"must put the switch after learning_starts"),
        ({"priority_noise_late": 0.2}, r"`priority_noise_late` > 0 .* needs switch_at > 0"),
        ({"priority_noise_late": -1.0}, r"`priority_noise_late` must be a number >= 0"),
    ],
)
def test_bad_values_are_refused(settings: dict[str, Any], message: str) -> None:
    for make in (cfg, lambda **kw: sac.SACConfig(total_steps=3000, **kw)):
        with pytest.raises(ValueError, match=message):
            make(**settings)


# -- resuming checkpoints written before the fields existed --------------------------


def test_config_differences_take_a_missing_field_as_its_default() -> None:
    saved = resume.config_record(cfg())
    for name in NEW_FIELDS:
        del saved[name]
    assert resume.config_differences(saved, cfg()) == []
    differ = resume.config_differences(saved, cfg(beta_schedule="cosine"))
    assert differ == [
        "beta_schedule='linear' (now 'cosine') (the checkpoint predates the field: its default)"
    ]
    saved["gone"] = 1  # a field the config no longer has still counts
    assert resume.config_differences(saved, cfg()) == ["gone=1 (now '<missing>')"]


def test_an_old_checkpoint_resumes_with_the_defaults_and_is_refused_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = dqn.DQNConfig(
        total_steps=300, learning_starts=100, buffer_size=300, batch_size=8, hidden=(8,),
        eval_every=150, eval_episodes=1, eval_max_steps=30, checkpoint_every=100,
    )  # fmt: skip
    whole = dqn.train(config, tmp_path / "whole", progress=False)
    real = _common.Collector.step

    def die(self: Any, t: int, actions: Any) -> None:
        if t > 220:
            raise KeyboardInterrupt
        real(self, t, actions)

    monkeypatch.setattr(_common.Collector, "step", die)
    run = tmp_path / "old"
    with pytest.raises(KeyboardInterrupt):
        dqn.train(config, run, progress=False)
    monkeypatch.setattr(_common.Collector, "step", real)
    # make it a checkpoint of the code before the fields: its config lacks them
    path = resume.latest(run)
    assert path is not None
    state, _ = read_state(path / resume.RUN_FILE)
    for name in NEW_FIELDS:
        del state["run"]["config"][name]
    write_state(path / resume.RUN_FILE, state)
    for name, value in (("grad_clip_is", 0.5), ("new_priority", "max_td")):
        changed = dqn.DQNConfig(**{**config.__dict__, name: value})
        with pytest.raises(resume.ResumeError, match=f"{name}=.*predates the field"):
            dqn.train(changed, run, progress=False, resume=True)
    again = dqn.train(config, run, progress=False, resume=True)
    assert again.returns == whole.returns and again.eval_returns == whole.eval_returns


def test_a_hybrid_run_with_every_option_resumes_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pending switch, the alpha and noise schedules survive a checkpoint before the switch."""
    config = dqn.DQNConfig(
        total_steps=300, learning_starts=100, buffer_size=300, batch_size=8, hidden=(8,),
        replay="rank", switch_at=0.6, priority_noise_late=0.2, alpha_end=0.9,
        beta_schedule="cosine", weight_norm="batch", grad_clip_is=0.5, new_priority="max_td",
        eval_every=150, eval_episodes=1, eval_max_steps=30, checkpoint_every=100,
    )  # fmt: skip
    whole = dqn.train(config, tmp_path / "whole", progress=False)
    real = _common.Collector.step

    def die(self: Any, t: int, actions: Any) -> None:
        if t > 140:  # checkpoint at 100, before the switch at 180
            raise KeyboardInterrupt
        real(self, t, actions)

    monkeypatch.setattr(_common.Collector, "step", die)
    with pytest.raises(KeyboardInterrupt):
        dqn.train(config, tmp_path / "b", progress=False)
    monkeypatch.setattr(_common.Collector, "step", real)
    again = dqn.train(config, tmp_path / "b", progress=False, resume=True)
    assert again.returns == whole.returns and again.eval_returns == whole.eval_returns
    a = resume.latest(tmp_path / "whole")
    b = resume.latest(tmp_path / "b")
    assert a is not None and b is not None
    assert (a / resume.BUFFER_FILE).read_bytes() == (b / resume.BUFFER_FILE).read_bytes()
