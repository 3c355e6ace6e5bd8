"""Where the device buffers meet the rest of fastper: the same rules as the CPU buffers.

* a call that raises changes nothing, n-step windows included (two-phase add);
* one validation layer: tensors that track gradients are stored and used
  detached, a narrowing cast that would change a value is refused with the CPU
  buffers' message, an unavailable device is a clear error;
* the sampling rules of :mod:`fastper.policy` (targets, P(i), IS weights);
* no reach-ins: the device modules use other modules' public names only.
"""

from __future__ import annotations

import ast
import copy
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
fd = pytest.importorskip("fastper.device")

import fastper  # noqa: E402  (after the skips: fastper.device needs torch)
from fastper.checkpoint import split_state  # noqa: E402
from fastper.errors import FieldTypeError  # noqa: E402
from fastper.samplers import NORM_CODES  # noqa: E402
from tests.oracles import _internals, assert_same_state  # noqa: E402

BACKENDS = ("torch", "numba")
FIELDS = {"obs": ((3,), np.float32), "id": ((), np.int64)}
NSTEP_FIELDS = {
    "obs": ((2,), np.float32),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "next_obs": ((2,), np.float32),
    "terminated": ((), np.bool_),
    "truncated": ((), np.bool_),
}


def rows(k: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + k, dtype=np.int64)
    obs = np.stack([ids, -ids, 0.5 * ids], axis=1).astype(np.float32)
    return {"obs": obs, "id": ids}


def steps(rng: np.random.Generator, k: int, end: bool = False) -> dict[str, np.ndarray]:
    return {
        "obs": rng.normal(size=(k, 2)).astype(np.float32),
        "action": rng.integers(0, 4, k),
        "reward": rng.normal(size=k).astype(np.float32),
        "next_obs": rng.normal(size=(k, 2)).astype(np.float32),
        "terminated": np.full(k, end),
        "truncated": np.zeros(k, dtype=bool),
    }


def snapshot(buf) -> dict:
    """A device buffer's state, every column row, its raw priorities and its trees."""
    meta, arrays = split_state(buf.state_dict())
    snap: dict = {"meta": copy.deepcopy(meta), "len": len(buf), "n_pending": buf.n_pending}
    for name, arr in arrays.items():
        snap[f"array/{name}"] = np.array(arr, copy=True)
    for name, col in buf.storage.columns.items():
        snap[f"column/{name}"] = col.detach().clone().numpy()
    snap["raw"] = buf._index.raw[: len(buf)].clone().numpy()
    if buf.backend == "torch":
        for name, arr in buf._index.snapshot(len(buf)).items():
            snap[f"index/{name}"] = arr
    else:
        _internals(buf._index.sampler, "sampler", snap)
    return snap


