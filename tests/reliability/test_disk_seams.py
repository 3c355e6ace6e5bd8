"""The disk tier's seams: torn rows after a crash, checkpoints that point elsewhere, empty gathers."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastper
import fastper._disk_files as fdisk
from fastper import checkpoint as ckpt
from fastper.disk import DiskStorage, load_checkpoint, open_buffer
from fastper.errors import DiskBufferError

F = {"obs": ((4,), np.int64), "img": ((8, 8), np.uint8)}
CAP = 64
KINDS = (fastper.ReplayBuffer, fastper.PrioritizedReplayBuffer, fastper.RankBasedReplayBuffer)
# 80 rows stored (rows 16..79 in the ring), then an add of rows 80..89 dies half way: it was
# overwriting slots 16..25 (rows 16..25), which are torn
TORN = np.arange(16, 26)


class Crash(BaseException):
    """The process dies here (nothing after it runs; the files keep what was written)."""


def rows(lo: int, hi: int) -> dict[str, np.ndarray]:
    """Rows whose values say their insertion order."""
    t = np.arange(lo, hi)
    return {
        "obs": np.repeat(t[:, None], 4, axis=1),
        "img": (np.repeat(t, 64).reshape(-1, 8, 8) % 251).astype(np.uint8),
    }


def crash_mid_add(buf: Any, batch: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    """``buf.add(batch)`` dies after writing half of its first field's bytes."""
    real = fdisk.pwrite_all

    def dying(fd: int, data: memoryview, offset: int) -> None:
        real(fd, data[: len(data) // 2], offset)
        raise Crash

    monkeypatch.setattr(fdisk, "pwrite_all", dying)
    with pytest.raises(Crash):
        buf.add(batch)
    monkeypatch.setattr(fdisk, "pwrite_all", real)
    buf.storage.close()


def crashed(tmp_path: Path, kind: type, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of 80 rows with 10 torn by a crash, and a checkpoint ``ck.fpk`` at 50 rows."""
    d = tmp_path / "d"
    buf = kind(CAP, F, seed=0, storage=DiskStorage(F, CAP, d, ram_budget=0))
    buf.add(rows(0, 50))
    s = buf.sample(16)
    buf.update_priorities(s.indices, np.arange(16) / 4 + 0.1, keys=s.keys)
    buf.save(tmp_path / "ck.fpk")
    buf.add(rows(50, 80))
    crash_mid_add(buf, rows(80, 90), monkeypatch)
    return d


def never_samples(buf: Any, bad: np.ndarray, draws: int = 64) -> None:
    """``bad`` slots are invalid and never drawn; every row drawn is the one its slot holds."""
    held = np.array([max(r for r in range(buf.total_added) if r % CAP == s) for s in range(CAP)])
    for _ in range(draws):
        s = buf.sample(64)
        assert not np.isin(s.indices, bad).any(), np.intersect1d(s.indices, bad)
        np.testing.assert_array_equal(s.data["obs"][:, 0], held[s.indices])
    assert not buf.is_valid(bad).any()
    assert buf.num_valid == len(buf) - bad.size


def tree_bytes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


# -- torn rows -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.kind)
def test_defect_torn_rows_after_a_crash_are_sampled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: type
) -> None:
    """Torn rows are dropped under every scheme, at the first reopening and every later one."""
    d = crashed(tmp_path, kind, monkeypatch)
    for _ in range(3):  # reopening does not forget them
        buf, report = open_buffer(d, buffer_class=kind, seed=1)
        assert (report.restored, report.recovered, report.torn) == (0, CAP - 10, 10)
        assert (buf.storage.rows, buf.storage.intent) == (80, 90)
        np.testing.assert_array_equal(buf.storage.torn_slots(), TORN)
        never_samples(buf, TORN)
        buf.storage.close()


@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.kind)
def test_defect_torn_rows_come_back_through_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: type
) -> None:
    """A checkpoint taken before the crash, one taken after the reopening, and adds after it."""
    d = crashed(tmp_path, kind, monkeypatch)
    buf, report = open_buffer(d, tmp_path / "ck.fpk")
    assert (report.restored, report.recovered, report.torn) == (24, 30, 10)
    never_samples(buf, TORN)
    buf.save(tmp_path / "after.fpk")
    buf.storage.close()
    for ck in ("ck.fpk", "after.fpk", "after.fpk"):
        with pytest.warns(fastper.RecoveryWarning, match="10 rows torn .* dropped"):
            buf = fastper.load(tmp_path / ck)
        assert buf.storage.recovery.torn == 10
        never_samples(buf, TORN)
        buf.storage.close()
    # adds overwrite the oldest torn slots with good rows: those come back, the rest stay out
    buf, _ = open_buffer(d, tmp_path / "after.fpk")
    buf.add(rows(80, 84))
    np.testing.assert_array_equal(buf.is_valid(TORN), np.arange(10) < 4)
    np.testing.assert_array_equal(buf.storage.torn_slots(), TORN[4:])
    never_samples(buf, TORN[4:])
    buf.storage.close()
    for ck in (None, tmp_path / "after.fpk"):  # no checkpoint: a crash right after the adds
        buf, report = open_buffer(d, ck)
        assert report.torn == 6
        never_samples(buf, TORN[4:])
        buf.storage.close()
    buf, _ = open_buffer(d)
    buf.add(rows(84, 100))  # past the torn range: nothing torn any more
    buf.storage.close()
    buf, report = open_buffer(d)
    assert report.torn == 0 and buf.num_valid == CAP
    buf.storage.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_torn_rows_after_sigkill_mid_add(tmp_path: Path) -> None:
    d = tmp_path / "d"
    buf = fastper.ReplayBuffer(CAP, F, seed=0, storage=DiskStorage(F, CAP, d, ram_budget=0))
    buf.add(rows(0, 40))
    buf.add(rows(40, 80))
    buf.storage.close()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child dies inside the add
        try:
            child, _ = open_buffer(d, buffer_class=fastper.ReplayBuffer)
            real = fdisk.pwrite_all

            def dying(fd: int, data: memoryview, offset: int) -> None:
                real(fd, data[: len(data) // 2], offset)
                os.kill(os.getpid(), signal.SIGKILL)

            fdisk.pwrite_all = dying
            child.add(rows(80, 90))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    buf, report = open_buffer(d, buffer_class=fastper.ReplayBuffer)
    assert report.torn == 10
    never_samples(buf, TORN)
    buf.storage.close()


def test_defect_reopening_writes_nothing_to_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = crashed(tmp_path, fastper.PrioritizedReplayBuffer, monkeypatch)
    before = tree_bytes(d)
    buf, _ = open_buffer(d, tmp_path / "ck.fpk")
    buf.storage.close()
    with pytest.warns(fastper.RecoveryWarning):
        fastper.load(tmp_path / "ck.fpk").storage.close()
    open_buffer(d)[0].storage.close()
    assert tree_bytes(d) == before


# -- checkpoints that point elsewhere ---------------------------------------------------


def run_folder(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run's folder: a disk buffer ``buf`` (crashed, rows torn) and its checkpoint ``ck.fpk``."""
    root.mkdir()
    buf = fastper.PrioritizedReplayBuffer(
        CAP, F, seed=0, storage=DiskStorage(F, CAP, root / "buf", ram_budget=0)
    )
    buf.add(rows(0, 35))
    buf.add(rows(35, 70))
    buf.save(root / "ck.fpk")
    crash_mid_add(buf, rows(70, 75), monkeypatch)
    return root


def test_defect_checkpoint_of_a_copied_run_writes_to_the_original(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run1 = run_folder(tmp_path / "run1", monkeypatch)
    meta = fastper.read_metadata(run1 / "ck.fpk")
    assert meta["state"]["storage"]["directory"] == "buf"  # relative to the checkpoint's folder
    run2 = tmp_path / "run2"
    shutil.copytree(run1, run2)
    original = tree_bytes(run1 / "buf")
    with pytest.warns(fastper.RecoveryWarning):
        buf = fastper.load(run2 / "ck.fpk")
    assert buf.storage.directory.resolve() == (run2 / "buf").resolve()
    buf.add(rows(75, 90))
    buf.save(run2 / "ck.fpk")
    buf.storage.close()
    assert tree_bytes(run1 / "buf") == original
    assert fastper.disk.referenced_directory(run2 / "ck.fpk") == run2 / "buf"
    # a checkpoint beside the copy whose reference names the original: the original is the
    # buffer it was taken of, so it may reopen it, but reopening alone writes nothing
    state, _ = ckpt.read_state(run1 / "ck.fpk")
    state["storage"]["directory"] = str((run1 / "buf").resolve())
    ckpt.write_state(run2 / "abs.fpk", state)
    with pytest.warns(fastper.RecoveryWarning):
        buf = fastper.load(run2 / "abs.fpk")
    assert buf.storage.directory == run1 / "buf"
    buf.storage.close()
    assert tree_bytes(run1 / "buf") == original


def test_checkpoint_pointing_at_another_buffer_leaves_it_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = run_folder(tmp_path / "mine", monkeypatch)
    other = run_folder(tmp_path / "other", monkeypatch)  # another buffer (another id)
    original = tree_bytes(other / "buf")
    state, _ = ckpt.read_state(mine / "ck.fpk")
    forged = {
        "relative.fpk": "../other/buf",
        "absolute.fpk": str(other / "buf"),
    }
    for name, where in forged.items():
        state["storage"]["directory"] = where
        ckpt.write_state(mine / name, state)
        with pytest.raises(DiskBufferError, match="refers to disk buffer"):
            fastper.load(mine / name)
    # the other buffer's own checkpoint, altered: its id, but a later epoch, or torn bytes
    state, _ = ckpt.read_state(other / "ck.fpk")
    state["storage"]["epoch"] = 1
    ckpt.write_state(other / "epoch.fpk", state)
    with pytest.raises(DiskBufferError, match="cleared or reloaded after the checkpoint"):
        fastper.load(other / "epoch.fpk")
    raw = bytearray((other / "ck.fpk").read_bytes())
    raw[-40] ^= 0xFF  # in the priorities: found by the digest, after the arrays were read
    (other / "bad.fpk").write_bytes(bytes(raw))
    with pytest.raises(fastper.CheckpointError):
        fastper.load(other / "bad.fpk")
    with pytest.raises(DiskBufferError, match="refers to disk buffer"):
        load_checkpoint(mine / "ck.fpk", directory=other / "buf")
    assert tree_bytes(other / "buf") == original


def test_checkpoint_of_a_moved_directory_takes_it_from_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = run_folder(tmp_path / "run", monkeypatch)
    moved = tmp_path / "elsewhere" / "buf"
    moved.parent.mkdir()
    (run / "buf").rename(moved)
    with pytest.raises(DiskBufferError, match=r"'.*buf', which does not exist: .*directory="):
        fastper.load(run / "ck.fpk")
    with pytest.warns(fastper.RecoveryWarning, match="5 rows torn"):
        buf = load_checkpoint(run / "ck.fpk", directory=moved)
    assert buf.storage.directory == moved and buf.storage.recovery.torn == 5
    buf.storage.close()
    with pytest.raises(TypeError, match="`directory` must be a path"):
        load_checkpoint(run / "ck.fpk", directory=3)  # type: ignore[arg-type]
    ram = fastper.ReplayBuffer(4, F)
    ram.save(tmp_path / "ram.fpk")
    with pytest.raises(DiskBufferError, match="checkpoint of a buffer in RAM"):
        load_checkpoint(tmp_path / "ram.fpk", directory=moved)


def test_reference_is_absolute_without_a_shared_folder(tmp_path: Path) -> None:
    st = DiskStorage(F, CAP, tmp_path / "d")
    far = Path(tmp_path.anchor) / "fastper-no-such-folder" / "ck.fpk"
    assert st.reference_state(0, 0, far)["directory"] == str((tmp_path / "d").resolve())
    assert st.reference_state(0, 0)["directory"] == str((tmp_path / "d").resolve())
    assert st.reference_state(0, 0, tmp_path / "runs" / "ck.fpk")["directory"] == "../d"
    st.close()


# -- gathers ------------------------------------------------------------------------------


@pytest.mark.parametrize("ram_budget", [0, 1 << 20])
def test_defect_gather_of_no_indices_fails(tmp_path: Path, ram_budget: int) -> None:
    fields = {**F, "empty": ((0,), np.float32), "flag": ((), np.bool_)}
    st = DiskStorage(fields, CAP, tmp_path / "d", ram_budget=ram_budget)
    for written in (0, 5):
        if written:
            st.write(
                0,
                st.prepare({**rows(0, 5), "empty": np.zeros((5, 0)), "flag": np.ones(5, bool)})[0],
                5,
            )
        out = st.gather(np.empty(0, dtype=np.int64))
        assert list(out) == list(fields)
        for name, (shape, dtype) in fields.items():
            assert out[name].shape == (0, *shape) and out[name].dtype == np.dtype(dtype)
    st.close()


def test_torn_rows_of_a_frame_buffer_are_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame buffer reopens from a checkpoint taken after its last add, torn rows dropped."""
    fields = {
        "obs": ((2, 2), np.uint8), "next_obs": ((2, 2), np.uint8),
        "terminated": ((), np.bool_), "truncated": ((), np.bool_),
    }  # fmt: skip

    def step(t: int) -> dict[str, Any]:
        return {
            "obs": np.full((2, 2), t, np.uint8), "next_obs": np.full((2, 2), t + 1, np.uint8),
            "terminated": False, "truncated": False,
        }  # fmt: skip

    buf = fastper.PrioritizedReplayBuffer(
        16, fields, frame_stack={"obs": 2}, seed=0,
        storage=lambda f, c: DiskStorage(f, c, tmp_path / "d"),
    )  # fmt: skip
    for t in range(20):
        buf.add(step(t))
    buf.save(tmp_path / "ck.fpk")
    crash_mid_add(buf, step(20), monkeypatch)
    buf, report = open_buffer(tmp_path / "d", tmp_path / "ck.fpk")
    assert (report.restored, report.recovered, report.torn) == (15, 0, 1)
    assert buf.num_valid == 15 and not buf.is_valid([4])[0]
    for _ in range(20):
        s = buf.sample(8)
        assert 4 not in s.indices
        np.testing.assert_array_equal(s.data["obs"][:, 1, 0, 0], s.keys)  # the newest frame
    buf.add(step(20))
    assert buf.num_valid == 16
    buf.storage.close()


def test_defect_a_checkpoint_copied_alone_still_finds_its_buffer(tmp_path) -> None:
    """A checkpoint archived elsewhere in the run's folder (without the buffer) used to
    look for the buffer relative to its new place only; the absolute path recorded at
    the save is now tried where nothing is found there."""
    import fastper
    from fastper.disk import DiskStorage

    fields = {"obs": ((4,), np.float32)}
    run = tmp_path / "run"
    storage = DiskStorage(fields, 16, run / "buf")
    buf = fastper.PrioritizedReplayBuffer(16, fields, storage=storage, seed=0)
    buf.add({"obs": np.arange(40, dtype=np.float32).reshape(10, 4)})
    ckpt = run / "ckpts" / "c.fpk"
    ckpt.parent.mkdir(parents=True)
    buf.save(ckpt)
    storage.close()
    archive = run / "ckpts" / "old"
    archive.mkdir()
    shutil.copy(ckpt, archive)
    back = fastper.load(archive / "c.fpk")
    assert len(back) == 10
    np.testing.assert_array_equal(
        back.storage.gather(np.arange(10))["obs"][:, 0], np.arange(0, 40, 4)
    )
    back.storage.close()
