"""fastper.compat.torchrl's samplers, driven through TorchRL's own replay-buffer API.

The oracles: the storage (a sampled row must be the row stored at the
sampled index), the exact law (P(i) from the priorities given, by numpy),
the IS-weight formula of the paper with TorchRL's normalisation, and the
write generations TorchRL's own round-robin writer keeps.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torchrl", reason="the torchrl extra is not installed")
pytest.importorskip("scipy")

import torch  # noqa: E402
from scipy import stats  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyMemmapStorage,
    LazyTensorStorage,
    ListStorage,
    PrioritizedReplayBuffer,
    ReplayBuffer,
    RoundRobinWriter,
    TensorDictMaxValueWriter,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers.scheduler import LinearScheduler  # noqa: E402

from fastper.compat.torchrl import (  # noqa: E402
    PrioritizedSampler,
    RankBasedSampler,
    TensorDictPrioritizedReplayBuffer,
    UniformSampler,
)
from fastper.errors import (  # noqa: E402
    CheckpointError,
    EmptyBufferError,
    InvalidIndexError,
    ZeroPriorityError,
)

from ..oracles import proportional_probs, rank_probs  # noqa: E402


def td_rows(start: int, k: int) -> TensorDict:
    """``k`` rows whose "obs" is their insertion number."""
    t = torch.arange(start, start + k)
    return TensorDict({"obs": t.float(), "step": t}, [k])


def td_buffer(cap: int, sampler: PrioritizedSampler, seed: int = 0) -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(
        storage=LazyTensorStorage(cap),
        sampler=sampler,
        priority_key="td_error",
        generator=torch.Generator().manual_seed(seed),
    )


def state_of(sampler: PrioritizedSampler) -> dict:
    out = {}
    for k, v in sampler.state_dict().items():
        out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return False
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def draw_counts(rb: ReplayBuffer, n_slots: int, draws: int, batch: int) -> np.ndarray:
    counts = np.zeros(n_slots, dtype=np.int64)
    for _ in range(draws // batch):
        _, info = rb.sample(batch, return_info=True)
        counts += np.bincount(info["index"].numpy(), minlength=n_slots)
    return counts


# -- plugging into TorchRL's buffers ------------------------------------------------------
@pytest.mark.parametrize("cls", [PrioritizedSampler, RankBasedSampler, UniformSampler])
def test_tensordict_buffer_rows_match_storage(cls: type) -> None:
    rb = td_buffer(32, cls(32, 0.6, 0.4))
    for step in range(5):
        rb.extend(td_rows(10 * step, 10))  # wraps after 32 rows
        sample = rb.sample(16)
        assert set(sample.keys()) >= {"obs", "index", "priority_weight", "slot_generation"}
        stored = rb.storage.get(sample["index"])
        assert torch.equal(sample["obs"], stored["obs"])
        assert sample["priority_weight"].dtype == torch.float32
        sample.set("td_error", torch.rand(16))
        rb.update_tensordict_priority(sample)
    assert len(rb) == 32


def test_memmap_storage(tmp_path) -> None:
    rb = TensorDictReplayBuffer(
        storage=LazyMemmapStorage(20, scratch_dir=tmp_path),
        sampler=PrioritizedSampler(20, 0.6, 0.4),
        batch_size=8,
    )
    rb.extend(td_rows(0, 25))
    sample = rb.sample()
    assert torch.equal(sample["obs"], rb.storage.get(sample["index"])["obs"])
    sample.set("td_error", torch.rand(8))
    rb.update_tensordict_priority(sample)


@pytest.mark.parametrize("cls", [PrioritizedSampler, RankBasedSampler, UniformSampler])
def test_replay_buffer_with_list_storage(cls: type) -> None:
    rb = ReplayBuffer(storage=ListStorage(6), sampler=cls(6, 0.7, 0.5))
    for i in range(9):  # add one by one: slots 0..5, then 0..2 again
        assert rb.add(torch.tensor(i)) == i % 6
    data, info = rb.sample(8, return_info=True)
    expected = torch.tensor([6, 7, 8, 3, 4, 5])[info["index"]]
    assert torch.equal(data, expected)
    rb.update_priority(info["index"], torch.linspace(0.1, 2.0, 8))


def test_torchrl_prioritized_replay_buffer_takes_the_sampler() -> None:
    sampler = PrioritizedSampler(10, 1.0, 0.5, eps=0.0)
    rb = PrioritizedReplayBuffer(alpha=0.7, beta=0.9, storage=ListStorage(10), sampler=sampler)
    rb.extend([torch.tensor(i) for i in range(10)])
    data, info = rb.sample(5, return_info=True)
    assert torch.equal(data, info["index"])  # item i lives in slot i
    rb.update_priority(info["index"], torch.full((5,), 5.0))
    p = sampler.state_dict()["priorities"].numpy()
    hit = np.unique(info["index"].numpy())
    np.testing.assert_array_equal(p[hit], 5.0)
    np.testing.assert_array_equal(np.delete(p, hit), 1.0)


def test_generations_follow_torchrl_writer() -> None:
    """The slot generations the sampler reports equal TorchRL's own writer's stamps."""
    sampler = PrioritizedSampler(8, 0.5, 0.5)
    rb = ReplayBuffer(
        storage=LazyTensorStorage(8),
        sampler=sampler,
        writer=RoundRobinWriter(track_generations=True),
        generator=torch.Generator().manual_seed(3),
    )
    for k in (5, 7, 12, 3):  # 12 > capacity: slots written twice in one call
        rb.extend(torch.arange(k))
        _, info = rb.sample(64, return_info=True)
        assert torch.equal(info["index_generation"], info["slot_generation"])


def test_buffer_over_a_filled_shared_storage() -> None:
    """A buffer built over a storage that already holds items takes them (TorchRL gives
    them the default priority), and sees the other buffer's writes to the shared storage."""
    storage = LazyTensorStorage(8)
    first = ReplayBuffer(storage=storage, sampler=PrioritizedSampler(8, 1.0, 0.4))
    first.extend(torch.arange(5))
    second = ReplayBuffer(storage=storage, sampler=PrioritizedSampler(8, 1.0, 0.4, eps=0.0))
    state = second.sampler.state_dict()
    np.testing.assert_array_equal(state["priorities"].numpy(), [1.0] * 5 + [0.0] * 3)
    np.testing.assert_array_equal(state["generation"].numpy(), [0] * 5 + [-1] * 3)
    first.extend(torch.arange(10, 15))  # slots 5, 6, 7, 0, 1
    for rb in (first, second):
        gen = rb.sampler.state_dict()["generation"].numpy()
        np.testing.assert_array_equal(gen, [1, 1, 0, 0, 0, 0, 0, 0])
    data, info = second.sample(32, return_info=True)
    assert torch.equal(data, storage.get(info["index"]))


