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
import subprocess
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
    src = tmp_path / "src"
    pkg = _package(src)
    (pkg / ".scratch.py").write_text("")  # a dot file
    (pkg / ".ipynb_checkpoints").mkdir()  # a dot folder
    (pkg / ".ipynb_checkpoints" / "x.py").write_text("")
    (pkg / "a.b").mkdir()  # a folder with a dot: never a package
    (pkg / "a.b" / "__init__.py").write_text("")
    (pkg / "_kernels" / "_numba_cache").mkdir()  # no __init__.py: a namespace package
    (pkg / "_kernels" / "_numba_cache" / "stray.py").write_text("")
    (pkg / "_kernels" / "_numba_cache" / "tree.f-1.py311.nbi").write_bytes(b"")
    (pkg / "_kernels" / "notes.txt").write_text("")
    outside = tmp_path / "elsewhere" / "linked"  # a subpackage reached through a link
    outside.mkdir(parents=True)
    (outside / "__init__.py").write_text("")
    (outside / "more.py").write_text("")
    (pkg / "linked").symlink_to(outside, target_is_directory=True)
    names = [p.relative_to(pkg).as_posix() for p in hook._sources(pkg)]
    assert names == [
        "__init__.py", "_kernels/__init__.py", "_kernels/_numba_cache/stray.py",
        "_kernels/tree.py", "linked/__init__.py", "linked/more.py",
    ]  # fmt: skip
    # what setuptools itself finds: pyproject's `packages.find` (namespace packages
    # included), then each package's modules as build_py globs them
    from setuptools.config.expand import find_packages

    packages = find_packages(where=[str(src)], root_dir=str(src))
    copied = sorted(
        f.relative_to(pkg).as_posix()
        for name in packages
        for f in (src / name.replace(".", "/")).glob("*.py")
        if not f.name.startswith(".")  # (glob.glob's "*" skips them; pathlib's may not)
    )
    assert copied == names


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
    # a cache that cannot be written (a file where the folder should be): no copy, and
    # no error (the hook never fails the build)
    blocked = tmp_path / "blocked"
    blocked.write_bytes(b"a file")
    assert hook._write_snapshot(blocked, b"a" * 64) is None
    assert blocked.read_bytes() == b"a file"


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
    # a copy that cannot be removed (a folder in its place): none is made either
    snapshot.mkdir()
    assert hook._editable_start(cache, b"b" * 64) == (False, False)
    assert snapshot.is_dir()


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


class _Warmup:
    """Stands in for the warmup subprocess: writes ``files`` into the package's cache
    and answers ``report`` (or fails), and records what the cache held when called."""

    def __init__(self, report: str, files: tuple[str, ...] = (), code: int = 0,
                 error: Exception | None = None) -> None:  # fmt: skip
        self.report, self.files, self.code, self.error = report, files, code, error
        self.seen: list[str] | None = None

    def __call__(self, cmd: list[str], cwd: Path, **kw: Any) -> subprocess.CompletedProcess[str]:
        cache = Path(cmd[-1]) / "fastper" / "_kernels" / "_numba_cache"
        self.seen = sorted(p.name for p in cache.glob("*")) if cache.is_dir() else []
        if self.error is not None:
            raise self.error
        cache.mkdir(parents=True, exist_ok=True)
        for name in self.files:
            (cache / name).write_bytes(b"compiled")
        return subprocess.CompletedProcess(cmd, self.code, self.report, "Traceback\nboom")


def _tree(root: Path) -> Path:
    _package(root)
    return root / "fastper" / "_kernels" / "_numba_cache"


@pytest.mark.parametrize(
    ("warmup", "stays"),
    [
        (_Warmup("0 kernel signatures compiled, 54 loaded, in 1.0 s"), True),
        (
            _Warmup("3 kernel signatures compiled, 51 loaded, in 9.0 s", ("lz4.f-1.py311.nbi",)),
            False,
        ),
        (_Warmup("no report"), False),
        (_Warmup("", code=1), False),
        (_Warmup("", error=subprocess.TimeoutExpired("python", 1800)), False),
    ],
    ids=["compiled-nothing", "compiled-some", "unread-report", "failed", "timed-out"],
)
def test_an_install_keeps_a_copy_only_if_its_warmup_compiled_nothing(
    hook: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warmup: _Warmup, stays: bool
) -> None:
    cache = _tree(tmp_path)
    cache.mkdir()
    (cache / "tree.f-1.py311.nbi").write_bytes(b"i")
    digest = hook._digest(tmp_path / "fastper")
    _archive(cache / hook.SNAPSHOT, {"tree.f-1.py311.nbi": b"i", hook.DIGEST: digest})
    monkeypatch.setattr(hook.subprocess, "run", warmup)
    hook._warm(tmp_path, editable=True)
    assert (cache / hook.SNAPSHOT).is_file() is stays
    if stays:
        assert hook._digest_of(cache / hook.SNAPSHOT) == digest


def test_an_install_into_an_empty_cache_makes_the_copy(
    hook: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _tree(tmp_path)
    warmup = _Warmup(
        "2 kernel signatures compiled, 0 loaded", ("a.f-1.py311.nbi", "a.f-1.py311.1.nbc")
    )
    monkeypatch.setattr(hook.subprocess, "run", warmup)
    hook._warm(tmp_path, editable=True)
    assert hook._digest_of(cache / hook.SNAPSHOT) == hook._digest(tmp_path / "fastper")
    with tarfile.open(cache / hook.SNAPSHOT) as tf:
        assert sorted(tf.getnames()) == sorted(
            [hook.DIGEST, "a.f-1.py311.1.nbc", "a.f-1.py311.nbi"]
        )
    # a failed warmup makes none
    (cache / hook.SNAPSHOT).unlink()
    for name in ("a.f-1.py311.nbi", "a.f-1.py311.1.nbc"):
        (cache / name).unlink()
    monkeypatch.setattr(hook.subprocess, "run", _Warmup("", code=1))
    hook._warm(tmp_path, editable=True)
    assert not (cache / hook.SNAPSHOT).exists()


def test_a_build_is_seeded_before_its_warmup_and_never_fails(
    hook: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "tree"
    cache = _tree(source)
    cache.mkdir()
    _archive(cache / hook.SNAPSHOT, {
        "a.f-1.py311.nbi": b"i", hook.DIGEST: hook._digest(source / "fastper"),
    })  # fmt: skip
    build = tmp_path / "build"
    built_cache = _tree(build)
    built_cache.mkdir()
    (built_cache / "left.f-1.py311.nbi").write_bytes(b"an earlier build's")
    monkeypatch.setenv(hook.SEED_ENV, str(cache))
    warmup = _Warmup("0 kernel signatures compiled, 1 loaded")
    monkeypatch.setattr(hook.subprocess, "run", warmup)
    hook._warm(build, editable=False)
    assert warmup.seen == ["a.f-1.py311.nbi"]  # (the build's cache emptied, then seeded)
    assert "1 cache files of a warmup copied" in capsys.readouterr().out
    # a digest that raises: said, and the build (or the install) goes on, from nothing
    monkeypatch.setattr(hook, "_digest", _raise)
    warmup = _Warmup("54 kernel signatures compiled, 0 loaded")
    monkeypatch.setattr(hook.subprocess, "run", warmup)
    hook._warm(build, editable=False)
    assert warmup.seen == []
    assert "no copy of a warmup's files used or kept" in capsys.readouterr().out
    hook._warm(source, editable=True)
    assert "no copy of a warmup's files used or kept" in capsys.readouterr().out


def _raise(package: Path) -> bytes:
    raise RuntimeError(f"cannot digest {package}")
