"""The build hook's copy of a warmup's files (setup.py): kept only for the sources it
was compiled from, and used by a build only for those.

An editable install into an empty kernel cache keeps ``warmup.tar`` (the files its
warmup wrote, and a digest of the package's sources). A later install (other extras)
keeps it while the sources are unchanged and its warmup compiles nothing; a build with
``FASTPER_BUILD_KERNEL_SEED`` starts from it only if the sources it builds have the
same digest. Tested here on small folders, without pip or numba (the wheel test runs
the real build).
"""

from __future__ import annotations

import gzip
import io
import random
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.packaging._build_hook import build_hook


@pytest.fixture(scope="module")
def hook() -> Any:
    return build_hook()


def _package(root: Path) -> Path:
    pkg = root / "fastper"
    (pkg / "_kernels" / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "_kernels" / "__init__.py").write_text("")
    (pkg / "_kernels" / "tree.py").write_text("def f():\n    return 1\n")
    (pkg / "_kernels" / "__pycache__" / "tree.cpython-311.py").write_text("compiled\n")
    (pkg / "py.typed").write_text("")
    return pkg


def _archive(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_the_sources_are_those_a_build_copies(hook: Any, tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    (pkg / ".scratch.py").write_text("")  # a dot file
    (pkg / ".ipynb_checkpoints").mkdir()  # a dot folder
    (pkg / ".ipynb_checkpoints" / "__init__.py").write_text("")
    (pkg / "a.b").mkdir()  # a folder with a dot: never a package
    (pkg / "a.b" / "__init__.py").write_text("")
    (pkg / "_kernels" / "_numba_cache").mkdir()  # no __init__.py: not a package
    (pkg / "_kernels" / "_numba_cache" / "stray.py").write_text("")
    (pkg / "_kernels" / "notes.txt").write_text("")
    outside = tmp_path / "linked"  # a subpackage reached through a symbolic link
    outside.mkdir()
    (outside / "__init__.py").write_text("")
    (outside / "more.py").write_text("")
    (pkg / "linked").symlink_to(outside, target_is_directory=True)
    names = [p.relative_to(pkg).as_posix() for p in hook._sources(pkg)]
    assert names == [
        "__init__.py", "_kernels/__init__.py", "_kernels/tree.py", "linked/__init__.py",
        "linked/more.py",
    ]  # fmt: skip


def test_the_digest_follows_every_source_and_nothing_else(hook: Any, tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    first = hook._digest(pkg)
    assert isinstance(first, bytes) and len(first) == 64
    assert hook._digest(pkg) == first
    # not the caches' files, nor other files
    (pkg / "_kernels" / "__pycache__" / "other.py").write_text("y\n")
    (pkg / "_kernels" / "notes.txt").write_text("text\n")
    assert hook._digest(pkg) == first
    # a source's content, a new source, a renamed one
    (pkg / "_kernels" / "tree.py").write_text("def f():\n    return 2\n")
    changed = hook._digest(pkg)
    assert changed != first
    (pkg / "_kernels" / "rank.py").write_text("")
    added = hook._digest(pkg)
    assert added not in (first, changed)
    (pkg / "_kernels" / "rank.py").rename(pkg / "_kernels" / "ranks.py")
    assert hook._digest(pkg) not in (first, changed, added)
    # a source that cannot be read (a dangling link): no digest
    (pkg / "_kernels" / "gone.py").symlink_to(tmp_path / "nowhere.py")
    assert hook._digest(pkg) is None


def test_the_digest_of_an_archive_is_read_safely(hook: Any, tmp_path: Path) -> None:
    good = tmp_path / "good.tar"
    _archive(good, {"a.nbi": b"i" * 5000, hook.DIGEST: b"f" * 64})
    assert hook._digest_of(good) == b"f" * 64
    assert hook._digest_of(tmp_path / "missing.tar") is None
    none = tmp_path / "none.tar"
    _archive(none, {"a.nbi": b"i"})  # (an archive of an earlier version: no digest)
    assert hook._digest_of(none) is None
    big = tmp_path / "big.tar"
    _archive(big, {hook.DIGEST: b"f" * 1000})
    assert hook._digest_of(big) is None
    empty = tmp_path / "empty.tar"
    _archive(empty, {hook.DIGEST: b""})
    assert hook._digest_of(empty) is None
    for cut in (700, 5700):  # in the first member's data; in the digest's header
        corrupt = tmp_path / f"corrupt{cut}.tar"
        corrupt.write_bytes(good.read_bytes()[:cut])
        assert hook._digest_of(corrupt) is None
    noisy = tmp_path / "noisy.tar"  # (data that does not compress)
    _archive(noisy, {"a.nbi": random.Random(0).randbytes(5000), hook.DIGEST: b"f" * 64})
    packed = tmp_path / "packed.tar.gz"  # compressed, and cut short
    packed.write_bytes(gzip.compress(noisy.read_bytes())[:3000])
    assert hook._digest_of(packed) is None
    text = tmp_path / "text.tar"
    text.write_text("not an archive")
    assert hook._digest_of(text) is None


def test_a_copy_written_reads_back_with_its_digest_and_seeds_a_build(
    hook: Any, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tree.f-1.py311.nbi").write_bytes(b"index")
    (cache / "tree.f-1.py311.1.nbc").write_bytes(b"code")
    (cache / "other.txt").write_bytes(b"not a cache file")
    hook._write_snapshot(cache, b"a" * 64)
    assert not (cache / (hook.SNAPSHOT + ".part")).exists()
    assert hook._digest_of(cache / hook.SNAPSHOT) == b"a" * 64
    with tarfile.open(cache / hook.SNAPSHOT) as tf:
        assert sorted(tf.getnames()) == sorted(
            [hook.DIGEST, "tree.f-1.py311.1.nbc", "tree.f-1.py311.nbi"]
        )
    built = tmp_path / "built"
    hook._seed(built, str(cache), b"a" * 64)
    assert sorted(p.name for p in built.iterdir()) == ["tree.f-1.py311.1.nbc", "tree.f-1.py311.nbi"]
    assert (built / "tree.f-1.py311.1.nbc").read_bytes() == b"code"
    # a cache that cannot be written: no copy, no error
    hook._write_snapshot(tmp_path / "no-such-folder", b"a" * 64)
    assert not (tmp_path / "no-such-folder").exists()


def test_an_install_keeps_the_copy_only_for_the_sources_it_was_made_from(
    hook: Any, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    snapshot = cache / hook.SNAPSHOT
    # an empty cache (or none yet): the warmup's files are to be kept
    assert hook._editable_start(cache, b"a" * 64) == (True, False)
    assert hook._editable_start(tmp_path / "not-made-yet", b"a" * 64) == (True, False)
    # no digest (a source could not be read): no copy is made
    assert hook._editable_start(cache, None) == (False, False)
    # an empty cache beside a copy (its files removed by hand): a new copy
    _archive(snapshot, {"tree.f-1.py311.nbi": b"i", hook.DIGEST: b"a" * 64})
    assert hook._editable_start(cache, b"a" * 64) == (True, False)
    assert not snapshot.exists()
    (cache / "tree.f-1.py311.nbi").write_bytes(b"i")
    _archive(snapshot, {"tree.f-1.py311.nbi": b"i", hook.DIGEST: b"a" * 64})
    # a filled cache with a copy of these sources' warmup (another install): kept
    assert hook._editable_start(cache, b"a" * 64) == (False, True)
    assert snapshot.is_file()
    # other sources: removed
    assert hook._editable_start(cache, b"b" * 64) == (False, False)
    assert not snapshot.exists()
    # a copy without a digest (an earlier version's), or no digest to compare: removed
    _archive(snapshot, {"tree.f-1.py311.nbi": b"i"})
    assert hook._editable_start(cache, b"a" * 64) == (False, False)
    assert not snapshot.exists()
    _archive(snapshot, {"tree.f-1.py311.nbi": b"i", hook.DIGEST: b"a" * 64})
    assert hook._editable_start(cache, None) == (False, False)
    assert not snapshot.exists()


def test_the_warmups_report_says_what_it_compiled(hook: Any) -> None:
    line = "57 kernel signatures compiled, 0 loaded, in 251.3 s into /x; not warmed: tiers (y)"
    assert hook._compiled(line) == 57
    assert hook._compiled("a warning first\n0 kernel signatures compiled, 54 loaded") == 0
    assert hook._compiled("") is None
    assert hook._compiled("compiled 3") is None


def test_a_build_starts_from_the_copy_only_for_the_same_sources(
    hook: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seed = tmp_path / "seed"
    seed.mkdir()
    _archive(seed / hook.SNAPSHOT, {
        "tree.f-1.py311.nbi": b"index", "tree.f-1.py311.1.nbc": b"code",
        "notes.txt": b"not a cache file", "sub/tree.g-2.py311.nbi": b"in a folder",
        hook.DIGEST: b"a" * 64,
    })  # fmt: skip
    other = tmp_path / "other"
    hook._seed(other, str(seed), b"b" * 64)
    assert not other.exists()
    assert "compiled from other sources; compiling from nothing" in capsys.readouterr().out
    hook._seed(other, str(seed), None)
    assert not other.exists()
    assert "sources to build could not be read" in capsys.readouterr().out
    same = tmp_path / "same"
    hook._seed(same, str(seed), b"a" * 64)
    assert sorted(p.name for p in same.iterdir()) == ["tree.f-1.py311.1.nbc", "tree.f-1.py311.nbi"]
    assert (same / "tree.f-1.py311.nbi").read_bytes() == b"index"
    assert "2 cache files of a warmup copied" in capsys.readouterr().out
    # a copy of an earlier version (no digest): not used
    old = tmp_path / "old"
    old.mkdir()
    _archive(old / hook.SNAPSHOT, {"tree.f-1.py311.nbi": b"index"})
    hook._seed(tmp_path / "from-old", str(old), b"a" * 64)
    assert not (tmp_path / "from-old").exists()
    assert "names no sources" in capsys.readouterr().out
    # no copy at all, or no seed asked for: nothing
    hook._seed(tmp_path / "none", str(tmp_path / "empty-dir"), b"a" * 64)
    assert "no copy of a warmup's files" in capsys.readouterr().out
    hook._seed(tmp_path / "none", None, b"a" * 64)
    assert not (tmp_path / "none").exists()
    assert capsys.readouterr().out == ""


def test_a_seed_folder_that_cannot_be_read_is_said_and_skipped(
    hook: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seed = tmp_path / "seed"
    seed.mkdir()
    _archive(seed / hook.SNAPSHOT, {"a.nbi": b"i", hook.DIGEST: b"a" * 64})

    def denied(self: Path) -> bool:  # (a folder without search permission, for root too)
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", denied)
    hook._seed(tmp_path / "built", str(seed), b"a" * 64)
    monkeypatch.undo()
    assert "could not be read" in capsys.readouterr().out
    assert not (tmp_path / "built").exists()