@pytest.mark.parametrize("cls", [PrioritizedSampler, RankBasedSampler])
def test_wrap_around_resets_overwritten_slots_only(cls: type) -> None:
    sampler = cls(6, 1.0, 0.0, eps=0.0)
    rb = td_buffer(6, sampler)
    rb.extend(td_rows(0, 6))
    rb.update_priority(
        torch.arange(6), torch.tensor([0.1, 0.2, 0.3, 0.4, 9.0, 0.6], dtype=torch.float64)
    )
    rb.extend(td_rows(6, 4))  # the ring wraps: slots 0..3 hold rows 6..9
    state = sampler.state_dict()
    np.testing.assert_array_equal(state["priorities"].numpy(), [9.0] * 4 + [9.0, 0.6])
    np.testing.assert_array_equal(state["generation"].numpy(), [1, 1, 1, 1, 0, 0])
    sample = rb.sample(64)
    assert torch.equal(sample["obs"], rb.storage.get(sample["index"])["obs"])
    assert torch.equal(sample["slot_generation"], (sample["index"] < 4).long())


def test_max_value_writer_skips_rows_not_written() -> None:
    """TorchRL's TensorDictMaxValueWriter marks rows it does not keep with index -1."""
    sampler = PrioritizedSampler(4, 1.0, 0.5, eps=0.0)
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(4),
        sampler=sampler,
        writer=TensorDictMaxValueWriter(rank_key="reward"),
        priority_key="td_error",
    )
    rows = {
        "reward": torch.tensor([1.0, 5.0, 3.0, 2.0]),
        "td_error": torch.tensor([0.1, 0.2, 0.3, 0.4]),
    }
    rb.extend(TensorDict(rows, [4]))
    more = {"reward": torch.tensor([0.5, 6.0, 0.1]), "td_error": torch.tensor([9.0, 8.0, 7.0])}
    index = rb.extend(TensorDict(more, [3]))
    assert index.tolist() == [-1, 0, -1]  # only the reward-6 row replaced the reward-1 row
    state = sampler.state_dict()
    np.testing.assert_allclose(state["priorities"].numpy(), [8.0, 0.2, 0.3, 0.4])
    np.testing.assert_array_equal(state["generation"].numpy(), [1, 0, 0, 0])


