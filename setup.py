"""Build hook: the wheel carries fastper's numba kernels, compiled on the building machine.

Everything else about the package is in pyproject.toml. After ``build_py`` has
copied the package, ``python -m fastper.warmup`` runs on that copy and compiles
every kernel into ``fastper/_kernels/_numba_cache`` (see
``src/fastper/_kernels/_jit.py``), which the wheel then contains: installed on
the same kind of machine with the same numba version, the first learner step
loads them instead of compiling them. Elsewhere they simply miss and are
compiled on first use, as without this hook. An editable install compiles them
into the source tree's cache instead.

The hook never fails the build: without numba in the build environment, or if
compiling fails, it says so and the package is built without the cache. Set
``FASTPER_BUILD_KERNEL_CACHE=0`` to skip it (a wheel for other machines).

An editable install into an empty cache also keeps a copy of what its warmup
wrote (the archive ``warmup.tar`` in the cache: a file, not a folder, which the
package discovery would take for a package), with a digest of the package's
Python sources it was compiled from. A later install into the filled cache (other
extras, say) keeps the copy while the sources are unchanged and its warmup
succeeds and compiles nothing, and removes it otherwise: it cannot tell the
warmup's files from the others in the cache. A later build on the same machine
may start from it:
``FASTPER_BUILD_KERNEL_SEED=<that cache directory>`` (an absolute path) copies
those files into the package copy before the warmup, which then loads them instead
of compiling them again (a CI job that installs the tree, then builds the wheel),
if the package copy's sources have the same digest (else it compiles from nothing).
The wheel then holds what a build from nothing would make: the warmup's files.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SKIP_ENV = "FASTPER_BUILD_KERNEL_CACHE"
SEED_ENV = "FASTPER_BUILD_KERNEL_SEED"
#: in a cache an editable install's warmup filled from nothing: a copy of its files
SNAPSHOT = "warmup.tar"
#: the archive's member holding the digest of the sources its files were compiled from
DIGEST = "sources.sha256"
#: run in the package copy: checks that it imports that copy, then warms it up
_WARM = """
import sys
from pathlib import Path
import fastper
root = Path(sys.argv[1]).resolve()
if Path(fastper.__file__).resolve().parent != root / "fastper":
    sys.exit(f"imported fastper from {fastper.__file__}, not from {root}")
from fastper.warmup import warmup
r = warmup()
print(f"{r.compiled} kernel signatures compiled, {r.loaded} loaded, in {r.seconds:.1f} s "
      f"into {r.cache_dir}" + "".join(f"; not warmed: {s}" for s in r.skipped))
"""


class BuildPyWithKernelCache(build_py):
    """``build_py``, then the kernels compiled into the built package's cache."""

    def run(self) -> None:
        super().run()
        if os.environ.get(SKIP_ENV, "1") == "0":
            print(f"fastper: {SKIP_ENV}=0: the wheel carries no compiled kernels")
            return
        if self.editable_mode:  # the package is the source tree itself
            root = Path(self.get_package_dir("fastper")).resolve().parent
        else:
            root = Path(self.build_lib).resolve()
        _warm(root, self.editable_mode)


def _warm(root: Path, editable: bool) -> None:
    """Compile the kernels of the package in ``root`` into its cache (see the module):
    ``editable``: ``root`` is the source tree (the copy of the warmup's files is kept
    or made there), else a build's copy (seeded from ``FASTPER_BUILD_KERNEL_SEED``)."""
    cache = root / "fastper" / "_kernels" / "_numba_cache"
    seed = os.environ.get(SEED_ENV)
    make = kept = False  # (editable) copy the warmup's files after it / a copy stayed
    if not editable:  # (a build's copy starts from nothing, or from the seed)
        shutil.rmtree(cache, ignore_errors=True)
    try:
        digest = _digest(root / "fastper") if editable or seed else None
        if editable:
            make, kept = _editable_start(cache, digest)
        else:
            _seed(cache, seed, digest)
    except Exception as exc:  # (the hook never fails the build)
        print(f"fastper: no copy of a warmup's files used or kept ({exc!r})")
        digest, make, kept = None, False, False
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NUMBA_CACHE_DIR", "NUMBA_DISABLE_JIT", "NUMBA_CACHE_LOCATOR_CLASSES")
    }
    # first on the path; pip's isolated build environment is reached through the rest
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    print("fastper: compiling the numba kernels into the package (about a minute) ...")
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _WARM, str(root)], cwd=root, env=env, capture_output=True,
            text=True, errors="replace", timeout=1800,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"fastper: kernels not compiled ({exc}); they compile on first use")
        done = None
    if done is not None and done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"fastper: kernels not compiled ({tail}); they compile on first use")
        done = None
    if done is None:
        if kept:  # (it may have compiled some before it failed: the copy may not match)
            _remove(cache / SNAPSHOT)
        return
    print(f"fastper: {done.stdout.strip()} ({time.monotonic() - t0:.0f} s in all)")
    if kept and _compiled(done.stdout) != 0:
        # this warmup compiled what the cache lacked (another numba, say): the copy no
        # longer holds what a warmup of these sources writes here
        _remove(cache / SNAPSHOT)
    if make and digest is not None:
        _write_snapshot(cache, digest)


