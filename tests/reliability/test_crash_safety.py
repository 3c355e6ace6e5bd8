"""Crash safety of checkpoints: SIGKILL mid-save, leftover temporary files, concurrent saves.

A forked child (no fresh interpreter, no re-import: a fork costs milliseconds)
continues from the last checkpoint, adding transitions and saving in a loop,
and is killed with SIGKILL at a random moment. Every time, the checkpoint on
disk must be the last one completed (or the one whose rename had just
happened), load, verify, and hold exactly the transitions it claims; the
temporary files of killed saves must not pile up.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import fastper
from fastper import checkpoint

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or checkpoint.fcntl is None, reason="needs fork and flock (POSIX)"
)

FIELDS = {"id": ((), np.int64), "obs": ((16,), np.float32)}
CAPACITY = 6_000
STEP = 1_000  # transitions added between two saves
KILLS_PER_KIND = 20  # 60 kills in all
KINDS = (
    fastper.PrioritizedReplayBuffer,
    fastper.RankBasedReplayBuffer,
    fastper.ReplayBuffer,
)


def _batch(first_id: int, k: int) -> dict[str, np.ndarray]:
    ids = np.arange(first_id, first_id + k, dtype=np.int64)
    return {"id": ids, "obs": np.repeat(ids[:, None], 16, axis=1).astype(np.float32)}


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".fpk.tmp"))


def _check_contents(buf) -> None:
    """The ring holds exactly the last len(buf) ids written, ids == keys, in slot order."""
    n = len(buf)
    assert n == min(buf.total_added, buf.capacity)
    slots = np.arange(n)
    keys = buf.keys(slots)
    ids = buf.storage.columns["id"][:n]
    np.testing.assert_array_equal(ids, keys)  # every transition's id is its key
    assert sorted(keys.tolist()) == list(range(buf.total_added - n, buf.total_added))
    np.testing.assert_array_equal(buf.storage.columns["obs"][:n], np.repeat(ids[:, None], 16, 1))
    assert (buf.priorities(slots) > 0).all()


def _saver_loop(path: str, progress, phase, seed: int) -> None:  # runs in the forked child
    buf = fastper.load(path)
    rng = np.random.default_rng(seed)
    for k in range(10_000):
        buf.add(_batch(buf.total_added, STEP))
        s = buf.sample(64)
        buf.update_priorities(s.indices, rng.random(64) + 0.1, keys=s.keys)
        phase.value = 2 * k + 1  # save k starts
        buf.save(path)
        progress.value = buf.total_added  # reported only once the save has returned
        phase.value = 2 * k + 2
    os._exit(0)  # pragma: no cover - killed long before


@pytest.mark.parametrize("kind", KINDS, ids=lambda c: c.kind)
def test_sigkill_during_saves_keeps_last_complete_checkpoint(kind, tmp_path):
    ctx = multiprocessing.get_context("fork")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    path = folder / "replay.fpk"
    rng = np.random.default_rng(12345)
    buf = kind(CAPACITY, FIELDS, seed=0)
    buf.add(_batch(0, CAPACITY))
    t0 = time.perf_counter()
    buf.save(path)  # a full buffer: how long a save takes
    save_s = time.perf_counter() - t0
    buf = kind(CAPACITY, FIELDS, seed=0)
    buf.add(_batch(0, STEP))
    buf.save(path)
    expected = buf.total_added
    kills_mid_save = 0
    kills_after_progress = 0
    for i in range(KILLS_PER_KIND):
        progress = ctx.Value("q", expected, lock=False)
        phase = ctx.Value("q", 0, lock=False)
        proc = ctx.Process(target=_saver_loop, args=(str(path), progress, phase, i), daemon=True)
        proc.start()
        # a random moment: once the child has started its first, second or third
        # save, plus up to about one save's time
        start_of = 2 * int(rng.integers(0, 3)) + 1
        deadline = time.monotonic() + 30
        while phase.value < start_of and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(float(rng.uniform(0.0, 1.2 * save_s)))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL, proc.exitcode
        reported = int(progress.value)
        leftovers = _temporaries(folder)
        assert len(leftovers) <= 1, leftovers  # the next save removes the earlier ones
        kills_mid_save += bool(leftovers)
        meta = fastper.read_metadata(path, verify=True)
        loaded = fastper.load(path)
        assert type(loaded) is kind
        # the last complete save, or the next one if it was killed right after its rename
        assert loaded.total_added in (reported, reported + STEP), (loaded.total_added, reported)
        assert loaded.total_added >= expected
        assert meta["state"]["writer"]["total_added"] == loaded.total_added
        kills_after_progress += loaded.total_added > expected
        _check_contents(loaded)
        expected = loaded.total_added
    print(kind.kind, f"save {save_s * 1e3:.1f} ms", kills_mid_save, kills_after_progress)
    # the kills really land inside saves, and between them
    assert kills_mid_save >= 4, f"only {kills_mid_save} of {KILLS_PER_KIND} kills hit a save"
    assert kills_after_progress >= 4, f"only {kills_after_progress} kills came after a save"
    fastper.load(path).save(path)  # one clean save removes the last leftover
    assert sorted(p.name for p in folder.iterdir()) == ["replay.fpk"]


def test_live_temporary_is_kept_and_abandoned_ones_removed(tmp_path):
    import fcntl

    buf = fastper.PrioritizedReplayBuffer(8, FIELDS, seed=0)
    buf.add(_batch(0, 5))
    target = tmp_path / "r.fpk"
    live = tmp_path / ".r.fpk.live1234.fpk.tmp"
    dead = [tmp_path / f".r.fpk.dead{i}.fpk.tmp" for i in range(3)]
    other = tmp_path / ".other.fpk.dead.fpk.tmp"  # another target's: not ours to remove
    for p in (live, *dead, other):
        p.write_bytes(b"partial checkpoint")
    fd = os.open(live, os.O_RDONLY)  # an open file description of its own, as another save
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        buf.save(target)
        assert _temporaries(tmp_path) == sorted([live.name, other.name])
    finally:
        os.close(fd)  # the "save" dies: its lock goes with it
    buf.save(target)
    assert _temporaries(tmp_path) == [other.name]
    assert len(fastper.load(target)) == 5


def test_concurrent_saves_to_one_path_never_corrupt_it(tmp_path):
    """Threads saving different buffers to one path: each save is all-or-nothing."""
    path = tmp_path / "shared.fpk"
    buffers = []
    for j in range(3):
        b = fastper.PrioritizedReplayBuffer(4096, FIELDS, seed=j)
        b.add(_batch(0, 1000 * (j + 1)))
        buffers.append(b)
    buffers[0].save(path)
    errors: list[BaseException] = []
    stop = threading.Event()

    def saver(b) -> None:
        try:
            for _ in range(15):
                b.save(path)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                loaded = fastper.load(path)
                assert len(loaded) in (1000, 2000, 3000)
                _check_contents(loaded)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=saver, args=(b,)) for b in buffers]
    watcher = threading.Thread(target=reader)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert not errors, errors
    _check_contents(fastper.load(path))
    assert _temporaries(tmp_path) == []