def test_new_items_get_max_priority_ever() -> None:
    sampler = PrioritizedSampler(10, 1.0, 0.0, eps=0.01)
    rb = td_buffer(10, sampler)
    rb.extend(td_rows(0, 4))
    assert sampler.default_priority == 1.0  # before any update, as in TorchRL
    rb.update_priority(torch.tensor([0, 1, 2, 3]), torch.tensor([0.5, 7.0, 0.1, 0.2]))
    rb.update_priority(torch.tensor([1]), torch.tensor([0.3]))  # the max is remembered
    rb.extend(td_rows(4, 2))
    p = sampler.state_dict()["priorities"].numpy()
    np.testing.assert_array_equal(p[4:6], [7.0 + 0.01] * 2)
    assert sampler.default_priority == 7.0


def test_new_items_get_max_priority_within_buffer() -> None:
    sampler = PrioritizedSampler(4, 1.0, 0.0, eps=0.0, max_priority_within_buffer=True)
    rb = td_buffer(4, sampler)
    rb.extend(td_rows(0, 4))
    rb.update_priority(torch.arange(4), torch.tensor([9.0, 2.0, 3.0, 1.0]))
    rb.extend(td_rows(4, 1))  # overwrites slot 0, the one holding 9
    p = sampler.state_dict()["priorities"].numpy()
    assert p[0] == 3.0  # the largest priority still held by another item
    assert sampler.default_priority == 3.0


def test_priority_key_at_extend_and_add() -> None:
    sampler = PrioritizedSampler(8, 1.0, 0.0, eps=0.0)
    rb = td_buffer(8, sampler)
    rows = td_rows(0, 3)
    rows.set("td_error", torch.tensor([0.5, 1.5, 2.5]))
    rb.extend(rows)
    one = TensorDict(
        {"obs": torch.tensor(9.0), "step": torch.tensor(9), "td_error": torch.tensor(4.0)}, []
    )
    rb.add(one)
    p = sampler.state_dict()["priorities"].numpy()
    np.testing.assert_array_equal(p[:4], [0.5, 1.5, 2.5, 4.0])


@pytest.mark.parametrize("cls", [PrioritizedSampler, RankBasedSampler, UniformSampler])
@pytest.mark.parametrize("within", [False, True])
def test_duplicate_slots_last_value_wins(cls: type, within: bool) -> None:
    sampler = cls(4, 1.0, 0.0, eps=0.0, max_priority_within_buffer=within)
    rb = td_buffer(4, sampler)
    rb.extend(td_rows(0, 4))
    rb.update_priority(torch.arange(4), torch.full((4,), 0.5))
    rb.update_priority(torch.tensor([2, 1, 2, 2]), torch.tensor([5.0, 1.0, 0.25, 3.0]))
    p = sampler.state_dict()["priorities"].numpy()
    np.testing.assert_array_equal(p, [0.5, 1.0, 3.0, 0.5])
    if within:  # the largest priority held is 3.0, not the 5.0 that was replaced
        assert sampler.default_priority == 3.0


# -- the sampling law -------------------------------------------------------------------
PRIORITIES = np.array([0.05, 0.3, 1.0, 2.5, 0.7, 0.0, 4.0, 1.2, 0.9, 3.3, 0.15, 2.0])


