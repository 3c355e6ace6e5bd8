"""``save`` does not stop the world, and still writes the state at its snapshot.

``save`` snapshots the small state and the priorities under the buffer's
lock, then streams the rows chunk by chunk, taking the lock per chunk; rows
that ``add`` (or ``clear``) would change before they are written are copied
aside first. These tests pause a save between two chunks of rows, from the
saving thread and outside the lock (:class:`PausingSave` wraps
``fastper.checkpoint._chunks``, with chunks of a few rows), and meanwhile:

* call ``add`` / ``sample`` / ``update_priorities`` from another thread, which
  must finish while the save is still paused (a save holding the lock for the
  whole write would block them: the calls run in a helper thread with a
  timeout, so such a failure does not hang the test);
* add enough rows to wrap the ring twice, sample, update priorities, clear:
  the file must still load to exactly the state taken just before the save
  (``state_dict()`` deep-copied with no other thread running; the save's
  snapshot is taken before its first chunk, so nothing changed in between).

And two saves of one buffer from two threads run one at a time.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastper
from fastper import checkpoint as ckpt
from fastper.storage import Storage

CAPACITY = 48
FIELDS = {
    "id": ((), np.int64),
    "obs": ((3,), np.float32),
    "reward": ((), np.float32),
    "next_obs": ((3,), np.float32),
    "terminated": ((), np.bool_),
}
CALL_TIMEOUT = 30.0  # s: a buffer call (microseconds of work) that takes longer is blocked
TIMEOUT = 60.0  # s: the longest a save waits, paused, for the test to resume it


def _rows(ids: np.ndarray) -> dict[str, np.ndarray]:
    """Rows whose every field encodes their id (0 is never used)."""
    f = ids.astype(np.float32)
    return {
        "id": ids.astype(np.int64),
        "obs": np.stack([f, -f, f + 0.5], axis=1),
        "reward": (ids % 5).astype(np.float32),
        "next_obs": np.stack([f + 1, -f - 1, f + 1.5], axis=1),
        "terminated": ids % 9 == 8,
    }


def _make(kind: str, storage: Any = None) -> Any:
    if kind == "nstep":
        return fastper.PrioritizedReplayBuffer(
            CAPACITY, FIELDS, n_step=3, gamma=0.9, nstep_keys={"truncated": None}, seed=3,
            storage=storage,
        )  # fmt: skip
    cls = {
        "uniform": fastper.ReplayBuffer,
        "proportional": fastper.PrioritizedReplayBuffer,
        "rank": fastper.RankBasedReplayBuffer,
    }[kind]
    extra = {"sort_every": 4} if kind == "rank" else {}
    if kind != "uniform":  # uniform replay has no alpha
        extra["alpha"] = 0.7
    return cls(CAPACITY, FIELDS, beta=0.5, seed=3, storage=storage, **extra)


class Adder:
    """Adds rows with increasing ids; samples and updates priorities."""

    def __init__(self, buf: Any, seed: int = 0, one_by_one: bool = False) -> None:
        self.buf = buf
        self.next_id = 1
        self.rng = np.random.default_rng(seed)
        self.one_by_one = one_by_one  # n-step of one stream: a row per add

    def add(self, k: int) -> None:
        ids = np.arange(self.next_id, self.next_id + k)
        self.next_id += k
        if self.one_by_one:
            rows = _rows(ids)
            for i in range(k):
                self.buf.add({f: v[i] for f, v in rows.items()})
        else:
            self.buf.add(_rows(ids))

    def learn(self, b: int = 5) -> None:
        s = self.buf.sample(b)
        self.buf.update_priorities(s.indices, self.rng.normal(scale=2.0, size=b), keys=s.keys)

    def history(self) -> None:
        """Fill past the capacity (the ring has wrapped), with priorities and windows."""
        for k in (20, 17, 23, 9):
            self.add(k)
            self.learn()
        self.add(1)  # ids 1..70; 62 ends an episode: n-step windows pending (69, 70)


def _frozen(buf: Any) -> dict[str, Any]:
    """A deep copy of ``buf.state_dict()`` (its storage arrays are views)."""
    return copy.deepcopy(buf.state_dict())


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def assert_same_state(got: dict[str, Any], want: dict[str, Any], where: str = "") -> None:
    """Equal states: same keys, arrays of the same dtype, shape and values, other values equal."""
    assert isinstance(got, dict) and isinstance(want, dict), where
    assert sorted(got) == sorted(want), where
    for key, w in want.items():
        g = got[key]
        at = f"{where}/{key}"
        if isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray), at
            assert (g.dtype, g.shape) == (w.dtype, w.shape), at
            np.testing.assert_array_equal(g, w, err_msg=at)
        elif isinstance(w, dict):
            assert_same_state(g, w, at)
        else:
            assert _plain(g) == _plain(w), at


def _bounded(fn: Callable[[], Any], timeout: float = CALL_TIMEOUT) -> Any:
    """Run ``fn`` in another thread; fail if it has not returned within ``timeout`` s."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish in {timeout} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