def assert_same_batch(a, b) -> None:
    for name in ("indices", "keys", "weights", "probabilities"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in a.data:
        assert torch.equal(a.data[name], b.data[name]), name


class DiskFull(OSError):
    pass


def _fail(*args, **kwargs):
    raise DiskFull("no space left on device")


# ---------------------------------------------------------------------------
# a call that raises changes nothing
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_defect_failed_device_nstep_add_is_half_applied(backend, monkeypatch):
    """A storage write that fails during an n-step add leaves the windows, the ring,
    the priorities and the generator as they were; later adds behave as if the
    failed call never happened."""
    kw = dict(n_step=3, gamma=0.9, seed=0, backend=backend)
    buf = fd.DevicePrioritizedReplayBuffer(8, NSTEP_FIELDS, **kw)
    twin = fd.DevicePrioritizedReplayBuffer(8, NSTEP_FIELDS, **kw)
    rng = np.random.default_rng(0)
    history = [steps(rng, 2) for _ in range(4)]
    for data in history:
        for b in (buf, twin):
            b.add(data, env_ids=[0, 1])
    assert buf.n_pending == 4 and len(buf) == 4
    before = snapshot(buf)
    assert_same_state(before, snapshot(twin))
    failing = steps(rng, 2)  # completes one transition per stream
    with monkeypatch.context() as m:
        m.setattr(buf.storage, "write", _fail)
        with pytest.raises(DiskFull):
            buf.add(failing, env_ids=[0, 1])
        with pytest.raises(DiskFull):  # an episode end: every pending window at once
            buf.add(steps(rng, 2, end=True), env_ids=[0, 1])
        with pytest.raises(DiskFull):  # tensors, converted at the boundary
            buf.add({k: torch.as_tensor(v[:1]) for k, v in failing.items()}, env_ids=[1])
    assert_same_state(snapshot(buf), before)
    assert buf.n_pending == 4 and len(buf) == 4 and buf.total_added == 4
    # later adds, samples and updates: exactly the twin's
    for data, ids in (
        (failing, [0, 1]),
        (steps(rng, 2, end=True), [1, 0]),
        (steps(rng, 3), [2, 2, 0]),
    ):
        assert torch.equal(buf.add(data, env_ids=ids), twin.add(data, env_ids=ids))
        a, b = buf.sample(5), twin.sample(5)
        assert_same_batch(a, b)
        td = torch.linspace(0.5, 3.0, 5, dtype=torch.float64)
        buf.update_priorities(a.indices, td, keys=a.keys)
        twin.update_priorities(b.indices, td, keys=b.keys)
    assert_same_state(snapshot(buf), snapshot(twin))


@pytest.mark.parametrize("backend", BACKENDS)
def test_defect_failed_add_with_priorities_changes_nothing(backend, monkeypatch):
    """``validate=False`` replaces bad explicit priorities and counts them: only once
    the rows are written."""
    buf = fd.DevicePrioritizedReplayBuffer(8, FIELDS, seed=0, backend=backend, validate=False)
    buf.add(rows(3))
    before = snapshot(buf)
    with monkeypatch.context() as m:
        m.setattr(buf.storage, "write", _fail)
        with pytest.raises(DiskFull):
            buf.add(rows(2, 3), priorities=[float("nan"), 2.0])
    assert_same_state(snapshot(buf), before)
    assert buf.invalid_updates == 0
    buf.add(rows(2, 3), priorities=[float("nan"), 2.0])
    assert buf.invalid_updates == 1
    assert buf.priorities([3, 4]).tolist() == [1.0, 2.0]  # nan got the new-transition priority


@pytest.mark.parametrize("backend", BACKENDS)
def test_nstep_flush_past_the_capacity_keeps_the_last_rows_as_the_cpu_buffer(backend):
    """An episode end may complete more transitions than the ring holds: the ring
    keeps the last ``capacity``, slots and keys as if added one by one."""
    kw = dict(n_step=3, gamma=0.5, seed=0)
    cpu = fastper.PrioritizedReplayBuffer(4, NSTEP_FIELDS, **kw)
    dev = fd.DevicePrioritizedReplayBuffer(4, NSTEP_FIELDS, backend=backend, **kw)
    rng = np.random.default_rng(3)
    ids = [0, 1, 2, 3]
    for data in (steps(rng, 4), steps(rng, 4), steps(rng, 4, end=True)):
        s_cpu, s_dev = cpu.add(data, env_ids=ids), dev.add(data, env_ids=ids)
        np.testing.assert_array_equal(s_dev.numpy(), s_cpu)
    assert cpu.total_added == 12 and len(cpu) == 4
    assert dev.total_added == 12 and dev.cursor == cpu.cursor and dev.n_pending == 0
    for name, col in cpu.storage.columns.items():
        np.testing.assert_array_equal(dev.storage.columns[name].numpy(), col, err_msg=name)
    np.testing.assert_array_equal(dev.keys(torch.arange(4)).numpy(), cpu.keys(np.arange(4)))
    np.testing.assert_array_equal(dev.priorities(torch.arange(4)).numpy(), np.ones(4))


# ---------------------------------------------------------------------------
# one validation layer
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_defect_grad_tracking_rows_are_stored_detached(backend, tmp_path):
    buf = fd.DevicePrioritizedReplayBuffer(8, FIELDS, seed=0, backend=backend)
    obs = torch.arange(12, dtype=torch.float32).reshape(4, 3).requires_grad_()
    buf.add({"obs": obs * 2, "id": torch.arange(4)})  # a tensor with a graph behind it
    col = buf.storage.columns["obs"]
    assert not col.requires_grad and col.grad_fn is None
    assert torch.equal(col[:4], obs.detach() * 2)
    buf.state_dict()
    buf.save(tmp_path / "b.fpk")
    assert torch.equal(fd.load(tmp_path / "b.fpk").storage.columns["obs"][:4], col[:4])
    # a bare storage too, and the CPU buffer holding torch columns
    st = fd.TorchStorage(FIELDS, 4)
    prepared, k = st.prepare({"obs": obs, "id": torch.arange(4)})
    st.write(0, prepared, k)
    assert not st.columns["obs"].requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_defect_grad_tracking_td_errors_are_detached(backend, tmp_path):
    buf = fd.DevicePrioritizedReplayBuffer(8, FIELDS, seed=0, backend=backend)
    buf.add(rows(6))
    batch = buf.sample(4)
    w = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    loss = (torch.arange(4, dtype=torch.float64) + 1.0) * w  # tracks gradients
    assert int(buf.update_priorities(batch.indices, loss, keys=batch.keys)) >= 1
    p = buf.priorities(torch.arange(6))
    assert not p.requires_grad and not buf._index.raw.requires_grad
    # float32 losses (the usual dtype) too, and explicit priorities of add
    buf.update_priorities(batch.indices, loss.float(), keys=batch.keys)
    buf.add(rows(2, 6), priorities=loss[:2])
    assert buf.priorities([6, 7]).tolist() == [1.5, 3.0]
    buf.state_dict()
    buf.save(tmp_path / "b.fpk")
    assert fd.load(tmp_path / "b.fpk").priorities([6, 7]).tolist() == [1.5, 3.0]


@pytest.mark.parametrize(
    ("field", "given"),
    [
        ("obs", np.array([[1e300, 1.0, 0.1]])),  # float64 -> float32: overflows to inf
        ("id", np.array([2**40], dtype=np.int64)),  # int64 -> int32: out of range
    ],
    ids=["float-overflow", "int-overflow"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_defect_narrowing_cast_is_refused_as_on_the_cpu(backend, field, given):
    fields = {"obs": ((3,), np.float32), "id": ((), np.int32)}
    good = {"obs": np.zeros((1, 3)), "id": np.zeros(1, dtype=np.int64)}
    bad = {**good, field: given}
    cpu = fastper.PrioritizedReplayBuffer(8, fields, seed=0)
    with pytest.raises(FieldTypeError) as cpu_err:
        cpu.add(bad)
    buf = fd.DevicePrioritizedReplayBuffer(8, fields, seed=0, backend=backend)
    buf.add({k: torch.from_numpy(v) for k, v in good.items()})
    before = snapshot(buf)
    with pytest.raises(FieldTypeError, match=f"field `{field}` is (float32|int32)") as dev_err:
        buf.add({k: torch.from_numpy(v) for k, v in bad.items()})  # float64 / int64 tensors
    assert str(dev_err.value) == str(cpu_err.value)  # one rule, one message
    assert_same_state(snapshot(buf), before)
    # values that fit are stored, rounded as numpy rounds them
    fit = {"obs": np.array([[1e30, -2.5, 0.1]]), "id": np.array([2**31 - 1], dtype=np.int64)}
    buf.add({k: torch.from_numpy(v) for k, v in fit.items()})
    cpu.add(fit)
    for name in fields:
        np.testing.assert_array_equal(buf.storage.columns[name][1].numpy(),
                                      cpu.storage.columns[name][0])  # fmt: skip
    # validate=False reads nothing back: the cast is torch's, unchecked (documented)
    fast = fd.DevicePrioritizedReplayBuffer(8, fields, seed=0, backend=backend, validate=False)
    fast.add({k: torch.from_numpy(v) for k, v in bad.items()})
    assert len(fast) == 1


def test_defect_cuda_without_an_index_is_the_current_gpu(monkeypatch):
    """``device="cuda"`` resolves to the GPU torch puts tensors on (``cuda:N``):
    the buffer's own tensors then compare equal to its device (an unresolved
    "cuda" refused its own index's leaves on a GPU)."""
    from fastper.device._torch import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert check_device("cuda") == torch.device("cuda:1")
    assert check_device(torch.device("cuda")) == torch.device("cuda:1")
    assert check_device("cuda:0") == torch.device("cuda:0")  # an index given stays
    with pytest.raises(ValueError, match="one of the 2 CUDA device"):
        check_device("cuda:2")


def test_defect_a_buffer_on_cpu_0_is_on_the_cpu(tmp_path):
    """``"cpu:0"`` names the CPU device; it was refused by the buffer's own index."""
    from fastper.device._torch import check_device

    assert check_device("cpu:0") == torch.device("cpu")
    for backend in BACKENDS:
        buf = fd.DevicePrioritizedReplayBuffer(8, FIELDS, device="cpu:0", seed=0, backend=backend)
        buf.add(rows(3))
        assert buf.device == torch.device("cpu")
        assert buf.sample(4).indices.device == torch.device("cpu")
        again = fd.DevicePrioritizedReplayBuffer.from_state_dict(
            buf.state_dict(), device="cpu:0", backend=backend
        )
        assert again.device == torch.device("cpu") and len(again) == 3
        buf.save(tmp_path / f"{backend}.fpk")
        loaded = fd.load(tmp_path / f"{backend}.fpk", device="cpu:0", backend=backend)
        assert loaded.device == torch.device("cpu") and len(loaded) == 3
    size = (fd.DeviceSumTree(8).num_blocks + 1) * 64  # its leaves, the spare block's too
    leaves = torch.zeros(size, dtype=torch.float64)
    tree = fd.DeviceSumTree(8, device="cpu:0", leaves=leaves)  # refused them before
    assert tree.device == torch.device("cpu") and tree.leaves is leaves


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_defect_cuda_device_without_cuda_is_a_fastper_error(tmp_path):
    want = r"`device` must be a device available.*device='cuda'.*CUDA is not available.*'cpu'"
    with pytest.raises(ValueError, match=want):
        fd.DevicePrioritizedReplayBuffer(8, FIELDS, device="cuda")
    with pytest.raises(ValueError, match=want.replace("'cuda'", "'cuda:0'")):
        fd.DeviceReplayBuffer(8, FIELDS, device="cuda:0")
    with pytest.raises(ValueError, match=want):
        fd.TorchStorage(FIELDS, 8, "cuda")
    with pytest.raises(ValueError, match=want):
        fd.DeviceSumTree(8, device="cuda")
    buf = fd.DevicePrioritizedReplayBuffer(8, FIELDS)
    buf.add(rows(3))
    buf.save(tmp_path / "b.fpk")
    with pytest.raises(ValueError, match=want):  # the argument, not the file, is at fault
        fd.load(tmp_path / "b.fpk", device="cuda")
    with pytest.raises(ValueError, match=want):
        fd.DevicePrioritizedReplayBuffer.from_state_dict(buf.state_dict(), device="cuda")
    with pytest.raises(ValueError, match="must name a torch device"):
        fd.DevicePrioritizedReplayBuffer(8, FIELDS, device="gpu")


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ([1.5], TypeError, r"`indices` must hold integers, got indices with dtype float64"),
        (torch.tensor([1.5]), TypeError, r"`indices` must hold integers, got indices with dtype"),
        ([[1, 2]], ValueError, r"`indices` must be 1-D, got indices with shape \(1, 2\)"),
        (torch.ones(1, 2, dtype=torch.int64), ValueError, r"`indices` must be 1-D, got indices"),
    ],
)
def test_update_arguments_get_the_cpu_messages(value, error, message):
    cpu = fastper.PrioritizedReplayBuffer(8, FIELDS, seed=0)
    buf = fd.DevicePrioritizedReplayBuffer(8, FIELDS, seed=0)
    for b in (cpu, buf):
        b.add(rows(4))
        with pytest.raises(error, match=message):
            b.update_priorities(value, [1.0] * 2)


# ---------------------------------------------------------------------------
# the shared sampling rules
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["buffer", "batch", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_defect_device_probabilities_follow_the_shared_rules(backend, norm):
    """Given the same uniforms, the device draws the CPU buffer's slots with its
    P(i) and weights (:mod:`fastper.policy`); ``probabilities`` reports the P(i)
    that ``sample`` uses. The numba back end is bit for bit the CPU buffer
    (weights as float32); torch's ``pow`` may differ from the C library's in the
    last bit (alpha 0.6), so there P(i) and weights are compared to 1e-15."""
    kw = dict(alpha=0.6, weight_norm=norm, seed=0, shuffle=False)
    cpu = fastper.PrioritizedReplayBuffer(1000, FIELDS, **kw)
    dev = fd.DevicePrioritizedReplayBuffer(1000, FIELDS, backend=backend, **kw)
    rng = np.random.default_rng(1)
    idx = np.arange(700)
    td = rng.random(700) * 3
    for b in (cpu, dev):
        b.add(rows(700))
        b.update_priorities(idx, td)
    u = rng.random(256)
    c_idx, c_prob, c_w, c_keys = cpu._sampler.sample(u, 700, 0.4, True, NORM_CODES[norm], 0, 700)
    d_idx, d_prob, d_w, d_keys = dev._index.draw(
        torch.from_numpy(u), 700, 0.4, True, norm, 0, 700, None
    )
    np.testing.assert_array_equal(d_idx.numpy(), c_idx)
    np.testing.assert_array_equal(d_keys.numpy(), c_keys)
    assert d_w.dtype == torch.float32  # the device's documented weight dtype
    probs = dev.probabilities(d_idx)
    assert torch.equal(probs, d_prob)  # what sample reports
    if backend == "numba":
        np.testing.assert_array_equal(d_prob.numpy(), c_prob)
        np.testing.assert_array_equal(d_w.numpy(), c_w.astype(np.float32))
        np.testing.assert_array_equal(probs.numpy(), cpu.probabilities(c_idx))
    else:
        np.testing.assert_allclose(d_prob.numpy(), c_prob, rtol=1e-15, atol=0)
        np.testing.assert_allclose(d_w.numpy(), c_w.astype(np.float32), rtol=1e-7, atol=0)
        np.testing.assert_allclose(probs.numpy(), cpu.probabilities(c_idx), rtol=1e-15)


@pytest.mark.parametrize("stratified", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_uniform_draws_follow_the_shared_rules(backend, stratified):
    cpu = fastper.ReplayBuffer(1000, FIELDS, seed=0, stratified=stratified, shuffle=False)
    dev = fd.DeviceReplayBuffer(1000, FIELDS, backend=backend, seed=0, stratified=stratified)
    for b in (cpu, dev):
        b.add(rows(640))
    u = np.random.default_rng(2).random(128)
    c_idx, c_prob, c_w, _ = cpu._sampler.sample(u, 640, 0.5, stratified, 0, 0, 640)
    d_idx, d_prob, d_w, _ = dev._index.draw(
        torch.from_numpy(u), 640, 0.5, stratified, "buffer", 0, 640, None
    )
    np.testing.assert_array_equal(d_idx.numpy(), c_idx)
    np.testing.assert_array_equal(d_prob.numpy(), c_prob)
    np.testing.assert_array_equal(d_w.numpy(), np.ones(128, dtype=np.float32))
    np.testing.assert_array_equal(dev.probabilities(d_idx).numpy(), cpu.probabilities(c_idx))


# ---------------------------------------------------------------------------
# no reach-ins
# ---------------------------------------------------------------------------

_DEVICE = pathlib.Path(fd.__file__).parent


def _private_uses(path: pathlib.Path) -> list[str]:
    """``obj._x`` on anything but ``self`` / ``cls``, and private names imported from
    other modules (outside an ImportError fallback), in one device module."""
    tree = ast.parse(path.read_text())
    fallback: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                if isinstance(handler.type, ast.Name) and handler.type.id == "ImportError":
                    fallback.update(id(n) for n in ast.walk(handler))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            name = owner.id if isinstance(owner, ast.Name) else "<expr>"
            found.append(f"{path.name}:{node.lineno}: {name} .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and id(node) not in fallback:
            module = node.module or ""
            if node.level == 2 and module.split(".")[0] == "_kernels":
                found.append(f"{path.name}:{node.lineno}: imports fastper.{module}")
            if node.level == 1:
                continue  # fastper.device's own modules
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno}: imports {module}.{alias.name}")
    return found


def test_defect_device_modules_reach_into_no_private_names():
    # allowed: buffer.py's own buffers (``buf`` / ``other``) using their own attributes
    own = fd.DevicePrioritizedReplayBuffer(4, FIELDS)
    found = []
    for path in sorted(_DEVICE.glob("*.py")):
        for use in _private_uses(path):
            where, what = use.split(": ", 1)
            owner, _, attr = what.partition(" .")
            if path.name == "buffer.py" and owner in ("buf", "other") and hasattr(own, attr):
                continue
            found.append(use)
    assert found == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("validate", [True, False])
def test_a_cuda_buffer_draws_what_the_cpu_device_draws(validate):
    """Fed the same uniforms and order, a buffer on a GPU picks the same slots, keys and
    rows as one on the CPU device (which equals the CPU buffers, tests/unit/test_parity.py),
    step after step with updates in between. Probabilities and masses agree to a few
    ulps, not bit for bit: ``p ** alpha`` is CUDA's pow there, the C library's on the
    CPU, and a GPU sums a block's 64 masses in its own order."""
    n, b = 1 << 14, 256
    rng = np.random.default_rng(3)
    rows_ = {"obs": rng.standard_normal((n, 3)).astype(np.float32),
             "id": np.arange(n, dtype=np.int64)}  # fmt: skip
    pri = np.abs(rng.standard_normal(n)) + 0.01
    bufs = {}
    for dev in ("cpu", "cuda"):
        buf = fd.DevicePrioritizedReplayBuffer(
            n, FIELDS, device=dev, alpha=0.6, beta=0.4, seed=0, backend="torch",
            validate=validate,
        )  # fmt: skip
        buf.add({k: torch.from_numpy(v).to(dev) for k, v in rows_.items()}, priorities=pri)
        bufs[dev] = buf
    gen = torch.Generator().manual_seed(5)
    for step in range(30):
        u = torch.rand(b, generator=gen, dtype=torch.float64)
        perm = torch.randperm(b, generator=gen)
        got = {}
        for dev, buf in bufs.items():
            drawn = (u.to(dev), perm.to(dev))
            buf._draws = lambda _b, drawn=drawn: drawn
            got[dev] = buf.sample(b)
        c, g = got["cpu"], got["cuda"]
        assert torch.equal(c.indices, g.indices.cpu()), step
        assert torch.equal(c.keys, g.keys.cpu()), step
        assert torch.equal(c.data["id"], g.data["id"].cpu()), step
        torch.testing.assert_close(g.probabilities.cpu(), c.probabilities, rtol=1e-14, atol=0)
        torch.testing.assert_close(g.weights.cpu(), c.weights, rtol=3e-7, atol=0)
        td = torch.rand(b, generator=gen, dtype=torch.float64) * 3
        td[::7] = td[0]  # equal priorities: ties between the two devices too
        for dev, buf in bufs.items():
            s = got[dev]
            buf.update_priorities(s.indices, td.to(dev), keys=s.keys)
    snaps = {dev: buf._index.snapshot(n) for dev, buf in bufs.items()}
    for name in ("raw", "keys"):
        np.testing.assert_array_equal(snaps["cuda"][name], snaps["cpu"][name], err_msg=name)
    np.testing.assert_allclose(snaps["cuda"]["mass"], snaps["cpu"]["mass"], rtol=1e-15, atol=0)
    np.testing.assert_allclose(snaps["cuda"]["blocks"], snaps["cpu"]["blocks"], rtol=1e-13, atol=0)
    for buf in bufs.values():
        buf.check()