def filled_buffer(sampler: PrioritizedSampler, seed: int) -> ReplayBuffer:
    rb = ReplayBuffer(
        storage=LazyTensorStorage(16),
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed),
    )
    rb.extend(torch.arange(len(PRIORITIES)))  # 12 of 16 slots
    rb.update_priority(torch.arange(len(PRIORITIES)), torch.as_tensor(PRIORITIES))
    return rb


@pytest.mark.parametrize(
    ("make", "law"),
    [
        (
            lambda: PrioritizedSampler(16, 0.7, 0.4, eps=0.01),
            lambda p: proportional_probs(p + 0.01, 0.7),
        ),
        (
            lambda: PrioritizedSampler(16, 0.7, 0.4, eps=0.01, stratified=True),
            lambda p: proportional_probs(p + 0.01, 0.7),
        ),
        (lambda: RankBasedSampler(16, 0.9, 0.4, eps=0.01), lambda p: rank_probs(p + 0.01, 0.9)),
        (lambda: UniformSampler(16), lambda p: np.full(len(p), 1.0 / len(p))),
    ],
    ids=["proportional", "proportional-stratified", "rank", "uniform"],
)
def test_sampling_law_chi_square(make, law) -> None:
    sampler = make()
    rb = filled_buffer(sampler, seed=11)
    draws = 120_000
    counts = draw_counts(rb, 16, draws, batch=4_000)
    assert counts[12:].sum() == 0  # never-written slots are never drawn
    expected = law(PRIORITIES)
    _, pvalue = stats.chisquare(counts[:12], draws * expected)
    assert pvalue > 1e-3
    # the same counts tell a law 10% off apart: the test can fail
    wrong = expected * (1.0 + 0.1 * (-1.0) ** np.arange(12))
    wrong /= wrong.sum()
    _, pwrong = stats.chisquare(counts[:12], draws * wrong)
    assert pwrong < 1e-9
    # and the sampler's own probabilities are the law
    prob = sampler.probabilities(torch.arange(12), rb.storage).numpy()
    np.testing.assert_allclose(prob, expected, rtol=1e-12)


def test_zero_priority_never_drawn_with_eps_zero() -> None:
    rb = filled_buffer(PrioritizedSampler(16, 1.0, 0.0, eps=0.0), seed=2)
    counts = draw_counts(rb, 16, 20_000, batch=5_000)
    assert counts[5] == 0 and counts[:12].sum() == 20_000  # PRIORITIES[5] == 0


def test_torch_manual_seed_repeats_draws_without_generator() -> None:
    def run() -> torch.Tensor:
        rb = ReplayBuffer(storage=LazyTensorStorage(16), sampler=PrioritizedSampler(16, 0.6, 0.4))
        rb.extend(torch.arange(16))
        torch.manual_seed(123)
        return rb.sample(32, return_info=True)[1]["index"]

    assert torch.equal(run(), run())


# -- importance weights -------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
@pytest.mark.parametrize("cls", [PrioritizedSampler, RankBasedSampler])
def test_is_weights_equal_the_formula(cls: type, norm: str) -> None:
    alpha, beta, eps = 0.6, 0.7, 0.01
    sampler = cls(16, alpha, beta, eps=eps, dtype=torch.float64, weight_norm=norm)
    rb = filled_buffer(sampler, seed=5)
    _, info = rb.sample(256, return_info=True)
    idx = info["index"].numpy()
    law = proportional_probs if cls is PrioritizedSampler else rank_probs
    prob = law(PRIORITIES + eps, alpha)
    n = len(PRIORITIES)
    w_all = (n * prob) ** (-beta)
    w = w_all[idx]
    if norm == "buffer":
        w = w / w_all.max()
    elif norm == "batch":
        w = w / w.max()
    assert info["priority_weight"].dtype == torch.float64
    np.testing.assert_allclose(info["priority_weight"].numpy(), w, rtol=1e-12)


