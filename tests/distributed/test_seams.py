"""Sharded replay at its seams: shards that fill behind the coordinator's back, shards
without a minimum, update checks, the shared formulas, and the modules' dependencies.

In-process shards only (no Ray): the coordinator's logic is the same over Ray.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import fastper
from fastper.distributed import ShardedReplayBuffer

FIELDS = {"x": ((), np.float64), "tag": ((), np.int64)}
PACKAGE = Path(fastper.__file__).resolve().parent / "distributed"


def rows(values, tag: int) -> dict[str, np.ndarray]:
    values = np.asarray(values, dtype=np.float64)
    return {"x": values, "tag": np.full(values.shape[0], tag)}


def test_defect_shard_seen_empty_is_sampled_again() -> None:
    s = ShardedReplayBuffer.local(
        2, 16, FIELDS, buffer_kwargs={"alpha": 1.0, "eps": 0.0},
        weight_norm="none", beta=0.5, seed=0,
    )  # fmt: skip
    s.add(rows(np.arange(4.0), 0), shard=0, priorities=np.full(4, 1.0))
    s.sample(8)  # the coordinator sees shard 1 empty
    # an actor inserts straight into shard 1 (as a ShardRouter does): the coordinator is not told
    s.transport.shards[1].add(rows(np.arange(6.0), 1), None, np.full(6, 2.0))
    b = s.sample(64)
    on1 = b.indices >= 16
    assert on1.any()  # the shard seen empty is drawn from
    np.testing.assert_array_equal(b.data["tag"], on1.astype(np.int64))
    # exact over the union: P = p / 16 (4 x 1 + 6 x 2), N = 10
    np.testing.assert_array_equal(b.probabilities, np.where(on1, 2.0, 1.0) / 16.0)
    np.testing.assert_allclose(b.weights, (10 * b.probabilities) ** -0.5, rtol=1e-15)
    assert len(s) == 10
    # shard 0 grows behind the coordinator's back; draws of one point each: N follows the
    # shards' replies even for the shard without a point, and P stays the law used
    s.transport.shards[0].add(rows(np.arange(5.0), 0), None, np.full(5, 1.0))
    for _ in range(20):
        one = s.sample(1)
        np.testing.assert_allclose(one.weights, (15 * one.probabilities) ** -0.5, rtol=1e-15)
    assert len(s) == 15
    # a shard emptied behind the coordinator's back: drawn again over the others, no error
    s.transport.shards[1].buffer.clear()
    b = s.sample(64)
    assert (b.indices < 16).all() and len(s) == 9
    np.testing.assert_array_equal(b.probabilities, np.full(64, 1.0 / 9.0))


def test_defect_batch_norm_shards_give_no_nan_weights() -> None:
    batch_shards = {"alpha": 1.0, "weight_norm": "batch"}
    with pytest.raises(
        ValueError,
        match=r"`weight_norm` must be 'batch' or 'none' over shards that do not keep their "
        r"smallest mass \(shards \[0, 1\].*got weight_norm='buffer'; make every shard's buffer "
        r"with weight_norm='buffer'",
    ):
        ShardedReplayBuffer.local(2, 8, FIELDS, buffer_kwargs=batch_shards, seed=0)
    for norm in ("batch", "none"):
        s = ShardedReplayBuffer.local(
            2, 8, FIELDS, buffer_kwargs=batch_shards, weight_norm=norm, seed=0
        )
        s.add(rows(np.arange(3.0), 0), shard=0, priorities=[1.0, 2.0, 4.0])
        s.add(rows(np.arange(2.0), 1), shard=1, priorities=[8.0, 0.5])
        w = s.sample(256).weights
        assert np.isfinite(w).all() and (w > 0).all()
    # shards that keep their minimum normalise over the whole memory, never NaN
    s = ShardedReplayBuffer.local(2, 8, FIELDS, buffer_kwargs={"alpha": 1.0}, seed=0)
    s.add(rows(np.arange(3.0), 0), shard=0, priorities=[1.0, 2.0, 4.0])
    w = s.sample(256).weights
    assert np.isfinite(w).all() and w.max() <= 1.0


def _error(call) -> BaseException:
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type is compared below
        call()
    return info.value


def test_defect_update_refuses_what_the_cpu_buffer_refuses_and_changes_nothing() -> None:
    s = ShardedReplayBuffer.local(2, 8, FIELDS, buffer_kwargs={"alpha": 1.0}, seed=0)
    s.add(rows(np.arange(4.0), 0), shard=0)
    s.add(rows(np.arange(4.0), 1), shard=1)
    cpu = fastper.PrioritizedReplayBuffer(16, FIELDS, alpha=1.0, seed=0)
    cpu.add(rows(np.arange(16.0), 0))
    b = s.sample(4)
    idx, keys = b.indices, b.keys
    bad_calls = {
        "float keys": (idx, np.ones(4), keys.astype(np.float64) + 0.5),
        "float indices": (idx.astype(np.float64), np.ones(4), keys),
        "nan td": (idx, np.array([1.0, np.nan, 1.0, 1.0]), keys),
        "bool td": (idx, np.ones(4, dtype=bool), keys),
        "2-D indices": (idx.reshape(2, 2), np.ones(4), keys),
        "short keys": (idx, np.ones(4), keys[:3]),
        "short td": (idx, np.ones(3), keys),
    }
    for what, (i, td, k) in bad_calls.items():
        mine = _error(lambda i=i, td=td, k=k: s.update_priorities(i, td, k))
        local_keys = k if k.dtype.kind == "f" else k % 8  # the CPU buffer's own keys
        theirs = _error(lambda i=i, td=td, k=local_keys: cpu.update_priorities(i, td, k))
        assert type(mine) is type(theirs), what
        assert str(mine) == str(theirs), what
    with pytest.raises(TypeError, match=r"`keys` must hold integers, got keys with dtype float64"):
        s.update_priorities(idx, np.ones(4), keys.astype(np.float64))
    with pytest.raises(ValueError, match=r"`td_errors` must be finite, got non-finite"):
        s.update_priorities(idx, [np.nan] * 4, keys)
    with pytest.raises(fastper.InvalidIndexError, match=r"never-written indices=array\(\[5\]"):
        s.update_priorities([0, 5], [1.0, 1.0])  # shard 0 filled slots 0..3 only
    with pytest.raises(ValueError, match=r"`keys` must be keys issued by this buffer"):
        s.update_priorities(idx, np.ones(4), -1 - keys)
    with pytest.raises(ValueError, match=r"`keys` must be keys issued by this buffer"):
        s.update_priorities(idx, np.ones(4), keys + 100)  # never issued
    with pytest.raises(ValueError, match=r"`keys` must be keys issued by this buffer"):
        s.update_priorities(idx, np.ones(4), keys + (1 << 40))  # a restore that never happened
    s.flush()
    for shard in s.transport.shards:  # nothing was applied, nothing counted
        np.testing.assert_array_equal(shard.buffer.priorities(np.arange(4)), 1.0)
        assert shard.stale_updates() == 0
    assert s.stale_updates == 0
    # the same update with good arguments goes through
    assert s.update_priorities(idx, np.full(4, 3.0), keys, wait=True) == 4


@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
def test_defect_one_shard_gives_one_buffers_probabilities_and_weights_bit_for_bit(
    norm: str,
) -> None:
    rng = np.random.default_rng(3)
    kw = {"alpha": 0.6, "eps": 1e-3, "weight_norm": norm}
    single = fastper.PrioritizedReplayBuffer(64, FIELDS, seed=5, **kw)
    sharded = ShardedReplayBuffer.local(
        1, 64, FIELDS, buffer_kwargs=kw, weight_norm=norm, beta=0.7, seed=5
    )
    p = rng.random(50) * 3.0 + 0.01
    single.add(rows(np.arange(50.0), 0), priorities=p)
    sharded.add(rows(np.arange(50.0), 0), priorities=p)
    for _ in range(25):
        a, b = sharded.sample(32), single.sample(32, beta=0.7)
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.keys, b.keys)
        np.testing.assert_array_equal(a.probabilities, b.probabilities)
        np.testing.assert_array_equal(a.weights, b.weights)
        td = rng.random(32) * 5.0
        sharded.update_priorities(a.indices, td, a.keys)
        single.update_priorities(b.indices, td, keys=b.keys)


def _intra_imports(path: Path) -> set[str]:
    """Modules of ``fastper.distributed`` that ``path`` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[:2] == ["fastper", "distributed"] and len(parts) > 2:
                out.add(parts[2])
    return out


