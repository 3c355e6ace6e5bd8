"""A missing optional dependency is one line naming the extra to install, never a traceback.

Each case runs in a fresh interpreter whose import system refuses the named
modules (a meta-path finder that raises ModuleNotFoundError for them, as when
they are not installed), so the test does not depend on what this machine has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fastper.errors import EXTRAS, MissingExtraError, install_hint, missing_extra, require

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.abc, sys
BLOCKED = set({blocked!r})

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _NotInstalled())
for _m in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
    del sys.modules[_m]
"""


def _python(blocked: list[str], code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = BLOCKER.format(blocked=blocked) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _cli(blocked: list[str], argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m fastper ARGV`` (what the ``fastper`` script runs) with ``blocked`` missing."""
    code = f"""
    import runpy
    sys.argv = ["fastper", *{argv!r}]
    runpy.run_module("fastper", run_name="__main__")
    """
    return _python(blocked, code, cwd)


@pytest.mark.parametrize(
    ("blocked", "argv", "line"),
    [
        (["tqdm"], ["train", "dqn", "--steps", "10", "--out", "runs"],
         'fastper train needs the agents extra (tqdm is not installed): pip install "fastper[agents]" (in a clone: pip install -e ".[agents]")'),
        (["torch", "gymnasium"], ["train", "sac", "--out", "runs"],
         "fastper train needs the agents extra (torch, gymnasium are not installed): "
         'pip install "fastper[agents]" (in a clone: pip install -e ".[agents]")'),
        (["minatar"], ["train", "dqn", "--env", "MinAtar/Breakout-v1", "--out", "runs"],
         "fastper train --env MinAtar/Breakout-v1 needs the minatar extra (minatar is not "
         'installed): pip install "fastper[minatar]" (in a clone: pip install -e ".[minatar]")'),
        (["matplotlib"], ["plot", "runs", "-o", "curve.png"],
         'fastper plot needs the agents extra (matplotlib is not installed): pip install "fastper[agents]" (in a clone: pip install -e ".[agents]")'),
        (["scipy"], ["compare", "runs"],
         'fastper compare needs the agents extra (scipy is not installed): pip install "fastper[agents]" (in a clone: pip install -e ".[agents]")'),
    ],
)  # fmt: skip
def test_a_command_without_its_extra_prints_one_line_and_exits_2(
    tmp_path: Path, blocked: list[str], argv: list[str], line: str
) -> None:
    (tmp_path / "runs").mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    done = _cli(blocked, argv, tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr == line + "\n", done.stderr  # the whole of stderr: no traceback
    assert done.stdout == ""
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


def test_an_extra_installed_but_broken_is_named_with_its_error(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "tqdm").mkdir(parents=True)
    (site / "tqdm" / "__init__.py").write_text("raise ImportError('broken build of tqdm')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), str(ROOT / "src")])))
    done = subprocess.run(
        [sys.executable, "-m", "fastper", "train", "dqn", "--out", "runs"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == (
        "fastper train needs the agents extra (import tqdm failed: broken build of tqdm): "
        'pip install "fastper[agents]" (in a clone: pip install -e ".[agents]")\n'
    )
    assert not (tmp_path / "runs").exists()


def test_commands_that_need_no_extra_run_without_any(tmp_path: Path) -> None:
    every = sorted(set(EXTRAS))
    done = _cli(every, ["bench", "--capacity", "256", "--batch-size", "8", "--calls", "3"],
                tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "sample" in done.stdout


LIBRARY = """
import json
out = {}
def attempt(name, call):
    try:
        call()
    except ImportError as exc:
        out[name] = [type(exc).__name__, str(exc), getattr(exc, "extra", None)]
    else:
        out[name] = None
"""


def test_library_entry_points_without_their_extra_name_it_in_one_line(tmp_path: Path) -> None:
    code = LIBRARY + textwrap.dedent("""
    import numpy as np
    import fastper
    attempt("device", lambda: __import__("fastper.device"))
    from fastper.distributed import sharded_on_ray
    attempt("ray", lambda: sharded_on_ray(2, 8, {"x": ((), np.float64)}))
    from fastper.tiers import TieredStorage
    for codec in ("lz4", "zstd", "blosc2"):
        attempt(codec, lambda: TieredStorage({"x": ((), np.float64)}, 64, codec=codec))
    print(json.dumps(out))
    """)
    done = _python(["torch", "ray", "lz4", "zstandard", "blosc2"], code, tmp_path)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    want = {
        "device": "fastper.device needs the torch extra (torch is not installed): "
        'pip install "fastper[torch]" (in a clone: pip install -e ".[torch]")',
        "ray": "fastper's Ray back end needs the ray extra (ray is not installed): "
        'pip install "fastper[ray]" (in a clone: pip install -e ".[ray]")',
        "lz4": "fastper.tiers' codec 'lz4' needs the tiers extra (lz4 is not installed): "
        'pip install "fastper[tiers]" (in a clone: pip install -e ".[tiers]")',
        "zstd": "fastper.tiers' codec 'zstd' needs the tiers extra (zstandard is not "
        'installed): pip install "fastper[tiers]" (in a clone: pip install -e ".[tiers]")',
        "blosc2": "fastper.tiers' codec 'blosc2' needs the tiers extra (blosc2 is not "
        'installed): pip install "fastper[tiers]" (in a clone: pip install -e ".[tiers]")',
    }
    for name, message in want.items():
        assert got[name] is not None, f"{name}: no error without the module"
        kind, text, extra = got[name]
        assert kind == "MissingExtraError" and text == message, got[name]
        assert extra == message.split("fastper[")[1].split("]")[0]


def test_the_auto_codec_falls_back_to_zlib_with_a_one_line_hint(tmp_path: Path) -> None:
    code = """
    import warnings, numpy as np
    from fastper.tiers import TieredStorage
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        s = TieredStorage({"x": ((), np.float64)}, 64)
    print(s.codec.name)
    print(str(seen[0].message))
    """
    done = _python(["lz4", "zstandard", "blosc2"], code, tmp_path)
    assert done.returncode == 0, done.stderr
    name, message = done.stdout.splitlines()
    assert name == "zlib"
    assert message.endswith('pip install "fastper[tiers]" (in a clone: pip install -e ".[tiers]")'), message


def test_require_and_missing_extra() -> None:
    import math

    assert require("math", "anything") is math
    with pytest.raises(MissingExtraError) as info:
        require("fastper_no_such_module.sub", "the thing", "agents")
    exc = info.value
    assert isinstance(exc, ImportError) and isinstance(exc, ModuleNotFoundError)
    assert exc.extra == "agents" and exc.name == "fastper_no_such_module"  # the one missing
    assert str(exc) == (
        "the thing needs the agents extra (fastper_no_such_module is not installed): "
        'pip install "fastper[agents]" (in a clone: pip install -e ".[agents]")'
    )
    # installed but failing to import: says so, with the error's first line
    broken = ImportError("libcudart.so.12: cannot open shared object file\nmore detail")
    text = str(missing_extra("fastper.device", broken, module="torch"))
    assert text == (
        "fastper.device needs the torch extra (import torch failed: libcudart.so.12: cannot "
        'open shared object file): pip install "fastper[torch]" (in a clone: pip install -e ".[torch]")'
    )
    assert install_hint("ray") == 'pip install "fastper[ray]" (in a clone: pip install -e ".[ray]")'
    # every extra named is one the package declares
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(EXTRAS.values()) <= set(declared)