def test_weights_match_torchrl_normalisation() -> None:
    """TorchRL's sampler returns (p_i / p_min)^-beta over the tree values p = (prio + eps)^alpha."""
    alpha, beta, eps = 0.8, 0.5, 1e-8
    rb = filled_buffer(PrioritizedSampler(16, alpha, beta, eps=eps), seed=9)
    _, info = rb.sample(128, return_info=True)
    tree = (PRIORITIES + eps) ** alpha
    expected = (tree[info["index"].numpy()] / tree.min()) ** (-beta)
    np.testing.assert_allclose(info["priority_weight"].numpy(), expected, rtol=1e-6)


def test_beta_follows_torchrl_scheduler_and_alpha_reweights_exactly() -> None:
    sampler = PrioritizedSampler(16, 0.5, 0.4, eps=0.01)
    rb = filled_buffer(sampler, seed=1)
    sched = LinearScheduler(rb, param_name="beta", final_value=1.0, num_steps=4)
    for _ in range(4):
        sched.step()
    assert sampler.beta == pytest.approx(1.0)
    sampler.alpha = 0.9
    fresh = filled_buffer(PrioritizedSampler(16, 0.9, 1.0, eps=0.01), seed=1)
    idx = torch.arange(12)
    np.testing.assert_array_equal(
        sampler.probabilities(idx, rb.storage).numpy(),
        fresh.sampler.probabilities(idx, fresh.storage).numpy(),
    )


# -- stale updates --------------------------------------------------------------------------
def test_update_for_overwritten_slot_is_dropped() -> None:
    sampler = PrioritizedSampler(8, 1.0, 0.0, eps=0.0)
    rb = td_buffer(8, sampler, seed=4)
    rb.extend(td_rows(0, 8))
    sample = rb.sample(64)
    rb.extend(td_rows(8, 3))  # overwrites slots 0, 1, 2: they hold new items now
    sample.set("td_error", torch.full((64,), 0.25))
    rb.update_tensordict_priority(sample)
    p = sampler.state_dict()["priorities"].numpy()
    idx = sample["index"].numpy()
    overwritten = np.isin(idx, [0, 1, 2])
    assert overwritten.any() and (~overwritten).any()
    np.testing.assert_array_equal(p[[0, 1, 2]], [1.0, 1.0, 1.0])  # the new items keep the max
    np.testing.assert_array_equal(p[np.unique(idx[~overwritten])], 0.25)
    assert sampler.dropped_updates == int(overwritten.sum())


def test_update_through_info_index_and_explicit_generation() -> None:
    sampler = PrioritizedSampler(8, 1.0, 0.0, eps=0.0)
    rb = ReplayBuffer(storage=LazyTensorStorage(8), sampler=sampler)
    rb.extend(torch.arange(8))
    torch.manual_seed(0)
    _, info = rb.sample(32, return_info=True)
    rb.extend(torch.arange(2))  # slots 0 and 1 overwritten
    rb.update_priority(info["index"], torch.full((32,), 0.5))  # the tensor sample returned
    copy_index = info["index"].clone()  # a copy: the sampler cannot tell, unless told
    sampler.update_priority(copy_index, torch.full((32,), 0.75), generation=info["slot_generation"])
    p = sampler.state_dict()["priorities"].numpy()
    hit = np.unique(info["index"].numpy())
    assert p[0] == p[1] == 1.0
    np.testing.assert_array_equal(p[hit[hit > 1]], 0.75)


def test_copied_index_without_generation_is_taken_as_current() -> None:
    """The documented limit: an index the sampler did not hand out names the items there now."""
    sampler = PrioritizedSampler(4, 1.0, 0.0, eps=0.0)
    rb = td_buffer(4, sampler)
    rb.extend(td_rows(0, 4))
    sample = rb.sample(16).clone()  # new tensors
    rb.extend(td_rows(4, 4))
    sample.set("td_error", torch.full((16,), 0.5))
    rb.update_tensordict_priority(sample)
    p = sampler.state_dict()["priorities"].numpy()
    np.testing.assert_array_equal(p[np.unique(sample["index"].numpy())], 0.5)
    assert sampler.dropped_updates == 0


