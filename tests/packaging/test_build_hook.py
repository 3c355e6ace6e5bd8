"""The build hook's copy of a warmup's files (setup.py): kept only for the sources it
was compiled from, and used by a build only for those.

An editable install into an empty kernel cache keeps ``warmup.tar`` (the files its
warmup wrote, and a digest of the package's sources). A later install (other extras)
keeps it while the sources are unchanged; a build with ``FASTPER_BUILD_KERNEL_SEED``
starts from it only if the sources it builds have the same digest. Tested here on
small folders, without pip or numba (the wheel test runs the real build).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tests.packaging.test_wheel import build_hook


@pytest.fixture(scope="module")
def hook() -> Any:
    return build_hook()


def _package(root: Path) -> Path:
    pkg = root / "fastper"
    (pkg / "_kernels" / "__pycache__").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
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


def test_the_digest_follows_every_python_source_and_nothing_else(hook: Any, tmp_path: Path) -> None:
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


def test_the_digest_of_an_archive_is_read_safely(hook: Any, tmp_path: Path) -> None:
    good = tmp_path / "good.tar"
    _archive(good, {"a.nbi": b"i", hook.DIGEST: b"f" * 64})
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
    corrupt = tmp_path / "corrupt.tar"
    corrupt.write_bytes(good.read_bytes()[:700])
    assert hook._digest_of(corrupt) is None
    text = tmp_path / "text.tar"
    text.write_text("not an archive")
    assert hook._digest_of(text) is None


def test_an_install_keeps_the_copy_only_for_the_sources_it_was_made_from(
    hook: Any, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    snapshot = cache / hook.SNAPSHOT
    # an empty cache: the warmup's files will be kept
    assert hook._editable_start(cache, b"a" * 64) is True
    assert hook._editable_start(tmp_path / "not-made-yet", b"a" * 64) is True
    # no digest (a source could not be read): no copy is made
    assert hook._editable_start(cache, None) is False
    (cache / "tree.f-1.py311.nbi").write_bytes(b"i")
    _archive(snapshot, {"tree.f-1.py311.nbi": b"i", hook.DIGEST: b"a" * 64})
    # a filled cache with a copy of these sources' warmup (another install): kept
    assert hook._editable_start(cache, b"a" * 64) is False
    assert snapshot.is_file()
    # other sources: removed
    assert hook._editable_start(cache, b"b" * 64) is False
    assert not snapshot.exists()
    # a copy without a digest (an earlier version's), or none to compare: removed
    _archive(snapshot, {"tree.f-1.py311.nbi": b"i"})
    assert hook._editable_start(cache, b"a" * 64) is False
    assert not snapshot.exists()
    _archive(snapshot, {"tree.f-1.py311.nbi": b"i", hook.DIGEST: b"a" * 64})
    assert hook._editable_start(cache, None) is False
    assert not snapshot.exists()


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
    assert "compiled from other sources" in capsys.readouterr().out
    hook._seed(other, str(seed), None)
    assert not other.exists()
    same = tmp_path / "same"
    hook._seed(same, str(seed), b"a" * 64)
    assert sorted(p.name for p in same.iterdir()) == ["tree.f-1.py311.1.nbc", "tree.f-1.py311.nbi"]
    assert (same / "tree.f-1.py311.nbi").read_bytes() == b"index"
    assert "2 cache files of a warmup copied" in capsys.readouterr().out
    # no copy at all, or no seed asked for: nothing
    hook._seed(tmp_path / "none", str(tmp_path / "empty-dir"), b"a" * 64)
    assert "no copy of a warmup's files" in capsys.readouterr().out
    hook._seed(tmp_path / "none", None, b"a" * 64)
    assert not (tmp_path / "none").exists()
