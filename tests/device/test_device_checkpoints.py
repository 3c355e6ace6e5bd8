"""Device buffer checkpoints and states: round trips on both back ends, CPU -> device
and across back ends, refused files and states (which change nothing), no pickle."""

from __future__ import annotations

import copy
import json
import pickle
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
fd = pytest.importorskip("fastper.device")

import fastper  # noqa: E402  (after the skips: fastper.device needs torch)
from fastper import checkpoint as ckpt  # noqa: E402
from tests.oracles import assert_same_state  # noqa: E402

BACKENDS = ("torch", "numba")
FIELDS = {"obs": ((3,), np.float32), "id": ((), np.int64), "done": ((), np.bool_)}
CAP = 16


def rows(k: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + k, dtype=np.int64)
    return {
        "obs": np.stack([ids, -ids, 0.25 * ids], axis=1).astype(np.float32),
        "id": ids,
        "done": ids % 3 == 0,
    }


def _fill(buf, integer: bool = False) -> None:
    """Adds that wrap the ring, samples and updates (stale keys included)."""
    rng = np.random.default_rng(1)
    buf.add(rows(10))
    old = buf.sample(8)
    buf.add(rows(9, 10))  # wraps: some of `old` are stale now
    td = rng.integers(1, 20, 8).astype(np.float64) if integer else rng.normal(0, 5, 8)
    buf.update_priorities(old.indices, td, keys=old.keys)
    s = buf.sample(6)
    td = rng.integers(0, 20, 6).astype(np.float64) if integer else rng.normal(0, 5, 6)
    buf.update_priorities(s.indices, td, keys=s.keys)
    buf.add(rows(2, 19), priorities=[3.0, 7.0])


def make(backend: str, **kw):
    kw.setdefault("seed", 0)
    kw.setdefault("alpha", 0.7)
    return fd.DevicePrioritizedReplayBuffer(CAP, FIELDS, backend=backend, **kw)


def _contents(buf) -> dict:
    """What a loaded buffer must reproduce: rows, priorities, keys, counters, settings."""
    n = len(buf)
    every = torch.arange(n)
    out = {
        "len": n,
        "total_added": buf.total_added,
        "step": buf.step,
        "alpha": buf.alpha,
        "beta": buf.beta,
        "max_priority_ever": buf.max_priority_ever,
        "stale_updates": buf.stale_updates,
        "priorities": buf.priorities(every).cpu().numpy().copy(),
        "keys": buf.keys(every).cpu().numpy().copy(),
        "settings": buf.state_dict()["settings"],
    }
    for name, col in buf.storage.columns.items():
        out[f"rows/{name}"] = col[:n].cpu().numpy().copy()
    return out


def _assert_contents_equal(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype, k
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k], k


def _assert_same_batch(a, b) -> None:
    assert torch.equal(a.indices, b.indices)
    assert torch.equal(a.keys, b.keys)
    assert torch.equal(a.weights, b.weights)
    assert torch.equal(a.probabilities, b.probabilities)
    for name in a.data:
        assert torch.equal(a.data[name], b.data[name]), name


def _snapshot(buf) -> dict:
    meta, arrays = ckpt.split_state(buf.state_dict())
    snap = {"meta": copy.deepcopy(meta)}
    snap.update({f"array/{k}": np.array(v, copy=True) for k, v in arrays.items()})
    snap.update({f"col/{k}": c.clone().numpy() for k, c in buf.storage.columns.items()})
    snap["raw"] = buf._index.raw[: len(buf)].clone().numpy()
    snap["total"] = float(buf._index.total_for(len(buf)))
    return snap


# ---------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_round_trip_continues_identically(backend, tmp_path):
    buf = make(backend, beta=fastper.schedules.linear(0.4, 1.0, 10), weight_norm="batch")
    _fill(buf)
    path = tmp_path / "dev.fpk"
    buf.save(path)
    loaded = fd.load(path, backend=backend)
    assert type(loaded) is fd.DevicePrioritizedReplayBuffer and loaded.backend == backend
    assert loaded.device == buf.device and loaded.capacity == CAP
    _assert_contents_equal(_contents(loaded), _contents(buf))
    np.testing.assert_array_equal(
        loaded.state_dict()["buffer"]["rng"], buf.state_dict()["buffer"]["rng"]
    )
    # the random state carried over: the next samples, updates and adds agree
    for i in range(4):
        a, b = buf.sample(8), loaded.sample(8)
        _assert_same_batch(a, b)
        td = torch.arange(8, dtype=torch.float64) * (i + 1) - 5
        assert int(buf.update_priorities(a.indices, td, keys=a.keys)) == int(
            loaded.update_priorities(b.indices, td, keys=b.keys)
        )
        assert torch.equal(buf.add(rows(3, 30 + 3 * i)), loaded.add(rows(3, 30 + 3 * i)))
    _assert_contents_equal(_contents(loaded), _contents(buf))


