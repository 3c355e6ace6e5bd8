"""What a new user hit, each answered with one clear message (issue: meet users where they train)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import fastper
import fastper.storage
from fastper.storage import physical_memory

FIELDS = {"obs": ((2,), np.float32)}


@pytest.mark.parametrize(
    "cls", [fastper.ReplayBuffer, fastper.PrioritizedReplayBuffer, fastper.RankBasedReplayBuffer]
)
def test_a_misspelt_keyword_names_the_public_class_and_the_likely_word(cls) -> None:
    with pytest.raises(TypeError) as info:
        cls(16, FIELDS, alhpa=0.5)
    msg = str(info.value)
    assert msg.startswith(f"{cls.__name__}()") and "'alhpa'" in msg and "'alpha'" in msg
    assert "_Buffer" not in msg


def test_subclass_keywords_still_work_and_are_suggested() -> None:
    buf = fastper.RankBasedReplayBuffer(16, FIELDS, sort_every=4, alpha=0.5, seed=0)
    assert buf.alpha == 0.5
    with pytest.raises(TypeError, match="did you mean 'sort_every'"):
        fastper.RankBasedReplayBuffer(16, FIELDS, sort_evry=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'$"):
        fastper.ReplayBuffer(16, FIELDS, zzz=1)


def test_a_buffer_larger_than_memory_warns_with_the_sizes(monkeypatch) -> None:
    # a machine of 1 MiB: the test allocates only small columns (asking numpy for
    # more than the real RAM may itself fail with MemoryError, depending on overcommit)
    assert physical_memory() > 1 << 30  # the OS query itself: this machine's RAM, in bytes
    monkeypatch.setattr(fastper.storage, "physical_memory", lambda: 1 << 20)
    per_slot = 84 * 84
    capacity = (1 << 20) // per_slot + 1
    with pytest.warns(fastper.CapacityWarning, match=r"GiB when full, more than this machine"):
        buf = fastper.ReplayBuffer(capacity, {"obs": ((84, 84), np.uint8)})
    assert buf.capacity == capacity  # built (columns are mapped lazily), but the user knows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastper.ReplayBuffer(capacity - 1, {"obs": ((84, 84), np.uint8)})  # fits: no warning


def test_saving_into_a_missing_directory_creates_it(tmp_path) -> None:
    buf = fastper.PrioritizedReplayBuffer(8, FIELDS)
    buf.add({"obs": np.zeros(2, np.float32)})
    target = tmp_path / "no" / "such" / "replay.fpk"
    buf.save(target)
    assert target.is_file() and len(fastper.load(target)) == 1


def test_bfloat16_and_float16_tensors_are_stored_by_the_field_rules() -> None:
    torch = pytest.importorskip("torch")
    buf = fastper.ReplayBuffer(8, {"obs": ((2,), np.float32), "a": ((), np.int64)})
    buf.add({"obs": torch.tensor([[0.5, -2.0]], dtype=torch.bfloat16),
             "a": torch.tensor([3.0], dtype=torch.bfloat16)})  # fmt: skip
    buf.add({"obs": torch.tensor([[1.5, 4.0]], dtype=torch.float16), "a": torch.tensor([1])})
    assert np.array_equal(buf.storage.columns["obs"][:2], [[0.5, -2.0], [1.5, 4.0]])
    assert buf.storage.columns["a"][:2].tolist() == [3, 1]
    with pytest.raises(fastper.FieldTypeError, match="`a`"):  # 2.5 would be truncated
        buf.add({"obs": torch.zeros(1, 2), "a": torch.tensor([2.5], dtype=torch.bfloat16)})
    # the refused add changed nothing
    assert len(buf) == 2 and buf.total_added == 2
    assert np.array_equal(buf.storage.columns["obs"][:3], [[0.5, -2.0], [1.5, 4.0], [0.0, 0.0]])


def test_a_misspelt_keyword_builds_nothing_and_changes_no_other_buffer() -> None:
    buf = fastper.PrioritizedReplayBuffer(8, FIELDS, seed=0)
    buf.add({"obs": np.ones((3, 2), np.float32)})
    before = buf.state_dict()
    with pytest.raises(TypeError, match="alhpa"):
        fastper.PrioritizedReplayBuffer(8, FIELDS, alhpa=0.5, seed=0)
    after = buf.state_dict()
    assert after["writer"] == before["writer"] and after["buffer"]["rng"] == before["buffer"]["rng"]
    assert np.array_equal(after["sampler"]["priorities"], before["sampler"]["priorities"])
