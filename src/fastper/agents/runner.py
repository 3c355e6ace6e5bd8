"""Running agents over replay schemes and seeds, one after another or in processes.

Layout of an output directory: ``OUT/<algo>-<env>-<replay>/seed-<k>/`` holds
``config.json`` and ``episodes.csv`` of one run (see ``_common.RunLogger``).
"""

from __future__ import annotations

import ast
import dataclasses
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ALGOS = ("dqn", "sac")


def config_class(algo: str) -> type[Any]:
    """The hyperparameter dataclass of ``algo`` (imports torch)."""
    if algo == "dqn":
        from .dqn import DQNConfig

        return DQNConfig
    if algo == "sac":
        from .sac import SACConfig

        return SACConfig
    raise ValueError(f"`algo` must be one of {list(ALGOS)}, got algo={algo!r}")


def parse_overrides(cls: type[Any], pairs: Sequence[str]) -> dict[str, Any]:
    """``["lr=3e-4", "hidden=(64, 64)"]`` -> typed values for fields of ``cls``.

    Values are Python literals (numbers, tuples, None, True); anything else
    is taken as a string. Raises ValueError for unknown fields or bad pairs.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"`--set` must look like name=value, got {pair!r}")
        name, text = pair.split("=", 1)
        name = name.strip().replace("-", "_")
        if name not in names:
            raise ValueError(
                f"`--set` must name a field of {cls.__name__} ({', '.join(sorted(names))}), got {name!r}"
            )
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        out[name] = value
    return out


def run_dir(out: str | Path, algo: str, env_id: str, replay: str, seed: int) -> Path:
    safe_env = env_id.replace("/", "_")
    return Path(out) / f"{algo}-{safe_env}-{replay}" / f"seed-{seed}"


def _train_one(
    algo: str, settings: dict[str, Any], out: str, progress: bool, threads: int
) -> tuple[str, int, float, int, float]:
    import torch

    torch.set_num_threads(threads)
    cls = config_class(algo)
    cfg = cls(**settings)
    path = run_dir(out, algo, cfg.env_id, cfg.replay, cfg.seed)
    if algo == "dqn":
        from .dqn import train as train_dqn

        res = train_dqn(cfg, out_dir=path, progress=progress)
    else:
        from .sac import train as train_sac

        res = train_sac(cfg, out_dir=path, progress=progress)
    tail = res.returns[-10:]
    last = sum(tail) / len(tail) if tail else float("nan")
    return cfg.replay, cfg.seed, last, len(res.returns), res.wall_s


def train_many(
    algo: str,
    env_id: str,
    replays: Sequence[str],
    seeds: Sequence[int],
    steps: int | None,
    out: str | Path,
    overrides: dict[str, Any] | None = None,
    workers: int = 1,
    progress: bool = True,
    threads: int | None = None,
) -> list[tuple[str, int, float, int, float]]:
    """Train ``algo`` for every (replay, seed); returns (replay, seed, last-10 return, episodes, s).

    With ``workers > 1`` runs go to that many processes (spawned) and progress
    is one line per run. Each run uses ``threads`` torch threads (default
    ``cpu_count // workers``).
    """
    cls = config_class(algo)
    jobs = []
    for seed in seeds:  # seed-major, so an interrupted sweep stays balanced across schemes
        for replay in replays:
            settings = dict(overrides or {})
            settings.update(env_id=env_id, replay=replay, seed=int(seed))
            if steps is not None:
                settings["total_steps"] = int(steps)
            cls(**settings)  # fail fast on a bad setting, before any process starts
            jobs.append(settings)
    Path(out).mkdir(parents=True, exist_ok=True)
    results = []
    t0 = time.perf_counter()
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // max(1, workers))
    order = {r: i for i, r in enumerate(replays)}
    if workers <= 1:
        for s in jobs:
            results.append(_train_one(algo, s, str(out), progress, threads))
        return sorted(results, key=lambda r: (order[r[0]], r[1]))
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_train_one, algo, s, str(out), False, threads) for s in jobs]
        for done, fut in enumerate(as_completed(futures), 1):
            r = fut.result()
            results.append(r)
            if progress:
                print(
                    f"[{done}/{len(jobs)} {time.perf_counter() - t0:6.0f}s] {algo} {r[0]} seed {r[1]}: "
                    f"last-10 return {r[2]:.1f} over {r[3]} episodes ({r[4]:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
    return sorted(results, key=lambda r: (order[r[0]], r[1]))