@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_and_n_step_buffers_round_trip(backend, tmp_path):
    uni = fd.DeviceReplayBuffer(CAP, FIELDS, backend=backend, seed=4)
    _fill(uni)
    uni.save(tmp_path / "u.fpk")
    got = fd.load(tmp_path / "u.fpk", backend=backend)
    assert type(got) is fd.DeviceReplayBuffer
    _assert_contents_equal(_contents(got), _contents(uni))
    _assert_same_batch(got.sample(8), uni.sample(8))
    # n-step: the pending windows travel too, so later adds complete the same rows
    nf = {"obs": ((), np.float32), "reward": ((), np.float32), "next_obs": ((), np.float32),
          "terminated": ((), np.bool_), "truncated": ((), np.bool_)}  # fmt: skip
    rng = np.random.default_rng(2)

    def steps(k):
        return {
            "obs": rng.normal(size=k).astype(np.float32),
            "reward": rng.normal(size=k).astype(np.float32),
            "next_obs": rng.normal(size=k).astype(np.float32),
            "terminated": rng.random(k) < 0.15,
            "truncated": np.zeros(k, dtype=bool),
        }

    ns = fd.DevicePrioritizedReplayBuffer(CAP, nf, n_step=3, n_envs=2, backend=backend, seed=0)
    for _ in range(7):
        ns.add(steps(2))
    assert ns.n_pending > 0
    ns.save(tmp_path / "n.fpk")
    back = fd.load(tmp_path / "n.fpk", backend=backend)
    assert back.n_pending == ns.n_pending
    for _ in range(12):
        data = steps(2)
        assert torch.equal(ns.add(data), back.add(data))
    _assert_contents_equal(_contents(back), _contents(ns))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cpu_checkpoint_and_state_load_into_a_device_buffer(backend, tmp_path):
    cpu = fastper.PrioritizedReplayBuffer(CAP, FIELDS, alpha=0.7, seed=0)
    _fill(cpu)
    cpu.save(tmp_path / "cpu.fpk")
    n = len(cpu)
    every = np.arange(n)
    from_file = fd.load(tmp_path / "cpu.fpk", backend=backend)
    from_state = fd.DevicePrioritizedReplayBuffer.from_state_dict(cpu.state_dict(), backend=backend)
    into = make(backend, seed=9)
    into.load_state_dict(cpu.state_dict())
    for dev in (from_file, from_state, into):
        assert type(dev) is fd.DevicePrioritizedReplayBuffer and dev.backend == backend
        assert len(dev) == n and dev.total_added == cpu.total_added and dev.step == cpu.step
        assert dev.alpha == cpu.alpha and dev.max_priority_ever == cpu.max_priority_ever
        assert dev.stale_updates == cpu.stale_updates
        np.testing.assert_array_equal(dev.priorities(every).numpy(), cpu.priorities(every))
        np.testing.assert_allclose(
            dev.probabilities(every).numpy(), cpu.probabilities(every), rtol=1e-12
        )
        np.testing.assert_array_equal(dev.keys(every).numpy(), cpu.keys(every))
        for name, col in cpu.storage.columns.items():
            np.testing.assert_array_equal(dev.storage.columns[name][:n].numpy(), col[:n])
        # and it works on: the same update lands on the same priorities
        dev.update_priorities([0, 5], [2.5, -4.0], keys=cpu.keys([0, 5]))
    cpu.update_priorities([0, 5], [2.5, -4.0], keys=cpu.keys([0, 5]))
    np.testing.assert_array_equal(into.priorities(every).numpy(), cpu.priorities(every))
    # a uniform CPU buffer becomes a uniform device buffer
    ucpu = fastper.ReplayBuffer(CAP, FIELDS, seed=0)
    _fill(ucpu)
    ucpu.save(tmp_path / "ucpu.fpk")
    udev = fd.load(tmp_path / "ucpu.fpk", backend=backend)
    assert type(udev) is fd.DeviceReplayBuffer
    np.testing.assert_array_equal(udev.priorities(every).numpy(), ucpu.priorities(every))
    np.testing.assert_array_equal(
        udev.storage.columns["id"][:n].numpy(), ucpu.storage.columns["id"][:n]
    )