def _editable_start(cache: Path, digest: bytes | None) -> tuple[bool, bool]:
    """Before an editable install's warmup into ``cache``: ``(make, kept)``. ``make``:
    the cache holds no compiled files and the sources have a ``digest``, so the
    warmup's files are to be kept as a copy (see the module). ``kept``: a copy made
    from sources of this ``digest`` stays; any other copy is removed."""
    filled = any(cache.glob("*.nb[ic]"))
    if digest is not None and filled and _digest_of(cache / SNAPSHOT) == digest:
        return False, True  # (the copy of a warmup of these very sources stays)
    if not _remove(cache / SNAPSHOT):
        return False, False  # (then it cannot be written either)
    return digest is not None and not filled, False


def _remove(path: Path) -> bool:
    """Remove the file ``path`` if it is there; whether it is gone."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        return False
    return True


def _compiled(report: str) -> int | None:
    """How many kernel signatures the warmup's report says it compiled (None: unread)."""
    found = re.search(r"^(\d+) kernel signatures compiled", report, re.M)
    return None if found is None else int(found[1])


def _write_snapshot(cache: Path, digest: bytes) -> None:
    """Keep a copy of the compiled files in ``cache`` (``SNAPSHOT``), with ``digest``
    (``DIGEST``): written to a ``.part`` file, then renamed. Nothing on failure."""
    part = cache / (SNAPSHOT + ".part")
    try:
        with tarfile.open(part, "w") as tf:
            for path in sorted(cache.glob("*.nb[ic]")):
                tf.add(path, arcname=path.name)
            info = tarfile.TarInfo(DIGEST)
            info.size = len(digest)
            tf.addfile(info, io.BytesIO(digest))
        os.replace(part, cache / SNAPSHOT)
    except Exception:  # (no copy: a later build compiles; the hook never fails the build)
        _remove(part)


def _sources(package: Path) -> list[Path]:
    """The package's Python sources as a build copies them (setuptools' package
    discovery, namespace packages included, then its modules): ``*.py`` files not
    named with a leading dot, in the package and every folder below it whose name
    has no dot and does not end with ``__pycache__`` (symbolic links followed). A
    folder that cannot be read raises ``OSError``."""

    def refuse(error: OSError) -> None:
        raise error

    found = []
    for folder, subfolders, files in os.walk(package, onerror=refuse, followlinks=True):
        here = Path(folder)
        subfolders[:] = [d for d in subfolders if "." not in d and not d.endswith("__pycache__")]
        found += [here / f for f in files if f.endswith(".py") and not f.startswith(".")]
    return sorted(found)


def _digest(package: Path) -> bytes | None:
    """SHA-256 (hex, as bytes) of the package's Python sources (:func:`_sources`), by
    relative path and content; None where one cannot be read. What the warmup
    compiles follows from them (and from numba and the CPU, which numba's cache
    checks itself)."""
    h = hashlib.sha256()
    try:
        for path in _sources(package):
            name = os.fsencode(path.relative_to(package).as_posix())
            h.update(name + b"\0" + path.read_bytes() + b"\0")
    except (OSError, ValueError):
        return None
    return h.hexdigest().encode()


def _digest_of(snapshot: Path) -> bytes | None:
    """The digest stored in the archive ``snapshot``; None without one (or no archive)."""
    try:
        with tarfile.open(snapshot) as tf:
            member = tf.getmember(DIGEST)
            data = tf.extractfile(member) if member.isfile() and member.size <= 128 else None
            return (data.read() or None) if data is not None else None
    except Exception:  # (a missing, truncated or foreign file: no digest)
        return None


def _seed(cache: Path, seed: str | None, digest: bytes | None) -> None:
    """Start ``cache`` from the copy an editable install's warmup left in the cache
    ``seed`` (see the module), if it was compiled from sources of this ``digest``;
    nothing otherwise, saying why."""
    if not seed:
        return
    snapshot = Path(seed) / SNAPSHOT
    why = None
    try:
        if not snapshot.is_file():
            why = (f"no copy of a warmup's files in {seed} (an editable install into an "
                   "empty cache makes one)")  # fmt: skip
        elif digest is None:
            why = "the sources to build could not be read"
        else:
            stored = _digest_of(snapshot)
            if stored is None:
                why = f"the copy of a warmup's files in {seed} names no sources (or is unreadable)"
            elif stored != digest:
                why = f"the copy of a warmup's files in {seed} was compiled from other sources"
    except Exception as exc:
        why = f"{seed} could not be read ({exc!r})"
    if why is not None:
        print(f"fastper: {SEED_ENV}: {why}; compiling from nothing")
        return
    try:
        cache.mkdir(parents=True, exist_ok=True)
        copied = 0
        with tarfile.open(snapshot) as tf:
            for member in tf.getmembers():
                name = member.name
                if member.isfile() and "/" not in name and name.endswith((".nbi", ".nbc")):
                    data = tf.extractfile(member)
                    if data is not None:
                        (cache / name).write_bytes(data.read())
                        copied += 1
    except Exception as exc:
        print(f"fastper: {SEED_ENV}: not seeded ({exc!r}); compiling from nothing")
        shutil.rmtree(cache, ignore_errors=True)
        return
    print(f"fastper: {SEED_ENV}: {copied} cache files of a warmup copied from {snapshot}")


if __name__ == "__main__":  # (how setuptools runs it; the tests import its helpers)
    setup(cmdclass={"build_py": BuildPyWithKernelCache})
