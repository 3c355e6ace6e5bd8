"""The disk tier under crashes, bad directories, a full disk and a memory budget."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastper
import fastper._disk_files as fdisk
from fastper.disk import COUNTER, DiskStorage, open_buffer
from fastper.errors import DiskBufferError, DiskFullError

F = {"obs": ((4,), np.int64), "img": ((8, 8), np.uint8)}
CAP = 64


def rows(lo: int, hi: int) -> dict[str, np.ndarray]:
    """Rows whose values say their insertion order."""
    t = np.arange(lo, hi)
    return {
        "obs": np.repeat(t[:, None], 4, axis=1),
        "img": (np.repeat(t, 64).reshape(-1, 8, 8) % 251).astype(np.uint8),
    }


def expected_slots(total: int) -> np.ndarray:
    """The row held by each slot after ``total`` rows were added to a ring of CAP."""
    return np.array([max(r for r in range(total) if r % CAP == s) for s in range(min(total, CAP))])


CRASH = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import fastper
    import fastper._disk_files as fd
    from fastper.disk import DiskStorage
    sys.path.insert(0, sys.argv[4])
    from test_disk_reliability import F, CAP, rows
    d, ck, mode = sys.argv[1:4]
    buf = fastper.PrioritizedReplayBuffer(
        CAP, F, alpha=0.6, seed=0, storage=DiskStorage(F, CAP, d, ram_budget=0))
    buf.add(rows(0, 50))
    s = buf.sample(16)
    buf.update_priorities(s.indices, np.arange(16) / 4 + 0.1, keys=s.keys)
    buf.save(ck)
    print(json.dumps(buf.priorities(np.arange(50)).tolist()), flush=True)
    buf.add(rows(50, 80))
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    real = fd.pwrite_all
    def dying(fd_, data, offset):  # half of the first field's rows, then the process dies
        real(fd_, data[: len(data) // 2], offset)
        os._exit(1)
    fd.pwrite_all = dying
    buf.add(rows(80, 90))
    """
)


