"""A mistake on the ``fastper`` command line: exit status 2 and one line that says what to do.

Covers the new-user report: tracebacks for ``bench --capacity 0`` and unknown
env ids, ``--set hidden=64``, empty run directories after a failed ``train``,
subcommands without a description, and ``bench --peers`` without the peer
libraries replacing the committed results with tables of n/a. Every ``train``
case fails while the arguments are checked, before any training starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fastper.cli import main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PEERS = ("cpprb", "tianshou", "torchrl")


def fastper(*args: str, cwd: Path, env: dict[str, str] | None = None):
    """``python -m fastper ARGS`` in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "fastper", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_error_line(proc: subprocess.CompletedProcess[str], prog: str, *needles: str) -> str:
    """Exit status 2 and exactly one stderr line, ``PROG: error: ...`` holding ``needles``."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``main(args)`` in this process: (exit status, stderr); argparse errors exit too."""
    try:
        code = main(args)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def committed_results() -> dict[str, tuple[int, bytes]]:
    return {
        p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in RESULTS.iterdir() if p.is_file()
    }


# ---------------------------------------------------------------------------
# bench
# ---------------------------------------------------------------------------


def test_bench_capacity_0_is_one_line(tmp_path: Path):
    proc = fastper("bench", "--capacity", "0", cwd=tmp_path)
    one_error_line(proc, "fastper bench", "--capacity", "must be >= 1, got 0", "bench --help")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--capacity", "abc"], ["--capacity", "2^20", "'abc'"]),
        (["--calls", "0"], ["--calls", "must be >= 1, got 0"]),
        (["--batch-size", "-1"], ["--batch-size", ">= 1"]),
        (["--seed", "-1"], ["--seed", ">= 0"]),
        (["--workloads", "--capacity", "2"], ["--workloads needs --capacity >= 4", "got 2"]),
        (["--quick"], ["unrecognized arguments: --quick", "fastper bench --peers --quick"]),
        (["--capacity", "64", "--peers", "--quick"], ["--capacity does not apply", "--peers"]),
    ],
)
def test_bench_usage_errors(capsys, args: list[str], needles: list[str]):
    code, err = run_main(["bench", *args], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("fastper bench: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)


def test_bench_accepts_powers_of_two_and_small_capacities():
    from fastper import _bench
    from fastper.cli import _integer

    assert _integer(1)("2^10") == _integer(1)("2**10") == 1024
    # as --set total_steps=1e6 reads it: a whole number in scientific notation
    assert _integer(1)("1e6") == _integer(1)("1E6") == _integer(1)("1_000_000") == 10**6
    assert _integer(1)("2.5e3") == 2500
    for bad in ("1.5", "2.5e0", "1e300", "inf", "nan", "1e-3"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number"):
            _integer(1)(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 1, got 0"):
        _integer(1)("0e5")
    timings = _bench.run(10, 4, calls=3)  # capacity below the fill batch of 1000
    assert timings[1].op == "add (batches of 10)"


def test_bench_help_says_what_it_does_and_where_results_go(tmp_path: Path):
    proc = fastper("bench", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "time its add, sample, update_priorities and learner step" in text
    assert "writes no files" in text and "benchmarks/results" in text
    assert "pip install 'fastper[bench]'" in text and "never replaced by a table of n/a" in text


@pytest.mark.parametrize(
    ("sub", "needles"),
    [
        ("inspect", ["without loading its data", "Writes nothing"]),
        ("train", ["OUT/<algo>-<env>-<replay>/seed-<k>/", "checked before anything is written"]),
        ("plot", ["writes the image to -o/--output"]),
        ("compare", ["print to stdout a markdown table", "Writes nothing"]),
    ],
)
def test_every_subcommand_has_a_description(capsys, sub: str, needles: list[str]):
    with pytest.raises(SystemExit) as exc:
        main([sub, "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in needles:
        assert needle in text, (needle, text)


def test_unknown_agent(tmp_path: Path):
    line = one_error_line(fastper("train", "ppo", cwd=tmp_path), "fastper train", "'ppo'")
    assert "choose from 'dqn', 'sac'" in line
    assert list(tmp_path.iterdir()) == []


def test_unknown_subcommand(capsys):
    code, err = run_main(["benchmark"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("fastper: error: ") and "'benchmark'" in err and "'bench'" in err


# ---------------------------------------------------------------------------
# train: checked before anything is written
# ---------------------------------------------------------------------------


def test_train_unknown_env_id_is_one_line_and_leaves_no_directory(tmp_path: Path):
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    # hidden=64 is accepted (one layer of 64): the error is about the environment
    proc = fastper("train", "dqn", "--env", "NoSuchEnv-v0", "--set", "hidden=64", cwd=tmp_path)
    one_error_line(proc, "fastper train", "'NoSuchEnv-v0'", "doesn't exist", "CartPole-v1")
    assert list(tmp_path.iterdir()) == []  # no ./runs


def test_train_bad_hidden_shows_the_accepted_form(tmp_path: Path):
    pytest.importorskip("torch")
    proc = fastper("train", "dqn", "--set", "hidden=64x64", "--out", "out", cwd=tmp_path)
    one_error_line(proc, "fastper train", "`--set hidden`", "--set hidden=64,64", "'64x64'")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["dqn", "--set", "lr=fast"], ["`--set lr` takes a number", "'fast'", "--set lr="]),
        (["dqn", "--set", "total_steps=1.5"], ["`--set total_steps` takes an integer"]),
        (["dqn", "--set", "dueling=maybe"], ["`--set dueling` takes true or false"]),
        (["dqn", "--set", "alpha=high"], ["`--set alpha` takes a number or none"]),
        (["dqn", "--set", "hidden=0"], ["`--set hidden`", "--set hidden=64,64"]),
        (["dqn", "--set", "lr"], ["name=value", "--set lr="]),
        (["dqn", "--set", "lrr=1"], ["must name a field of DQNConfig", "did you mean 'lr'"]),
        (["dqn", "--set", "seed=3"], ["`--set seed`", "--seed-offset"]),
        (["dqn", "--set", "replay=rank"], ["`--set replay`", "--replay"]),
        (["dqn", "--set", "total_steps=0"], ["`total_steps` must be > 0"]),
        (["dqn", "--set", "device=gpu"], ["`device` must be a torch device", "cpu"]),
        (["dqn", "--env", "Pendulum-v1"], ["DQN needs a Discrete action space", "train sac"]),
        (["sac", "--env", "CartPole-v1"], ["SAC needs a Box action space", "train dqn"]),
        (["dqn", "--env", "cartpole-v1"], ["'cartpole-v1'", "Did you mean"]),
        (["dqn", "--env", "CartPole-v1", "--set", "env_id=Acrobot-v1"], ["disagree"]),
        (["dqn", "--steps", "0"], ["--steps", "must be >= 1, got 0"]),
        (["dqn", "--seeds", "0"], ["--seeds", "must be >= 1"]),
        (["dqn", "--seed-offset", "-1"], ["--seed-offset", "must be >= 0"]),
        (["dqn", "--workers", "0"], ["--workers", "must be >= 1"]),
        (["dqn", "--threads", "0"], ["--threads", "must be >= 1"]),
    ],
)
def test_train_usage_errors(tmp_path: Path, monkeypatch, capsys, args, needles):
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", *args, "--quiet"], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastper train: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert list(tmp_path.iterdir()) == []


def test_train_out_that_is_a_file(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("not a directory")
    code, err = run_main(["train", "dqn"], capsys)
    assert code == 2 and "--out must be a directory" in err


def test_set_values_are_read_as_their_field_types():
    pytest.importorskip("torch")
    from fastper.agents.dqn import DQNConfig
    from fastper.agents.runner import parse_overrides

    got = parse_overrides(
        DQNConfig,
        ["hidden=64", "lr=5e-4", "total_steps=1e5", "dueling=true", "alpha=none", "device=cpu"],
    )
    assert got == {"hidden": (64,), "lr": 5e-4, "total_steps": 100_000, "dueling": True,
                   "alpha": None, "device": "cpu"}  # fmt: skip
    for text in ("64,64", "(64, 64)", "[64, 64]"):
        assert parse_overrides(DQNConfig, [f"hidden={text}"]) == {"hidden": (64, 64)}
    with pytest.raises(ValueError, match=r"`hidden` must be a tuple of positive layer widths"):
        DQNConfig(hidden=64)  # type: ignore[arg-type]


def test_a_failed_run_removes_the_directories_it_made(tmp_path: Path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    from fastper.agents import runner

    calls = []

    def fail_after_first(algo, settings, out, progress, threads):
        calls.append(settings["replay"])
        path = runner.run_dir(out, algo, settings["env_id"], settings["replay"], settings["seed"])
        if len(calls) == 1:  # the first run writes its log, then the second fails
            path.mkdir(parents=True)
            (path / "config.json").write_text("{}")
            return settings["replay"], settings["seed"], 0.0, 0, 0.0
        path.mkdir(parents=True)  # made, nothing written
        raise RuntimeError("boom")

    monkeypatch.setattr(runner, "_train_one", fail_after_first)
    out = tmp_path / "a" / "b"
    with pytest.raises(RuntimeError, match="boom"):
        runner.train_many("dqn", "CartPole-v1", ["uniform", "per"], [0], 10, out, progress=False)
    kept = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert kept == ["a", "a/b", "a/b/dqn-CartPole-v1-uniform",
                    "a/b/dqn-CartPole-v1-uniform/seed-0",
                    "a/b/dqn-CartPole-v1-uniform/seed-0/config.json"]  # fmt: skip
    # a failure before anything was written leaves nothing at all (every run fails now)
    with pytest.raises(RuntimeError, match="boom"):
        runner.train_many("dqn", "CartPole-v1", ["per"], [0], 10, tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------
# bench --peers: never replaces committed results with n/a
# ---------------------------------------------------------------------------

HIDE = """
import sys
HIDDEN = {hidden!r}
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ImportError(f"No module named {{name!r}}")
sys.meta_path.insert(0, Hide())
"""


def peers_env(tmp_path: Path, hidden: tuple[str, ...], broken: tuple[str, ...] = ()) -> dict:
    """An environment where ``hidden`` cannot be found and ``broken`` fail on import."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE.format(hidden=tuple(hidden)))
    for name in broken:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"raise ImportError('broken build of {name}')")
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path)


@pytest.fixture
def results_untouched():
    before = committed_results()
    yield
    assert committed_results() == before


@pytest.mark.usefixtures("results_untouched")
def test_peers_without_peer_libraries_refuse_and_write_nothing(tmp_path: Path):
    env = peers_env(tmp_path, PEERS)
    # the reported command: its default output is the committed benchmarks/results
    proc = fastper("bench", "--peers", cwd=tmp_path, env=env)
    line = one_error_line(proc, "fastper bench --peers", "pip install 'fastper[bench]'")
    assert "cpprb, tianshou, torchrl missing" in line and "nothing was run or written" in line
    out = tmp_path / "out"
    proc = fastper("bench", "--peers", "--quick", "--out", str(out), cwd=tmp_path, env=env)
    one_error_line(proc, "fastper bench --peers", "no peer library is installed")
    assert not out.exists()


@pytest.mark.usefixtures("results_untouched")
def test_peers_that_cannot_be_measured_write_nothing(tmp_path: Path):
    # cpprb is found but fails to import in its worker; tianshou is missing
    env = peers_env(tmp_path, ("tianshou",), broken=("cpprb",))
    out = tmp_path / "out"
    args = ["--quick", "--no-ttfs", "--libs", "cpprb", "tianshou", "--out", str(out)]
    proc = fastper("bench", "--peers", *args, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("[peers] not installed: tianshou (pip install 'fastper[bench]'")
    assert lines[-1].startswith("fastper bench --peers: error: no peer library could be measured")
    assert "broken build of cpprb" in lines[-1] and "nothing written" in lines[-1]
    assert not out.exists()


@pytest.mark.usefixtures("results_untouched")
def test_peers_fastper_alone_must_not_replace_the_comparison(tmp_path: Path):
    proc = fastper("bench", "--peers", "--libs", "fastper", cwd=tmp_path)
    one_error_line(proc, "fastper bench --peers", "--libs fastper alone", "--out")


def _readme_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_readme_sync", ROOT / "benchmarks" / "readme.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_sync_refuses_a_summary_without_peers(tmp_path: Path):
    readme = _readme_script()
    committed = (RESULTS / "peers.md").read_text()
    readme.check_measured(readme.summary_block(committed))  # the committed run has peers
    md = tmp_path / "peers.md"
    md.write_text(
        "# x\n\n## Summary\n\n### N = 2^20, B = 256\n\n"
        "| op | fastper | cpprb | tianshou | torchrl | fastest peer | fastest peer / fastper |\n"
        "|---|---:|---:|---:|---:|---|---:|\n"
        "| learner step (sample + update), us/call | 154 | n/a | n/a | n/a | n/a | n/a |\n\n"
        "## Libraries\n"
    )
    text = "intro\n<!-- peers:start -->\nold\n<!-- peers:end -->\nrest\n"
    target = tmp_path / "README.md"
    target.write_text(text)
    with pytest.raises(ValueError, match="measured no peer library"):
        readme.sync(target, md)
    assert target.read_text() == text


def test_bench_table_names_the_cpu() -> None:
    """`fastper bench` reports name the CPU (figures differ between CPUs more than
    between runs); the name is Linux's model name where it has one."""
    from fastper._bench import Timing, cpu_name, format_table

    name = cpu_name()
    assert name.strip() == name and name
    try:
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        models = []
    if models:
        assert name == models[0]
    table = format_table([Timing("sample", "per call", 1.0, 2.0, 3)], 1024, "proportional")
    assert f"({name})" in table.splitlines()[1]