def test_defect_no_reach_ins_and_no_import_cycles_in_distributed() -> None:
    modules = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    graph = {m: _intra_imports(p) & set(modules) for m, p in modules.items()}
    # acyclic: repeatedly remove the modules that import no remaining module
    left = dict(graph)
    while left:
        leaves = [m for m, deps in left.items() if not deps & set(left)]
        assert leaves, f"import cycle among {sorted(left)}: {left}"
        for m in leaves:
            del left[m]
    reach_ins = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                private = node.attr.startswith("_") and not node.attr.endswith("__")
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if private and not own:
                    reach_ins.append(f"{name}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private and node.module != "__future__":
                    reach_ins.append(f"{name}:{node.lineno} import {private}")
    assert reach_ins == []


def test_defect_keys_from_before_a_restore_inside_an_update_are_dropped(tmp_path) -> None:
    """A shard restored while ``update_priorities`` refreshed its views started a new
    generation, but the entries' generations were compared with the old one: the whole
    update was refused, the valid entries of the other shard with it."""
    import warnings

    fields = {"obs": ((2,), np.float32)}
    sb = ShardedReplayBuffer.local(2, 16, fields, seed=0, on_shard_loss="restore", shuffle=False)
    shards = sb.transport.shards
    sb.add({"obs": np.ones((4, 2), np.float32)}, shard=0)
    sb.add({"obs": np.ones((4, 2), np.float32)}, shard=1)
    sb.save(tmp_path)
    sb.add({"obs": np.ones((4, 2), np.float32)}, shard=1)  # after the checkpoint
    shards[1].buffer.update_priorities(np.arange(4, 8), np.full(4, 1000.0))
    sb.refresh()
    b = sb.sample(8)
    late = (b.indices >= 16) & ((b.keys & ((1 << 40) - 1)) >= 4)  # lost with the restore
    assert late.any()
    shards[0].buffer.add({"obs": np.ones((2, 2), np.float32)})  # an actor, behind its back
    sb.transport.kill(1)
    idx = np.concatenate([b.indices[late], [4]])  # + slot 4 of shard 0: not sampled, its key 4
    keys = np.concatenate([b.keys[late], [4]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        applied = sb.update_priorities(idx, np.ones(idx.size), keys, wait=True)
    assert applied == 1
    assert sb.stale_updates == int(late.sum())