def crash(tmp_path: Path, mode: str) -> tuple[Path, Path, np.ndarray]:
    d, ck = tmp_path / "d", tmp_path / "ck.fpk"
    out = subprocess.run(
        [sys.executable, "-c", CRASH, str(d), str(ck), mode, str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0, out.stderr
    assert out.returncode in (-9, 1), out.stderr
    return d, ck, np.array(json.loads(out.stdout.splitlines()[-1]))


def test_crash_after_checkpoint_recovers_rows_added_since(tmp_path: Path) -> None:
    d, ck, saved = crash(tmp_path, "kill")
    buf, report = open_buffer(d, ck)
    # 80 rows on disk, 50 at the checkpoint: 30 re-admitted, 64 - 30 kept from it
    assert (report.restored, report.recovered, report.torn, report.pending_dropped) == (
        34,
        30,
        0,
        0,
    )
    assert len(buf) == CAP and buf.total_added == 80 and buf.cursor == 80 % CAP
    data = buf.storage.gather(np.arange(CAP))
    want = expected_slots(80)
    np.testing.assert_array_equal(data["obs"][:, 0], want)
    np.testing.assert_array_equal(data["img"], rows(0, 80)["img"][want])
    p = buf.priorities(np.arange(CAP))
    np.testing.assert_array_equal(p[16:50], saved[16:50])  # from the checkpoint
    np.testing.assert_array_equal(p[50:], buf.max_priority_ever)  # re-admitted
    np.testing.assert_array_equal(p[:16], buf.max_priority_ever)
    buf.add(rows(80, 85))  # it goes on where the dead process stopped
    assert buf.storage.gather(np.array([80 % CAP]))["obs"][0, 0] == 80
    buf.storage.close()
    rebuilt, report = open_buffer(d, alpha=0.6)
    assert (report.restored, report.recovered, report.torn) == (0, CAP, 0)
    assert rebuilt.total_added == 85 and np.all(rebuilt.priorities(np.arange(CAP)) == 1.0)


def test_crash_mid_write_reports_torn_rows(tmp_path: Path) -> None:
    d, ck, saved = crash(tmp_path, "torn")
    buf, report = open_buffer(d, ck)
    # the write of rows 80..89 was overwriting slots 16..25 (rows 16..25) when it died
    assert (report.restored, report.recovered, report.torn) == (24, 30, 10)
    # the torn range stays on disk until adds overwrite it: every reopen drops it again
    assert buf.total_added == 80 and (buf.storage.rows, buf.storage.intent) == (80, 90)
    p = buf.priorities(np.arange(CAP))
    assert np.all(p[16:26] == 0.0) and np.array_equal(p[26:50], saved[26:50])
    for _ in range(20):  # proportional sampling never draws a torn row
        s = buf.sample(32)
        assert not np.isin(s.indices, np.arange(16, 26)).any()
        np.testing.assert_array_equal(s.data["obs"][:, 0], expected_slots(80)[s.indices])
    buf.storage.close()
    _, report = open_buffer(d)  # a second reopen drops them again
    assert (report.recovered, report.torn) == (CAP - 10, 10)


def test_nstep_windows_pending_at_the_checkpoint_are_dropped(tmp_path: Path) -> None:
    fields = {
        "obs": ((2,), np.float32), "reward": ((), np.float32), "next_obs": ((2,), np.float32),
        "done": ((), np.bool_),
    }  # fmt: skip
    buf = fastper.PrioritizedReplayBuffer(
        32, fields, n_step=3, seed=0, nstep_keys={"truncated_key": None},
        storage=lambda f, c: DiskStorage(f, c, tmp_path / "d"),
    )  # fmt: skip
    for t in range(10):
        buf.add({"obs": np.full(2, t), "reward": 1.0, "next_obs": np.full(2, t + 1), "done": False})
    assert buf.n_pending == 2
    buf.save(tmp_path / "ck.fpk")
    for t in range(10, 13):
        buf.add({"obs": np.full(2, t), "reward": 1.0, "next_obs": np.full(2, t + 1), "done": False})
    buf.storage.close()  # the process "dies": nothing else is written
    again, report = open_buffer(tmp_path / "d", tmp_path / "ck.fpk")
    assert (report.restored, report.recovered, report.pending_dropped) == (8, 3, 2)
    assert again.n_pending == 0 and len(again) == 11
    with pytest.warns(fastper.RecoveryWarning, match="3 rows added after the checkpoint"):
        again.storage.close()
        fastper.load(tmp_path / "ck.fpk")


# -- bad directories and files --------------------------------------------------------


def made(tmp_path: Path, n: int = 10) -> Path:
    d = tmp_path / "d"
    buf = fastper.PrioritizedReplayBuffer(CAP, F, storage=DiskStorage(F, CAP, d, ram_budget=0))
    buf.add(rows(0, n))
    buf.storage.close()
    return d


def test_not_a_buffer_directory(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("mine")
    with pytest.raises(DiskBufferError, match=r"'.*x' is not a fastper disk buffer"):
        DiskStorage(F, CAP, tmp_path / "x")
    with pytest.raises(DiskBufferError, match="is not a fastper disk buffer"):
        open_buffer(tmp_path / "x")
    assert os.listdir(tmp_path / "x") == ["notes.txt"]
    (tmp_path / "f").write_text("")
    with pytest.raises(DiskBufferError, match="is not a directory"):
        DiskStorage(F, CAP, tmp_path / "f")
    with pytest.raises(DiskBufferError, match="does not exist"):
        open_buffer(tmp_path / "missing")


def test_layout_mismatch_and_reuse(tmp_path: Path) -> None:
    d = made(tmp_path)
    with pytest.raises(DiskBufferError, match=r"capacity=64 .* not capacity=65"):
        DiskStorage(F, CAP + 1, d, exist_ok=True)
    with pytest.raises(DiskBufferError, match=r"obs: \(4,\) int64.*obs: \(4,\) int32"):
        DiskStorage({**F, "obs": ((4,), np.int32)}, CAP, d, exist_ok=True)
    with pytest.raises(FileExistsError, match="already holds a fastper disk buffer"):
        DiskStorage(F, CAP, d)
    buf, report = open_buffer(d)  # untouched by the refusals
    assert report.recovered == 10
    buf.storage.close()
    assert DiskStorage(F, CAP, d, exist_ok=True).rows == 0


def test_truncated_and_damaged_files(tmp_path: Path) -> None:
    d = made(tmp_path)
    field_file = d / "field-001.bin"
    os.truncate(field_file, CAP * 64 - 1)
    with pytest.raises(DiskBufferError, match=r"`img`'s file .*field-001.bin.* truncated"):
        open_buffer(d)
    os.truncate(field_file, CAP * 64)
    (d / COUNTER).write_bytes(b"\0" * 40)
    with pytest.raises(DiskBufferError, match="damaged counter file"):
        open_buffer(d)
    (d / COUNTER).write_bytes(b"\0" * 3)
    with pytest.raises(DiskBufferError, match="truncated counter file"):
        open_buffer(d)
    (d / "fastper-disk.json").write_text("{not json")
    with pytest.raises(DiskBufferError, match="not a fastper disk header"):
        open_buffer(d)


def test_one_storage_per_directory(tmp_path: Path) -> None:
    d = made(tmp_path)
    first = DiskStorage.open(d)
    with pytest.raises(DiskBufferError, match="in use by another storage"):
        DiskStorage.open(d)
    first.close()
    with pytest.raises(DiskBufferError, match="is closed"):
        first.gather(np.arange(3))
    DiskStorage.open(d).close()


def test_checkpoints_that_do_not_match(tmp_path: Path) -> None:
    d = made(tmp_path)
    other = fastper.PrioritizedReplayBuffer(CAP, F, storage=DiskStorage(F, CAP, tmp_path / "other"))
    other.add(rows(0, 3))
    other.save(tmp_path / "other.fpk")
    other.storage.close()
    with pytest.raises(DiskBufferError, match="refers to disk buffer"):
        open_buffer(d, tmp_path / "other.fpk")
    ram = fastper.PrioritizedReplayBuffer(CAP, F)
    ram.add(rows(0, 3))
    ram.save(tmp_path / "ram.fpk")
    with pytest.raises(DiskBufferError, match="checkpoint of a buffer in RAM"):
        open_buffer(d, tmp_path / "ram.fpk")
    with pytest.raises(TypeError, match="takes no buffer settings with a checkpoint"):
        open_buffer(tmp_path / "other", tmp_path / "other.fpk", alpha_every=3)
    buf, report = open_buffer(d)  # each refusal closed what it opened
    assert report.recovered == 10
    buf.storage.close()


# -- a full disk ----------------------------------------------------------------------


def snapshot(buf: Any) -> dict[str, Any]:
    n = len(buf)
    st = buf.storage
    return {
        "len": n, "cursor": buf.cursor, "added": buf.total_added,
        "priorities": buf.priorities(np.arange(n)).copy(), "keys": buf.keys(np.arange(n)).copy(),
        "rows": {f: st.read(f, 0, n) for f in st.fields}, "counter": (st.rows, st.intent),
        "rng": json.dumps(buf._rng.bit_generator.state),
    }  # fmt: skip


def same_snapshot(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        np.array_equal(a[k], b[k])
        if k != "rows"
        else all(np.array_equal(a[k][f], b[k][f]) for f in a[k])
        for k in a
    )


@pytest.mark.parametrize(("before", "fail_at"), [(20, 1), (20, 2), (70, 1), (70, 2)])
def test_full_disk_on_add_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: int, fail_at: int
) -> None:
    buf = fastper.PrioritizedReplayBuffer(
        CAP, F, alpha=0.6, seed=0, storage=DiskStorage(F, CAP, tmp_path / "d", ram_budget=0)
    )
    ram = fastper.PrioritizedReplayBuffer(CAP, F, alpha=0.6, seed=0)
    for lo in range(0, before, 40):
        buf.add(rows(lo, min(before, lo + 40)))
        ram.add(rows(lo, min(before, lo + 40)))
    old = snapshot(buf)
    real = fdisk.pwrite_all
    calls = []

    def full(fd: int, data: memoryview, offset: int) -> None:
        calls.append(1)
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(fdisk, "pwrite_all", full)
    with pytest.raises(DiskFullError, match=r"disk full while writing field `.*`: the 5 rows") as e:
        buf.add(rows(before, before + 5))
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    new = snapshot(buf)
    if before + 5 > CAP and fail_at > 1:
        # the first field overwrote the 5 oldest rows (those the add evicts): documented as
        # torn until the next add; the ring, priorities, keys and other rows are unchanged
        assert new["counter"] == (before, before + 5)
        slots = np.arange(before, before + 5) % CAP
        kept = np.setdiff1d(np.arange(CAP), slots)
        for f in F:
            np.testing.assert_array_equal(new["rows"][f][kept], old["rows"][f][kept])
        new["rows"], new["counter"] = old["rows"], old["counter"]
    assert same_snapshot(new, old)
    monkeypatch.setattr(fdisk, "pwrite_all", real)
    buf.add(rows(before, before + 5))  # space again: the add goes through
    ram.add(rows(before, before + 5))
    for _ in range(3):
        assert all(np.array_equal(buf.sample(16).data[f], ram.sample(16).data[f]) for f in F)


def test_full_disk_at_creation_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fdisk, "allocate", full)
    with pytest.raises(DiskFullError, match=r"disk full creating a disk buffer of .* GiB"):
        DiskStorage(F, CAP, tmp_path / "d")
    assert not (tmp_path / "d").exists()


# -- a memory budget ------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")  # pragma: no cover


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_rss_stays_bounded_with_data_past_the_budget(tmp_path: Path) -> None:
    """42 MB of rows, a 1 MB RAM budget: RSS grows by far less than the data."""
    fields = {"obs": ((84, 84), np.uint8), "action": ((), np.int64), "reward": ((), np.float32)}
    cap, budget = 6000, 1 << 20
    buf = fastper.PrioritizedReplayBuffer(
        cap, fields, alpha=0.6, beta=0.4, seed=0,
        storage=DiskStorage(fields, cap, tmp_path / "d", ram_budget=budget),
    )  # fmt: skip
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 256, (100, 84, 84), dtype=np.uint8)

    def step(i: int) -> None:
        buf.add({"obs": obs, "action": np.full(100, i), "reward": np.zeros(100)})
        for _ in range(2):
            s = buf.sample(32)
            buf.update_priorities(s.indices, rng.random(32), keys=s.keys)

    step(0)  # warm: compiled kernels, first pages of every array
    start = rss()
    for i in range(1, 3 * cap // 100):  # three times around the ring
        step(i)
    grown = rss() - start
    data = cap * buf.storage.nbytes_per_slot
    assert buf.storage.nbytes() <= budget and buf.total_added == 3 * cap
    assert grown < 12 * 2**20 < data / 3, f"RSS grew by {grown / 2**20:.1f} MiB"