@pytest.mark.parametrize(("src", "dst"), [("torch", "numba"), ("numba", "torch")])
def test_device_checkpoint_loads_across_backends(src, dst, tmp_path):
    # integer priorities (alpha 1, eps 0): both back ends then find the same leaf for
    # every target, so the moved buffer also draws what the original draws
    buf = make(src, alpha=1.0, eps=0.0)
    _fill(buf, integer=True)
    buf.save(tmp_path / "x.fpk")
    moved = fd.load(tmp_path / "x.fpk", backend=dst)
    assert moved.backend == dst and buf.backend == src
    _assert_contents_equal(_contents(moved), _contents(buf))
    also = fd.DevicePrioritizedReplayBuffer.from_state_dict(buf.state_dict(), backend=dst)
    _assert_contents_equal(_contents(also), _contents(buf))
    for _ in range(3):
        a, b = buf.sample(16), moved.sample(16)
        _assert_same_batch(a, b)
        td = torch.arange(16, dtype=torch.float64)
        buf.update_priorities(a.indices, td, keys=a.keys)
        moved.update_priorities(b.indices, td, keys=b.keys)
    _assert_contents_equal(_contents(moved), _contents(buf))


# ---------------------------------------------------------------------------
# refused files and states
# ---------------------------------------------------------------------------


def _saved(tmp_path, backend: str = "torch") -> tuple:
    buf = make(backend)
    _fill(buf)
    path = tmp_path / "good.fpk"
    buf.save(path)
    return buf, path, path.read_bytes()


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]