class PausingSave:
    """``buf.save(path)`` in a thread that pauses before and after each chunk of rows.

    The pause is in the saving thread, between two chunks, where the save does
    not hold the buffer's lock. ``pauses()`` yields once per pause; the save
    resumes when the loop body returns.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, buf: Any, path: Path) -> None:
        self.buf, self.path = buf, path
        self.paused: queue.Queue[str] = queue.Queue()
        self.resume: queue.Queue[None] = queue.Queue()
        self.free = threading.Event()  # set: no more pauses
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._save, daemon=True)
        orig = ckpt._chunks

        def chunks(arr: Any) -> Iterator[memoryview]:
            lazy = isinstance(arr, ckpt.LazyArray)
            if lazy:
                self._pause()
            for view in orig(arr):
                yield view
                if lazy:
                    self._pause()

        monkeypatch.setattr(ckpt, "_LAZY_CHUNK", 64)  # a few rows per chunk: many chunks
        monkeypatch.setattr(ckpt, "_chunks", chunks)

    def _pause(self) -> None:
        if self.free.is_set() or threading.current_thread() is not self.thread:
            return
        self.paused.put("paused")
        try:
            self.resume.get(timeout=TIMEOUT)
        except queue.Empty:
            self.free.set()  # nobody is driving: finish

    def _save(self) -> None:
        try:
            self.buf.save(self.path)
        except BaseException as exc:
            self.error = exc

    def start(self) -> PausingSave:
        self.thread.start()
        return self

    def pauses(self) -> Iterator[int]:
        """Yield the pause number at each pause, until the save has finished."""
        deadline = time.monotonic() + TIMEOUT
        i = 0
        while True:
            try:
                self.paused.get(timeout=0.02)
            except queue.Empty:
                if not self.thread.is_alive():
                    return
                assert time.monotonic() < deadline, "the save neither paused nor finished"
                continue
            try:
                yield i
            finally:
                self.resume.put(None)
            i += 1

    def finish(self) -> None:
        self.free.set()
        for _ in range(4):
            self.resume.put(None)
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "the save did not finish"
        if self.error is not None:
            raise self.error


KINDS = ["uniform", "proportional", "rank", "nstep"]


# ---------------------------------------------------------------------------
# (a) other threads proceed while a save is in progress
# ---------------------------------------------------------------------------


def test_add_sample_update_proceed_while_a_save_is_paused(tmp_path, monkeypatch):
    buf = _make("proportional")
    adder = Adder(buf)
    adder.history()
    saving = PausingSave(monkeypatch, buf, tmp_path / "b.fpk").start()
    done_during = 0
    try:
        for i in saving.pauses():
            if i in (0, 3, 11):
                before = buf.total_added
                _bounded(lambda: adder.add(5))
                _bounded(adder.learn)
                # still paused: the save is not over, yet the calls went through
                assert saving.thread.is_alive()
                assert len(buf._guards) == 1
                assert buf.total_added == before + 5
                done_during += 1
    finally:
        saving.finish()
    assert done_during == 3
    assert not buf._guards  # the guard is gone once the save is over


# ---------------------------------------------------------------------------
# (b) the file holds the state at the snapshot, whatever happens meanwhile
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_file_holds_the_snapshot_while_adds_wrap_the_ring(kind, tmp_path, monkeypatch):
    buf = _make(kind)
    adder = Adder(buf, seed=1, one_by_one=kind == "nstep")
    adder.history()
    if kind == "nstep":
        assert buf.n_pending > 0  # a pending window at the snapshot
    want = _frozen(buf)
    added0 = buf.total_added
    saving = PausingSave(monkeypatch, buf, tmp_path / "b.fpk").start()
    pauses = 0
    try:
        for i in saving.pauses():
            pauses += 1
            # varied batch sizes: writes that wrap, that land on rows already
            # written and on rows still to write
            _bounded(lambda i=i: adder.add(1 + (7 * i) % 11))
            if i % 3 == 0:
                _bounded(adder.learn)
    finally:
        saving.finish()
    assert pauses > 20
    assert buf.total_added - added0 >= 2 * CAPACITY  # every slot was overwritten meanwhile
    assert buf.state_dict()["writer"] != want["writer"]
    loaded = fastper.load(tmp_path / "b.fpk")
    assert_same_state(loaded.state_dict(), want)


@pytest.mark.parametrize("erasing", [False, True], ids=["ram-storage", "erasing-storage"])
@pytest.mark.parametrize("kind", ["proportional", "rank", "nstep"])
def test_clear_during_a_save_still_writes_the_snapshot(kind, erasing, tmp_path, monkeypatch):
    # The default storage keeps rows past the ring's size in memory after
    # clear(); one that erases them on clear() (a legitimate ReplayStorage)
    # shows whether clear() itself keeps the rows the save still needs.
    storage = ErasingStorage(_make(kind).storage.fields, CAPACITY) if erasing else None
    buf = _make(kind, storage)
    adder = Adder(buf, seed=2, one_by_one=kind == "nstep")
    adder.history()
    want = _frozen(buf)
    saving = PausingSave(monkeypatch, buf, tmp_path / "b.fpk").start()
    try:
        for i in saving.pauses():
            if i == 2:
                _bounded(buf.clear)
                assert len(buf) == 0
            elif i in (4, 9):
                _bounded(lambda: adder.add(13))
                _bounded(buf.clear)
    finally:
        saving.finish()
    assert len(buf) == 0
    loaded = fastper.load(tmp_path / "b.fpk")
    assert_same_state(loaded.state_dict(), want)


class ErasingStorage(Storage):
    """RAM storage whose clear() zeroes every row."""

    def clear(self) -> None:
        for col in self.columns.values():
            col[...] = 0


class CustomStorage(Storage):
    """The RAM storage under another type: buffers treat it as a custom storage."""


@pytest.mark.parametrize("custom", [False, True], ids=["ram-storage", "custom-storage"])
def test_load_state_dict_during_a_save_still_writes_the_snapshot(tmp_path, monkeypatch, custom):
    # a custom storage is loaded in place: load_state_dict must wait for the save
    storage = CustomStorage(_make("proportional").storage.fields, CAPACITY) if custom else None
    buf = _make("proportional", storage) if custom else _make("proportional")
    adder = Adder(buf, seed=4)
    adder.history()
    want = _frozen(buf)
    other = _make("proportional")
    Adder(other, seed=5).add(30)
    other_state = _frozen(other)
    saving = PausingSave(monkeypatch, buf, tmp_path / "b.fpk").start()
    loader = None
    try:
        for i in saving.pauses():
            if i == 1:
                # load_state_dict waits for the save in progress (it streams rows
                # outside the lock): it must still be waiting while the save is paused
                loader = threading.Thread(target=buf.load_state_dict, args=(other_state,))
                loader.start()
                loader.join(0.5)
                assert loader.is_alive()
    finally:
        saving.finish()
    assert loader is not None
    loader.join(CALL_TIMEOUT)
    assert not loader.is_alive()
    assert_same_state(buf.state_dict(), other_state)
    assert_same_state(fastper.load(tmp_path / "b.fpk").state_dict(), want)


# ---------------------------------------------------------------------------
# (d) saves of one buffer run one at a time
# ---------------------------------------------------------------------------


def test_two_saves_from_two_threads_run_one_at_a_time(tmp_path, monkeypatch):
    buf = _make("rank")
    adder = Adder(buf, seed=6)
    adder.history()
    want = _frozen(buf)
    first = PausingSave(monkeypatch, buf, tmp_path / "first.fpk")
    writing: list[str] = []  # the thread of every chunk written, in order
    orig = ckpt._chunks  # first's pausing wrapper

    def chunks(arr: Any) -> Iterator[memoryview]:
        for view in orig(arr):
            writing.append(threading.current_thread().name)
            yield view

    monkeypatch.setattr(ckpt, "_chunks", chunks)
    first.thread.name = "first"
    first.start()
    second = threading.Thread(
        target=lambda: buf.save(tmp_path / "second.fpk"), name="second", daemon=True
    )
    try:
        for i in first.pauses():
            if i == 0:
                second.start()
            if i < 5:
                time.sleep(0.05)  # the second save has all the time it needs to start
                assert second.is_alive() and "second" not in writing
    finally:
        first.finish()
    second.join(TIMEOUT)
    assert not second.is_alive()
    assert set(writing) == {"first", "second"}
    # every chunk of the first save before any of the second: no interleaving
    assert writing == sorted(writing, key=lambda name: name != "first")
    for name in ("first.fpk", "second.fpk"):
        assert_same_state(fastper.load(tmp_path / name).state_dict(), want)