def test_prioritized_buffer_drops_stale_after_copy() -> None:
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=1.0, beta=0.5, eps=0.0, storage=LazyTensorStorage(8), batch_size=32,
        generator=torch.Generator().manual_seed(6),
    )  # fmt: skip
    rb.extend(td_rows(0, 8))
    sample = rb.sample().clone()  # e.g. sample.to(device) in a training loop
    rb.extend(td_rows(8, 2))
    sample.set("td_error", torch.full((32,), 0.5))
    rb.update_tensordict_priority(sample)
    p = rb.prioritized_sampler.state_dict()["priorities"].numpy()
    idx = sample["index"].numpy()
    assert p[0] == p[1] == 1.0
    np.testing.assert_array_equal(p[np.unique(idx[idx > 1])], 0.5)
    assert rb.prioritized_sampler.dropped_updates == int((idx <= 1).sum())


def test_prioritized_buffer_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match="sync"):
        TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, sync=False)
    with pytest.raises(TypeError, match="sampler"):
        TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, sampler=UniformSampler(8))
    with pytest.raises(ValueError, match="device"):
        TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, sampler_device="meta")


# -- state -------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [PrioritizedSampler, RankBasedSampler, UniformSampler])
@pytest.mark.parametrize("within", [False, True])
def test_state_dict_round_trip_through_torch_save(cls: type, within: bool, tmp_path) -> None:
    def build(seed: int) -> TensorDictReplayBuffer:
        return td_buffer(16, cls(16, 0.6, 0.4, eps=0.01, max_priority_within_buffer=within), seed)

    rb = build(0)
    for step in range(3):
        rb.extend(td_rows(7 * step, 7))
        sample = rb.sample(8)
        sample.set("td_error", torch.rand(8, generator=torch.Generator().manual_seed(step)))
        rb.update_tensordict_priority(sample)
    torch.save(rb.state_dict(), tmp_path / "rb.pt")
    loaded = build(99)
    loaded.load_state_dict(torch.load(tmp_path / "rb.pt", weights_only=True))
    assert same_state(state_of(rb.sampler), state_of(loaded.sampler))
    a, b = rb.sample(64), loaded.sample(64)  # the buffer's generator state travels too
    assert torch.equal(a["index"], b["index"])
    assert torch.equal(a["priority_weight"], b["priority_weight"])
    rb.extend(td_rows(100, 3))
    loaded.extend(td_rows(100, 3))  # new items get the same max priority
    assert same_state(state_of(rb.sampler), state_of(loaded.sampler))


@pytest.mark.parametrize("cls", [PrioritizedSampler, RankBasedSampler])
def test_dumps_loads_round_trip(cls: type, tmp_path) -> None:
    rb = td_buffer(16, cls(16, 0.6, 0.4))
    rb.extend(td_rows(0, 20))
    rb.update_priority(torch.arange(10), torch.linspace(0.0, 3.0, 10))
    rb.dumps(tmp_path / "rb")
    names = sorted(p.name for p in (tmp_path / "rb" / "sampler").iterdir())
    assert names == ["generation.npy", "priorities.npy", "sampler.json"]
    loaded = td_buffer(16, cls(16, 0.6, 0.4), seed=5)
    loaded.loads(tmp_path / "rb")
    assert same_state(state_of(rb.sampler), state_of(loaded.sampler))
    assert len(loaded) == 16


