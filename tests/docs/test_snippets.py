"""Every ```python block of README.md and docs/**/*.md runs as written.

Each page runs in a fresh temporary directory (its working directory), in a
subprocess with a timeout, its blocks in order in one namespace, the way a
reader pastes them into one session. A page that imports a library of an
extra that is not installed is skipped, naming it. Blocks that must not run
use another fence language (```text, ```console, ```bash).

Run one page by hand: ``python tests/docs/test_snippets.py docs/concepts.md``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE_TIMEOUT_S = 120  # a page that hangs (a Ray cluster waiting for CPUs) fails, never hangs

# top-level modules a snippet may import, and the extra that installs each
EXTRA_OF = {
    "torch": "torch",
    "gymnasium": "agents",
    "matplotlib": "agents",
    "stable_baselines3": "sb3",
    "ray": "ray",
    "torchrl": "torchrl",
    "tensordict": "torchrl",
    "minatar": "minatar",
    "lz4": "tiers",
    "zstandard": "tiers",
    "blosc2": "tiers",
    "rliable": "stats",
}
# fastper modules that import an extra themselves
FASTPER_NEEDS = {
    "fastper.device": "torch",
    "fastper.compat.sb3": "stable_baselines3",
    "fastper.compat.torchrl": "torchrl",
    "fastper.agents": "torch",
}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)[^\n]*$")


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, code)`` of each ```python block, dedented to its fence."""
    blocks: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"unclosed code fence opened at line {i + 1}")
        if lang in ("python", "py", "python3"):
            blocks.append((i + 2, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def imported_modules(code: str) -> set[str]:
    """Dotted names of every module a block imports (``import a.b``, ``from a.b import c``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def missing_extra(codes: list[str]) -> str | None:
    """Why a page cannot run here (a library of an extra not installed), or None."""
    needed: set[str] = set()
    for code in codes:
        for name in imported_modules(code):
            top = name.split(".")[0]
            if top in EXTRA_OF:
                needed.add(top)
            for module, lib in FASTPER_NEEDS.items():
                if name == module or name.startswith(module + "."):
                    needed.add(lib)
    for lib in sorted(needed):
        if importlib.util.find_spec(lib) is None:
            return f"{lib} is not installed (pip install 'fastper[{EXTRA_OF[lib]}]')"
    return None


# Runs in the subprocess: the blocks of one page, in order, in one namespace.
_RUNNER = """
import json, sys
blocks = json.loads(sys.stdin.read())
scope = {"__name__": "__main__"}
for name, code in blocks:
    exec(compile(code, name, "exec"), scope)
"""


def run_page(page: Path, cwd: Path, timeout: float = PAGE_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run a page's python blocks in a subprocess with ``cwd`` as its working directory."""
    rel = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    blocks = [(f"{rel}:{line}", code) for line, code in python_blocks(page.read_text())]
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               RAY_USAGE_STATS_ENABLED="0")  # fmt: skip
    if not any(k in env for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # else Ray writes one to ~/.ray
    ray_tmp = tempfile.mkdtemp(prefix="fpray-")  # Ray's session files; short for its sockets
    env["RAY_TMPDIR"] = ray_tmp
    env["SB3_LOGDIR"] = str(cwd)  # SB3's learn() logs here, not to SB3-* folders in the temp dir
    try:
        return subprocess.run(
            [sys.executable, "-c", _RUNNER],
            input=json.dumps(blocks),
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


PAGES_WITH_CODE = [p for p in pages() if python_blocks(p.read_text())]


def test_the_pages_have_code_to_run() -> None:
    names = {str(p.relative_to(ROOT)) for p in PAGES_WITH_CODE}
    assert "README.md" in names and "docs/getting-started.md" in names, names


def test_block_parser_handles_indented_fences_and_other_languages() -> None:
    text = (
        "intro\n```python\nx = 1\n```\n```text\nnot = code(\n```\n"
        "- item\n\n    ```python\n    y = x + 1\n    ```\n"
    )
    assert python_blocks(text) == [(3, "x = 1\n"), (11, "y = x + 1\n")]
    with pytest.raises(ValueError, match="unclosed"):
        python_blocks("```python\nx = 1\n")


def test_a_raising_block_fails_its_page(tmp_path: Path) -> None:
    page = tmp_path / "probe.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is 1'\n```\n")
    proc = run_page(page, tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "probe.md:6" in proc.stderr and "x is 1" in proc.stderr


def _cost(page: Path) -> int:
    """Rough start-up cost of a page, to start the slowest first: Ray, then torch."""
    names = {
        n.split(".")[0] for _, c in python_blocks(page.read_text()) for n in imported_modules(c)
    }
    heavy = {"torch", "stable_baselines3", "torchrl", "tensordict", "gymnasium"}
    return 2 * ("ray" in names) + bool(names & heavy)


def _timed_run(page: Path, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = run_page(page, cwd)
    return proc, time.perf_counter() - start


@pytest.fixture(scope="session")
def page_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Start every selected page that can run here, two at a time (the suite's 2 cores).

    Each page still runs alone in its own subprocess and its own temporary
    directory; running two at once only overlaps their start-up (imports,
    Ray's start).
    """
    selected = [item.callspec.params["page"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_page_snippets_run"]  # fmt: skip
    runnable = [
        p for p in selected if not missing_extra([c for _, c in python_blocks(p.read_text())])
    ]
    workers = int(os.environ.get("FASTPER_DOC_WORKERS", "2"))
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    futures = {}
    for page in sorted(runnable, key=_cost, reverse=True):
        cwd = tmp_path_factory.mktemp(page.stem)
        futures[page] = pool.submit(_timed_run, page, cwd)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize(
    "page", PAGES_WITH_CODE, ids=[str(p.relative_to(ROOT)) for p in PAGES_WITH_CODE]
)
def test_page_snippets_run(page: Path, page_runs) -> None:
    reason = missing_extra([code for _, code in python_blocks(page.read_text())])
    if reason:
        pytest.skip(f"{page.relative_to(ROOT)}: {reason}")
    try:
        proc, took = page_runs[page].result()
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{page.relative_to(ROOT)}: still running after {exc.timeout:.0f} s:\n{exc.stderr}"
        )
    assert proc.returncode == 0, (
        f"{page.relative_to(ROOT)} failed (exit {proc.returncode}, {took:.1f} s):\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def _quickstart_block(readme: str) -> str:
    section = readme.split("## 30-second example", 1)[1].split("\n## ", 1)[0]
    blocks = python_blocks(section)
    assert len(blocks) == 1, "the 30-second example is one python block"
    return blocks[0][1]


def test_readme_quickstart_is_examples_quickstart() -> None:
    block = _quickstart_block((ROOT / "README.md").read_text())
    assert block == (ROOT / "examples" / "quickstart.py").read_text(), (
        "README.md's 30-second example differs from examples/quickstart.py: copy the file's "
        "text into the README's python block"
    )


if __name__ == "__main__":  # python tests/docs/test_snippets.py PAGE...: run pages by hand
    for arg in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            result = run_page(Path(arg).resolve(), Path(tmp))
            print(f"{arg}: exit {result.returncode} in {time.perf_counter() - t0:.1f} s")
            print(result.stdout[-4000:], result.stderr[-8000:], sep="\n")