CORRUPTIONS = {
    "empty file": lambda d: b"",
    "magic only": lambda d: d[:8],
    "truncated header": lambda d: d[:40],
    "truncated at half": lambda d: d[: len(d) // 2],
    "last byte missing": lambda d: d[:-1],
    "trailing byte": lambda d: d + b"\x00",
    "byte flipped in the header": lambda d: _flip(d, 30),
    "byte flipped in the data": lambda d: _flip(d, len(d) - 100),
    "byte flipped in the digest": lambda d: _flip(d, len(d) - 1),
    "wrong magic": lambda d: b"\x89NOTFPK\n" + d[8:],
    "garbage": lambda d: bytes(range(256)) * 4,
    "a pickle": lambda d: pickle.dumps({"kind": "device_proportional"}),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_and_truncated_files_raise_checkpoint_error(backend, case, tmp_path):
    _, path, data = _saved(tmp_path, backend)
    bad = tmp_path / "bad.fpk"
    bad.write_bytes(CORRUPTIONS[case](data))
    with pytest.raises(fastper.CheckpointError):
        fd.load(bad, backend=backend)
    assert fd.load(path, backend=backend).total_added == 21  # the good file still loads


def _bad_states(state: dict) -> dict:
    """Well-formed states whose contents are wrong (each a deep copy)."""
    out = {}

    def variant(name, edit):
        s = copy.deepcopy(state)
        edit(s)
        out[name] = s

    pri = state["sampler"]["priorities"]
    variant("priorities one short", lambda s: s["sampler"].update(priorities=pri[:-1].copy()))
    variant("priorities 2-D", lambda s: s["sampler"].update(priorities=pri.reshape(-1, 1).copy()))
    variant("priorities float32", lambda s: s["sampler"].update(priorities=pri.astype(np.float32)))
    neg = pri.copy()
    neg[3] = -1.0
    variant("negative priority", lambda s: s["sampler"].update(priorities=neg))
    nan = pri.copy()
    nan[2] = np.nan
    variant("nan priority", lambda s: s["sampler"].update(priorities=nan))
    big = pri.copy()
    big[0] = state["buffer"]["max_priority_ever"] * 2
    variant("priority above max_priority_ever", lambda s: s["sampler"].update(priorities=big))
    variant(
        "rows one short",
        lambda s: s["storage"].update({"columns/id": s["storage"]["columns/id"][:-1]}),
    )
    variant(
        "rows of another dtype",
        lambda s: s["storage"].update({"columns/id": s["storage"]["columns/id"].astype(np.int32)}),
    )
    variant(
        "inconsistent ring", lambda s: s["writer"].update(cursor=(s["writer"]["cursor"] + 1) % CAP)
    )
    variant("negative step", lambda s: s["buffer"].update(step=-1))
    variant("bad random state", lambda s: s["buffer"].update(rng=np.zeros(3, dtype=np.uint8)))
    variant("unknown kind", lambda s: s.update(kind="rank"))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_states_are_refused_and_leave_the_target_unchanged(backend, tmp_path):
    src = make(backend)
    _fill(src)
    state = src.state_dict()
    target = make(backend, seed=3)
    target.add(rows(5, 100))
    target.update_priorities([1], [4.0])
    twin = make(backend, seed=3)
    twin.add(rows(5, 100))
    twin.update_priorities([1], [4.0])
    before = _snapshot(target)
    for bad in _bad_states(state).values():
        with pytest.raises(ValueError):
            target.load_state_dict(bad)
        assert_same_state(_snapshot(target), before)
        with pytest.raises(ValueError):
            fd.DevicePrioritizedReplayBuffer.from_state_dict(bad, backend=backend)
        # written to a file, the same contents are a CheckpointError on load
        path = tmp_path / "bad.fpk"
        ckpt.write_state(path, bad)
        with pytest.raises(fastper.CheckpointError, match="bad.fpk"):
            fd.load(path, backend=backend)
    _assert_same_batch(target.sample(8), twin.sample(8))
    # the unaltered state loads
    target.load_state_dict(state)
    _assert_contents_equal(_contents(target), _contents(src))


@pytest.mark.parametrize("backend", BACKENDS)
def test_states_of_other_settings_are_refused_and_leave_the_target_unchanged(backend):
    target = make(backend)
    _fill(target)
    twin = make(backend)
    _fill(twin)
    before = _snapshot(target)
    nstep_fields = {**FIELDS, "reward": ((), np.float32), "next_obs": ((3,), np.float32)}
    others = {  # empty: the settings alone make each refusal
        "capacity": fd.DevicePrioritizedReplayBuffer(CAP * 2, FIELDS, backend=backend, seed=0),
        "fields": fd.DevicePrioritizedReplayBuffer(
            CAP, {**FIELDS, "extra": ((), np.float32)}, backend=backend, seed=0
        ),
        "field dtype": fd.DevicePrioritizedReplayBuffer(
            CAP, {**FIELDS, "id": ((), np.int32)}, backend=backend, seed=0
        ),
        "eps": make(backend, eps=1e-3),
        "clip": make(backend, clip=5.0),
        "max_priority": make(backend, max_priority=2.0),
        "stratified": make(backend, stratified=False),
        "shuffle": make(backend, shuffle=False),
        "weight_norm": make(backend, weight_norm="none"),
        "gamma": make(backend, gamma=0.5),
        "n_step": fd.DevicePrioritizedReplayBuffer(
            CAP,
            nstep_fields,
            n_step=2,
            nstep_keys={"terminated": "done", "truncated": None},
            backend=backend,
            seed=0,
        ),  # fmt: skip
        "cpu, other eps": fastper.PrioritizedReplayBuffer(CAP, FIELDS, eps=1e-2, seed=0),
        "uniform": fd.DeviceReplayBuffer(CAP, FIELDS, backend=backend, seed=0),
        "cpu rank": fastper.RankBasedReplayBuffer(CAP, FIELDS, seed=0),
    }
    for name, other in others.items():
        message = {"uniform": "cannot be loaded", "cpu rank": "kind"}.get(name, "settings")
        with pytest.raises(ValueError, match=message):
            target.load_state_dict(other.state_dict())
        assert_same_state(_snapshot(target), before)
    _assert_same_batch(target.sample(8), twin.sample(8))
    # a state of the same settings but another seed is accepted
    same = make(backend, seed=123)
    _fill(same)
    target.load_state_dict(same.state_dict())
    _assert_contents_equal(_contents(target), _contents(same))
    _assert_same_batch(target.sample(8), same.sample(8))


# ---------------------------------------------------------------------------
# no pickle
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_never_use_pickle(backend, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")

    for name in ("load", "loads", "dump", "dumps", "Unpickler", "Pickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch, "save", refuse)
    buf = make(backend)
    _fill(buf)
    path = tmp_path / "np.fpk"
    buf.save(path)
    cpu = fastper.PrioritizedReplayBuffer(CAP, FIELDS, alpha=0.7, seed=0)
    _fill(cpu)
    cpu.save(tmp_path / "cpu.fpk")
    for p in (path, tmp_path / "cpu.fpk"):
        data = p.read_bytes()
        assert data[:8] == ckpt.MAGIC
        magic, version, hlen = struct.unpack("<8sIQ", data[:20])
        assert magic == ckpt.MAGIC and version == ckpt.FORMAT_VERSION
        header = json.loads(data[20 : 20 + hlen].decode("utf-8"))  # plain JSON
        assert header["format"] == "fastper-checkpoint"
        loaded = fd.load(p, backend=backend)
        assert len(loaded) == CAP and loaded.total_added == 21
    assert header["state"]["kind"] == "proportional"
    loaded = fd.load(path, backend=backend)
    _assert_contents_equal(_contents(loaded), _contents(buf))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_gpu_buffer_loads_on_the_gpu_and_on_the_cpu(device, tmp_path) -> None:
    """Saved on a GPU: loaded there, the same contents and the generator goes on (the
    next batch is the one the saved buffer draws); loaded on the CPU, the same contents."""
    buf = make("torch", device=device)
    _fill(buf)
    path = tmp_path / "gpu.fpk"
    buf.save(path)
    want = _contents(buf)
    again = fd.load(path, device=device)
    assert again.device == buf.device == torch.device("cuda", torch.cuda.current_device())
    _assert_contents_equal(_contents(again), want)
    _assert_same_batch(again.sample(8), buf.sample(8))
    for backend in BACKENDS:
        on_cpu = fd.load(path, device="cpu", backend=backend)
        assert on_cpu.device == torch.device("cpu")
        _assert_contents_equal(_contents(on_cpu), want)


def test_a_state_from_another_kind_of_device_loads_with_a_seeded_generator() -> None:
    """A CUDA generator's state cannot drive a CPU one: the load keeps the seeded generator."""
    buf = fd.DevicePrioritizedReplayBuffer(64, {"x": ((), np.float32)}, seed=5, backend="torch")
    buf.add({"x": np.arange(40, dtype=np.float32)})
    buf.sample(8)
    state = buf.state_dict()
    state["buffer"]["rng_device"] = "cuda"
    state["buffer"]["rng"] = np.zeros(16, dtype=np.uint8)  # a CUDA state's size: seed, offset
    moved = fd.DevicePrioritizedReplayBuffer.from_state_dict(state, backend="torch")
    fresh = fd.DevicePrioritizedReplayBuffer(64, {"x": ((), np.float32)}, seed=5, backend="torch")
    fresh.add({"x": np.arange(40, dtype=np.float32)})
    assert torch.equal(moved.sample(8).indices, fresh.sample(8).indices)
    assert torch.equal(moved.priorities(torch.arange(40)), buf.priorities(torch.arange(40)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cpu_buffer_of_records_loads_into_a_device_buffer(backend, tmp_path):
    """A CPU buffer whose small rows are stored as records (strided columns) hands
    the same rows to a device buffer, through its state and through a file."""
    fields = {"obs": ((3,), np.float32), "id": ((), np.int64), "done": ((), np.float32)}
    cpu = fastper.PrioritizedReplayBuffer(CAP, fields, alpha=0.7, seed=0)
    assert cpu.storage.layout == "records"
    rng = np.random.default_rng(4)
    cpu.add({"obs": rng.standard_normal((CAP, 3)).astype(np.float32), "id": np.arange(CAP),
             "done": (rng.random(CAP) < 0.3).astype(np.float32)})  # fmt: skip
    cpu.save(tmp_path / "cpu.fpk")
    for dev in (
        fd.load(tmp_path / "cpu.fpk", backend=backend),
        fd.DevicePrioritizedReplayBuffer.from_state_dict(cpu.state_dict(), backend=backend),
    ):
        for name, col in cpu.storage.columns.items():
            np.testing.assert_array_equal(dev.storage.columns[name][:CAP].numpy(), col)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_constant_max_priority_above_one_round_trips(backend):
    """New items get the constant ``max_priority`` (here above every update's),
    which does not raise ``max_priority_ever``: the state still loads."""
    dev = make(backend, max_priority=6.5)
    dev.add(rows(5))
    s = dev.sample(3)
    dev.update_priorities(s.indices, [0.5, 1.0, 2.0], keys=s.keys)
    assert dev.max_priority_ever < 6.5
    state = dev.state_dict()
    again = make(backend, max_priority=6.5, seed=4)
    again.load_state_dict(state)
    every = torch.arange(5)
    np.testing.assert_array_equal(again.priorities(every).numpy(), dev.priorities(every).numpy())
    assert float(again.priorities(every).max()) == 6.5