def test_loads_never_unpickles_and_refuses_damaged_files(tmp_path) -> None:
    sampler = PrioritizedSampler(8, 0.6, 0.4)
    rb = td_buffer(8, sampler)
    rb.extend(td_rows(0, 5))
    sampler.dumps(tmp_path / "s")
    before = state_of(sampler)
    # an object array (which only pickle can read) in place of the priorities
    np.save(tmp_path / "s" / "priorities.npy", np.array([{}] * 8, dtype=object), allow_pickle=True)
    with pytest.raises(CheckpointError, match="cannot read"):
        sampler.loads(tmp_path / "s")
    sampler.dumps(tmp_path / "t")
    (tmp_path / "t" / "sampler.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        sampler.loads(tmp_path / "t")
    assert same_state(before, state_of(sampler))


def test_load_refuses_bad_states_and_changes_nothing(tmp_path) -> None:
    sampler = PrioritizedSampler(8, 0.6, 0.4)
    rb = td_buffer(8, sampler)
    rb.extend(td_rows(0, 5))
    good = sampler.state_dict()
    before = state_of(sampler)
    bad_states = [
        {**good, "priorities": good["priorities"].clone().fill_(float("nan"))},
        {**good, "priorities": -good["priorities"]},
        {**good, "priorities": good["priorities"][:4]},
        {**good, "generation": good["generation"].float()},
        {**good, "capacity": 9},
        {**good, "kind": "rank"},
        {**good, "version": 0},
        {**good, "alpha": float("inf")},
        {k: v for k, v in good.items() if k != "eps"},
        {**good, "extra": 1},
        {**good, "held": good["priorities"]},  # this sampler keeps no held priorities
    ]
    priorities = good["priorities"].clone()
    priorities[7] = 1.0  # slot 7 was never written yet holds a priority
    bad_states.append({**good, "priorities": priorities})
    for bad in bad_states:
        with pytest.raises(CheckpointError):
            sampler.load_state_dict(bad)
        assert same_state(before, state_of(sampler))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="cannot read"):
        sampler.loads(tmp_path / "empty")
    rank = RankBasedSampler(8, 0.6, 0.4)
    hole = {
        **RankBasedSampler(8, 0.6, 0.4).state_dict(),
        "generation": torch.tensor([0, -1, 0, -1, -1, -1, -1, -1]),
    }
    with pytest.raises(CheckpointError, match="0 .. n-1"):
        rank.load_state_dict(hole)


def test_empty_resets_everything() -> None:
    sampler = PrioritizedSampler(8, 0.6, 0.4)
    rb = td_buffer(8, sampler)
    fresh = state_of(sampler)
    rb.extend(td_rows(0, 8))
    rb.update_priority(torch.arange(8), torch.linspace(0.0, 5.0, 8))
    sample = rb.sample(16)
    rb.extend(td_rows(8, 8))
    sample.set("td_error", torch.ones(16))
    rb.update_tensordict_priority(sample)
    assert sampler.dropped_updates == 16
    rb.empty()
    assert same_state(fresh, state_of(sampler))
    with pytest.raises(EmptyBufferError, match="empty storage"):
        rb.sample(4)


def test_deepcopy_goes_through_the_state() -> None:
    rb = td_buffer(8, RankBasedSampler(8, 0.6, 0.4, max_priority_within_buffer=True))
    rb.extend(td_rows(0, 6))
    rb.update_priority(torch.arange(6), torch.linspace(0.5, 3.0, 6))
    twin = copy.deepcopy(rb)
    assert type(twin.sampler) is RankBasedSampler
    assert same_state(state_of(rb.sampler), state_of(twin.sampler))
    assert twin.sampler.default_priority == rb.sampler.default_priority == 3.0


# -- bad input -----------------------------------------------------------------------------
def test_bad_updates_raise_and_change_nothing() -> None:
    sampler = PrioritizedSampler(8, 0.6, 0.4)
    rb = td_buffer(8, sampler)
    rb.extend(td_rows(0, 6))
    gen_state = rb._rng.get_state().clone()
    before = state_of(sampler)
    idx = torch.tensor([0, 1, 2])
    cases = [
        (idx, torch.tensor([1.0, float("nan"), 2.0]), ValueError, "finite"),
        (idx, torch.tensor([1.0, float("inf"), 2.0]), ValueError, "finite"),
        (idx, torch.tensor([1.0, -0.5, 2.0]), ValueError, ">= 0"),
        (idx, torch.tensor([1.0, 2.0]), ValueError, "one per index"),
        (idx, torch.ones(3, 2), ValueError, "one per index"),
        (idx, torch.tensor([True, False, True]), TypeError, "real numbers"),
        (torch.tensor([0.0, 1.0, 2.0]), torch.ones(3), TypeError, "integers"),
        (torch.tensor([[0, 1], [1, 2]]), torch.ones(2), ValueError, "ndim=1"),
        (torch.tensor([0, 8, 1]), torch.ones(3), InvalidIndexError, r"\[0, 8\)"),
        (torch.tensor([0, -2, 1]), torch.ones(3), InvalidIndexError, r"\[0, 8\)"),
        (torch.tensor([0, 7]), torch.ones(2), InvalidIndexError, "never-written"),
        (idx, torch.tensor([1.0, 1e308, 2.0]), ValueError, "finite"),
    ]
    for index, priority, error, match in cases:
        with pytest.raises(error, match=match):
            rb.update_priority(index, priority)
        assert same_state(before, state_of(sampler))
    with pytest.raises(ValueError, match="generation"):
        sampler.update_priority(idx, torch.ones(3), generation=torch.zeros(2, dtype=torch.long))
    assert same_state(before, state_of(sampler))
    assert torch.equal(rb._rng.get_state(), gen_state)  # no draw was spent


