"""fastper's cache of compiled kernels (fastper._kernels._jit) and ``fastper warmup``.

The stamp follows the sources' bytes, never their modification times; the
directories are chosen as documented (NUMBA_CACHE_DIR, else the package, else
numba's user-wide folder; the package cache is read after the first); a kernel
in the package cache is loaded when another directory is written; a cache for
another CPU, and unreadable cache files, are misses that compile, never errors.
The subprocess cases use one small kernel (``ring.slot_keys``): about a second each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest

from fastper import cli, warmup
from fastper._kernels import _jit

ROOT = Path(__file__).resolve().parents[2]
#: calls ring.slot_keys once with index arrays of the dtype given as argv[1]; prints
#: its cache hits and misses in this process, and the result
KERNEL_CALL = """
import json, sys
import numpy as np
from fastper._kernels import ring
idx = np.arange(4, dtype=sys.argv[1])
out = np.empty(4, dtype=np.int64)
ring.slot_keys(idx, 0, 4, 8, out)
st = ring.slot_keys.stats
print(json.dumps({"hits": sum(st.cache_hits.values()), "misses": sum(st.cache_misses.values()),
                  "out": out.tolist()}))
"""


def _call(dtype: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    base["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, "-c", KERNEL_CALL, dtype],
        capture_output=True, text=True, timeout=300, env={**base, **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["out"] == [0, 1, 2, 3]  # whatever the cache did, the kernel's result
    return result


@pytest.fixture
def fresh_dirs():
    """cache_dirs() resolved again in this test, and as before after it."""
    _jit.cache_dirs.cache_clear()
    yield
    _jit.cache_dirs.cache_clear()


def test_a_kernels_stamp_follows_its_sources_and_what_they_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from .b import x\n")  # a inlines b's helpers
    (tmp_path / "b.py").write_text("from ._c import y\nx = 1\n")
    (tmp_path / "_c.py").write_text("y = 2\n")
    (tmp_path / "d.py").write_text("z = 3\n")
    a, d = _jit.stamp_of(tmp_path / "a.py"), _jit.stamp_of(tmp_path / "d.py")
    os.utime(tmp_path / "b.py", (1, 1))  # what an install does to modification times
    assert _jit.stamp_of(tmp_path / "a.py") == a
    (tmp_path / "_c.py").write_text("y = 3\n")  # imported by b, imported by a
    assert _jit.stamp_of(tmp_path / "a.py") != a
    assert _jit.stamp_of(tmp_path / "d.py") == d  # imports none of them
    (tmp_path / "_c.py").write_text("y = 2\n")
    assert _jit.stamp_of(tmp_path / "a.py") == a


def test_cache_dirs_in_the_documented_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_dirs: None
) -> None:
    own = _jit.SHARED_FOLDER
    shipped = _jit.PACKAGE_CACHE if _jit.PACKAGE_CACHE.is_dir() else None
    writable = {tmp_path / "user" / own, tmp_path / "numba-dir" / own}
    monkeypatch.setattr(_jit, "_writable", lambda path: path in writable)
    monkeypatch.setattr(_jit, "_user_wide_root", lambda: tmp_path / "user")

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "numba-dir"), raising=False)
    assert _jit.cache_dirs() == (tmp_path / "numba-dir" / own, shipped, True)

    _jit.cache_dirs.cache_clear()  # a read-only package: numba's user-wide folder
    monkeypatch.setattr(numba.config, "CACHE_DIR", "", raising=False)
    assert _jit.cache_dirs() == (tmp_path / "user" / own, shipped, True)

    _jit.cache_dirs.cache_clear()  # nothing writable: the package cache is only read
    writable.clear()
    assert _jit.cache_dirs() == (shipped, None, False)

    _jit.cache_dirs.cache_clear()  # a writable package: its own cache, nothing after it
    writable.add(_jit.PACKAGE_CACHE)
    assert _jit.cache_dirs() == (_jit.PACKAGE_CACHE, None, True)

    _jit.cache_dirs.cache_clear()  # NUMBA_CACHE_DIR not writable: the next in numba's order
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "numba-dir"), raising=False)
    assert _jit.cache_dirs() == (_jit.PACKAGE_CACHE, None, True)


def test_the_package_cache_is_read_when_numba_cache_dir_is_written(tmp_path: Path) -> None:
    dirs = _jit.cache_dirs()
    if dirs.first != _jit.PACKAGE_CACHE or not dirs.writable:
        pytest.skip(f"the package cache {_jit.PACKAGE_CACHE} is not writable here")
    _call("int64")  # now in the package cache (compiled, or there already)
    other = tmp_path / "numba-cache"
    assert _call("int64", NUMBA_CACHE_DIR=str(other)) == {"hits": 1, "misses": 0,
                                                           "out": [0, 1, 2, 3]}  # fmt: skip
    assert not list(other.rglob("*.nbi"))  # nothing written: it was loaded

    # the same kernel for another CPU: its own entry, compiled, not the host's code
    got = _call("int64", NUMBA_CACHE_DIR=str(other), NUMBA_CPU_NAME="generic")
    assert got["misses"] == 1 and got["hits"] == 0
    assert _call("int64", NUMBA_CACHE_DIR=str(other), NUMBA_CPU_NAME="generic")["hits"] == 1


def test_unreadable_cache_files_are_misses_not_errors(tmp_path: Path) -> None:
    cache = tmp_path / "numba-cache"
    # int16 slots: a signature the package cache does not hold, saved under NUMBA_CACHE_DIR
    assert _call("int16", NUMBA_CACHE_DIR=str(cache))["misses"] == 1
    assert _call("int16", NUMBA_CACHE_DIR=str(cache))["hits"] == 1
    data = sorted(cache.rglob("ring.slot_keys-*.nbc"))
    assert data
    for path in data:
        path.write_bytes(b"truncated")
    assert _call("int16", NUMBA_CACHE_DIR=str(cache))["misses"] == 1
    for path in cache.rglob("ring.slot_keys-*.nbi"):
        path.write_bytes(b"\x00not an index")
    assert _call("int16", NUMBA_CACHE_DIR=str(cache))["misses"] == 1


def test_a_data_file_of_another_signature_is_a_miss(tmp_path: Path) -> None:
    """Index entries swapped (what two processes saving at once can leave): each
    signature finds the other's code, which is never run: compiled again instead."""
    cache = tmp_path / "numba-cache"
    for dtype in ("int16", "int32"):
        assert _call(dtype, NUMBA_CACHE_DIR=str(cache))["misses"] == 1
    one, two = sorted(cache.rglob("ring.slot_keys-*.nbc"))
    swap = one.with_suffix(".swap")
    one.rename(swap)
    two.rename(one)
    swap.rename(two)
    for dtype in ("int16", "int32"):
        assert _call(dtype, NUMBA_CACHE_DIR=str(cache))["misses"] == 1  # result checked too


def test_warmup_prints_its_report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def missing_extra(rng: object) -> None:
        raise ImportError("no module named 'lz4'")

    monkeypatch.setattr(warmup, "PARTS", {"nothing": lambda rng: None, "lz4": missing_extra})
    assert warmup.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compiled"] == 0 and report["skipped"] == ["lz4 (no module named 'lz4')"]
    assert report["cache_dir"] == str(_jit.cache_dirs().first)

    assert cli.main(["warmup"]) == 0
    out = capsys.readouterr().out
    assert "0 kernel signatures compiled" in out and "not warmed: lz4" in out
    assert cli.main(["warmup", "--quiet"]) == 0
    assert capsys.readouterr().out == ""


def test_warmup_help_says_when_to_run_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["warmup", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "once per machine" in text and "Dockerfile" in text and "--json" in text


def test_warmup_names_every_kernel_python_calls() -> None:
    found = _jit.kernels()
    assert {"prioritized.prop_sample", "prioritized.prop_update", "rank_writes.write",
            "tree.sum_find", "frames.frame_plan", "nstep.plan_batch"} <= set(found)  # fmt: skip
    assert not [k for k, d in found.items() if d.targetoptions.get("inline") == "always"]
