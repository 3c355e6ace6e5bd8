"""The agents' replay buffer, built from their config, and its options beyond the paper's.

:func:`agent_replay` builds the buffer a config asks for; the step counts
the schedules run on are the ``sample`` calls of the run (one per gradient
step, :func:`samples_by`).

The options beyond the paper's are proposed PER variants (see docs/results/claims/).

Each option is a config field of :class:`~fastper.agents.dqn.DQNConfig` and
:class:`~fastper.agents.sac.SACConfig` whose default is the paper's recipe,
so a config that leaves them alone builds the same buffer and takes the
same gradient steps as before they existed. How each maps to the buffer
(:mod:`fastper.buffers`) or the loss:

``beta_schedule``
    ``"linear"`` (default) or ``"cosine"``: beta goes from ``beta0`` to 1 over
    every ``sample`` call of the run along :func:`fastper.schedules.linear` or
    :func:`fastper.schedules.cosine` (the half-cosine: slow at both ends,
    equal to the linear one at mid-run).
``weight_norm``
    ``"buffer"`` (default, the paper) or ``"batch"``: the buffer's
    ``weight_norm``, the IS weights divided by the largest over the whole
    buffer or over the batch.
``alpha_end``
    ``None`` (default: alpha constant) or a number: alpha moves linearly from
    ``alpha`` (or the scheme's paper default) to ``alpha_end`` over the run.
    The buffer re-weighs every priority when alpha changes, O(N), so alpha
    moves every ``alpha_every`` samples: the buffer's default (at most 256
    re-weighed slots per sample, amortised) or, on long runs, often enough
    for 1,000 changes over the run (steps of ``|alpha_end - alpha| / 1000``).
``switch_at``, ``priority_noise_late``
    The seed's hybrid: with ``replay="rank"`` and ``switch_at`` > 0 the buffer
    samples rank-based until ``switch_at * total_steps`` environment steps and
    proportionally after (``switch_scheme("proportional", at_step=S)``, S the
    ``sample`` calls made by then: one per gradient step). The alpha schedule
    carries over, except that a defaulted constant alpha (``alpha=None``, no
    ``alpha_end``) becomes the proportional paper default 0.6 at the switch.
    ``priority_noise_late`` > 0 is the sigma of the buffer's
    ``priority_noise`` (``|td| * exp(sigma z)``) from the switch on: a step
    schedule that is 0 before and sigma from the update of the first
    proportional batch on (buffer step S + 1: an update sees the step count
    after its sample).
``grad_clip_is``
    0 (default: off) or c > 0: the gradient norm is also clipped at ``c *
    max_i w_i``, the batch's largest IS weight (the seed's "clip gradients at
    0.5 x max IS weight" is ``grad_clip_is=0.5``). DQN: in addition to
    ``max_grad_norm``, so the smaller threshold wins (two clips by norm in a
    row are one clip at the smaller threshold). SAC: the critics' gradient,
    which SAC does not clip otherwise; the actor's is left alone.
``new_priority``
    ``"ever"`` (default, the paper: the largest priority ever recorded) or
    ``"max_td"``: the largest priority held now, the buffer's
    ``max_priority="current"``. Priorities are ``p = |td| + priority_eps``,
    so the largest held is ``max |td| + priority_eps``: the seed's "max TD
    error + 1e-5" is ``new_priority="max_td"`` with ``priority_eps=1e-5``. The
    max is over the priorities held, which include those that never-sampled
    transitions inherited when they were added (their TD error is not known
    yet); 1.0 while nothing is held. So while any transition that inherited
    the largest priority is still unsampled, ``"max_td"`` gives what ``"ever"``
    gives (every new transition passes it on): on CartPole the two trained
    bit for bit alike (docs/results/claims/).
    ``"last_td"``: the largest priority of the latest priority update, the
    buffer's ``max_priority="last"``, i.e. ``max |td| + priority_eps`` over
    the last learning batch (1.0 before the first): a maximum of TD errors
    that can fall as well as rise.

Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .. import schedules
from ..buffer_core import AUTO_ALPHA_SLOTS
from ..buffers import BaseBuffer, PrioritizedReplayBuffer, RankBasedReplayBuffer, ReplayBuffer
from ..storage import FieldLike

REPLAYS = ("uniform", "per", "rank")
BETA_SCHEDULES = ("linear", "cosine")
WEIGHT_NORMS = ("buffer", "batch")
NEW_PRIORITIES = ("ever", "max_td", "last_td")
#: ``new_priority`` -> the buffer's ``max_priority`` policy
MAX_PRIORITY = {"ever": "ever", "max_td": "current", "last_td": "last"}
#: an alpha schedule moves at most this many times over a run (see ``alpha_end``)
ALPHA_CHANGES = 1_000
#: alpha of the proportional scheme after a switch from a defaulted rank-based one
PROPORTIONAL_ALPHA = 0.6


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_options(cfg: Any) -> None:
    """Clear errors for the options above (called by ``check_config``).

    Raises:
        ValueError: a value out of its range, or an option that needs another
            (``switch_at`` needs ``replay="rank"`` and a switch point past
            ``learning_starts``; ``priority_noise_late`` needs ``switch_at``).
    """
    for name, allowed in (
        ("beta_schedule", BETA_SCHEDULES),
        ("weight_norm", WEIGHT_NORMS),
        ("new_priority", NEW_PRIORITIES),
    ):
        value = getattr(cfg, name)
        if value not in allowed:
            raise ValueError(f"`{name}` must be one of {list(allowed)}, got {name}={value!r}")
    end = cfg.alpha_end
    if end is not None and not (_number(end) and end >= 0):
        raise ValueError(f"`alpha_end` must be None or a number >= 0, got alpha_end={end!r}")
    for name in ("grad_clip_is", "priority_noise_late"):
        value = getattr(cfg, name)
        if not (_number(value) and value >= 0):
            raise ValueError(f"`{name}` must be a number >= 0 (0: off), got {name}={value!r}")
    at = cfg.switch_at
    if not (_number(at) and 0 <= at < 1):
        raise ValueError(f"`switch_at` must be in [0, 1) (0: never), got switch_at={at!r}")
    if at > 0:
        if cfg.replay != "rank":
            raise ValueError(
                "`switch_at` > 0 switches rank-based replay to proportional: it needs "
                f"replay='rank', got replay={cfg.replay!r}, switch_at={at}"
            )
        if switch_env_step(cfg) <= cfg.learning_starts:
            raise ValueError(
                "`switch_at` must put the switch after learning_starts (before it nothing is "
                f"sampled), got switch_at={at} (step {switch_env_step(cfg)} of "
                f"{cfg.total_steps}), learning_starts={cfg.learning_starts}"
            )
    if cfg.priority_noise_late > 0 and at == 0:
        raise ValueError(
            "`priority_noise_late` > 0 adds noise from the switch on: it needs switch_at > 0, "
            f"got priority_noise_late={cfg.priority_noise_late}, switch_at=0"
        )


def switch_env_step(cfg: Any) -> int:
    """The environment step (all envs together) at which ``switch_at`` switches."""
    return int(cfg.switch_at * cfg.total_steps)


def alpha_schedule(alpha0: float, alpha_end: float | None, anneal_samples: int) -> Any:
    """``alpha0`` as it is (no ``alpha_end``) or a linear schedule to ``alpha_end``."""
    if alpha_end is None:
        return alpha0
    return schedules.linear(alpha0, float(alpha_end), max(1, int(anneal_samples)))


def alpha_every(capacity: int, anneal_samples: int) -> int:
    """Samples between alpha changes: the buffer's default, or fewer changes on long runs."""
    default = -(-int(capacity) // AUTO_ALPHA_SLOTS)  # the buffer's own default
    return max(default, -(-max(1, int(anneal_samples)) // ALPHA_CHANGES))


def beta_annealing(kind: str, beta0: float, anneal_samples: int) -> schedules.Schedule:
    """Beta from ``beta0`` to 1 over ``anneal_samples`` samples, ``kind`` "linear" or "cosine"."""
    steps = max(1, int(anneal_samples))
    if kind == "cosine":
        return schedules.cosine(beta0, 1.0, steps)
    return schedules.linear(beta0, 1.0, steps)


def late_noise(sigma: float, switch_sample: int) -> schedules.Step:
    """``priority_noise`` 0 until the update of the first proportional batch, ``sigma`` from it."""
    return schedules.step([int(switch_sample) + 1], [0.0, float(sigma)])


def clip_threshold(max_grad_norm: float, grad_clip_is: float, weights: Any) -> float:
    """The gradient-norm clip of a batch: ``max_grad_norm``, or ``grad_clip_is * max w`` if smaller.

    ``weights``: the batch's IS weights (a tensor or an array). With
    ``grad_clip_is`` 0 this is ``max_grad_norm`` (``math.inf``: no clip). O(B).
    """
    if not grad_clip_is:
        return float(max_grad_norm)
    return min(float(max_grad_norm), float(grad_clip_is) * float(weights.max()))


def vector_steps(cfg: Any) -> int:
    """Calls of ``envs.step`` in a run: ``total_steps // num_envs`` (a remainder is not run)."""
    return int(cfg.total_steps) // int(cfg.num_envs)


def phases_due(step: int, num_envs: int, learning_starts: int, train_freq: int) -> int:
    """Training phases due after the vector step that brought the env-step count to ``step``.

    A phase is due at every multiple of ``train_freq`` environment steps
    above ``learning_starts``; one vector step (``num_envs`` env steps) can
    pass several of them, or none. With one env: 1 if ``step >
    learning_starts`` and ``step % train_freq == 0``, else 0.
    """
    lo = max(step - num_envs, learning_starts)
    return max(0, step // train_freq - lo // train_freq)


def check_replay(replay: Any) -> None:
    if replay not in REPLAYS:
        raise ValueError(f"`replay` must be one of {list(REPLAYS)}, got replay={replay!r}")


def make_replay(
    replay: str,
    capacity: int,
    fields: Mapping[str, FieldLike],
    *,
    alpha: float | None,
    beta0: float | None,
    anneal_samples: int,
    n_step: int = 1,
    gamma: float = 0.99,
    eps: float = 1e-6,
    seed: int | None = None,
    n_envs: int | None = None,
    autoreset: str | None = None,
    beta_schedule: str = "linear",
    weight_norm: str = "buffer",
    alpha_end: float | None = None,
    new_priority: str = "ever",
    switch_sample: int | None = None,
    noise_late: float = 0.0,
) -> BaseBuffer:
    """A replay buffer of kind ``replay`` ("uniform", "per" or "rank").

    ``alpha`` / ``beta0`` default to the paper's choices for the kind
    (proportional 0.6 / 0.4, rank-based 0.7 / 0.5); beta rises from ``beta0``
    to 1 over ``anneal_samples`` calls to ``sample`` (``beta_schedule``:
    linearly or along a half-cosine) and stays at 1.
    ``n_envs`` / ``autoreset``: every ``add`` is one step of each of ``n_envs``
    envs, each with its own n-step window (see :mod:`fastper.nstep`).
    ``beta_schedule``, ``weight_norm``, ``alpha_end``, ``new_priority``,
    ``switch_sample`` (a rank-based buffer samples proportionally from this
    ``sample`` call on) and ``noise_late`` (priority noise from the switch on):
    see the module's docstring; their defaults are the paper's recipe.

    Raises:
        ValueError: an unknown ``replay``, or a switch for one that is not "rank".
    """
    check_replay(replay)
    if switch_sample is not None and replay != "rank":
        raise ValueError(
            f"a switch to proportional sampling needs replay='rank', got replay={replay!r}"
        )
    common: dict[str, Any] = {
        "n_step": n_step, "gamma": gamma, "seed": seed, "eps": eps,
        "n_envs": n_envs, "autoreset": autoreset, "weight_norm": weight_norm,
        "max_priority": MAX_PRIORITY[new_priority],
    }  # fmt: skip
    if replay == "uniform":
        return ReplayBuffer(capacity, fields, **common)
    cls: type[BaseBuffer] = PrioritizedReplayBuffer if replay == "per" else RankBasedReplayBuffer
    a = cls._default_alpha if alpha is None else alpha
    b0 = cls._default_beta if beta0 is None else beta0
    beta = beta_annealing(beta_schedule, b0, anneal_samples)
    if alpha_end is not None:
        common["alpha_every"] = alpha_every(capacity, anneal_samples)
    if noise_late > 0 and switch_sample is not None:
        common["priority_noise"] = late_noise(noise_late, switch_sample)
    alpha_s = alpha_schedule(a, alpha_end, anneal_samples)
    buffer = cls(capacity, fields, alpha=alpha_s, beta=beta, **common)
    if switch_sample is not None:
        # a defaulted constant alpha becomes the proportional scheme's paper default
        after = PROPORTIONAL_ALPHA if alpha is None and alpha_end is None else None
        buffer.switch_scheme("proportional", at_step=switch_sample, alpha=after)
    return buffer


def samples_by(cfg: Any, step: int) -> int:
    """``sample`` calls (gradient steps) an agent has made once ``step`` env steps are taken."""
    return phases_due(step, step, cfg.learning_starts, cfg.train_freq) * cfg.gradient_steps


def agent_replay(cfg: Any, envs: Any) -> BaseBuffer:
    """The replay buffer an agent config asks for, fed by the vector env ``envs``.

    Fields come from ``envs``' single observation and action spaces (an
    observation keeps its dtype: MinAtar's bool grids take one byte a cell);
    each of the ``cfg.num_envs`` envs is its own n-step stream. Beta is
    annealed over every ``sample`` call of the run: one per gradient step,
    ``gradient_steps`` per training phase, a phase at every multiple of
    ``train_freq`` environment steps after ``learning_starts``; the alpha
    schedule, the switch and the late priority noise count the same steps.
    """
    from ..spaces import fields_from_spaces
    from ..vector import autoreset_mode

    used = vector_steps(cfg) * cfg.num_envs
    switch = None
    if cfg.switch_at > 0:
        switch = samples_by(cfg, switch_env_step(cfg))
    return make_replay(
        cfg.replay,
        cfg.buffer_size,
        fields_from_spaces(envs.single_observation_space, envs.single_action_space),
        alpha=cfg.alpha,
        beta0=cfg.beta0,
        anneal_samples=samples_by(cfg, used),
        n_step=cfg.n_step,
        gamma=cfg.gamma,
        eps=cfg.priority_eps,
        seed=cfg.seed,
        n_envs=cfg.num_envs,
        autoreset=autoreset_mode(envs),  # None: make_vec_env turns Gymnasium's autoreset off
        beta_schedule=cfg.beta_schedule,
        weight_norm=cfg.weight_norm,
        alpha_end=cfg.alpha_end,
        new_priority=cfg.new_priority,
        switch_sample=switch,
        noise_late=cfg.priority_noise_late,
    )