def test_bad_samples_raise_before_drawing() -> None:
    sampler = PrioritizedSampler(8, 1.0, 0.4, eps=0.0)
    rb = ReplayBuffer(storage=LazyTensorStorage(8), sampler=sampler)
    with pytest.raises(EmptyBufferError):
        rb.sample(4)
    rb.extend(torch.arange(3))
    rb.update_priority(torch.arange(3), torch.zeros(3))
    rng = torch.get_rng_state()
    with pytest.raises(ZeroPriorityError, match="zero"):
        rb.sample(4)
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(ValueError, match="max_capacity"):
        PrioritizedSampler(2, 1.0, 0.4).sample(rb.storage, 2)  # 3 items, 2 slots
    with pytest.raises(ValueError, match="ndim=1"):
        PrioritizedSampler(8, 1.0, 0.4).sample(LazyTensorStorage(8, ndim=2), 2)


def test_writer_index_beyond_capacity_is_refused() -> None:
    rb = td_buffer(16, PrioritizedSampler(8, 0.6, 0.4))
    with pytest.raises(InvalidIndexError, match="max_capacity=storage.max_size"):
        rb.extend(td_rows(0, 12))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_capacity": 0}, ValueError, "max_capacity"),
        ({"max_capacity": 4.0}, TypeError, "max_capacity"),
        ({"alpha": -0.1}, ValueError, "alpha"),
        ({"beta": float("nan")}, ValueError, "beta"),
        ({"eps": -1e-8}, ValueError, "eps"),
        ({"dtype": torch.int64}, TypeError, "dtype"),
        ({"reduction": "first"}, ValueError, "reduction"),
        ({"max_priority_within_buffer": 1}, TypeError, "max_priority_within_buffer"),
        ({"device": "meta"}, ValueError, "device"),
        ({"stratified": "yes"}, TypeError, "stratified"),
        ({"weight_norm": "max"}, ValueError, "weight_norm"),
    ],
)
def test_constructor_refuses_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    args = {"max_capacity": 8, "alpha": 0.6, "beta": 0.4, **kwargs}
    with pytest.raises(error, match=match):
        PrioritizedSampler(**args)


def test_alpha_and_beta_setters_refuse_bad_values() -> None:
    sampler = PrioritizedSampler(8, 0.6, 0.4)
    with pytest.raises(ValueError, match="alpha"):
        sampler.alpha = -1.0
    with pytest.raises(ValueError, match="beta"):
        sampler.beta = float("inf")
    assert (sampler.alpha, sampler.beta) == (0.6, 0.4)


def test_rank_sampler_needs_slots_in_order() -> None:
    sampler = RankBasedSampler(8, 0.6, 0.4)
    rb = ReplayBuffer(storage=LazyTensorStorage(8), sampler=sampler)
    rb.extend(torch.arange(3))
    with pytest.raises(InvalidIndexError, match="in order"):
        sampler.mark_update(torch.tensor([5]))


def test_import_fastper_imports_no_torchrl() -> None:
    code = (
        "import sys, fastper, fastper.compat; "
        "assert not any(m.split('.')[0] in ('torch', 'torchrl', 'tensordict') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
