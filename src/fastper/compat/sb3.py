"""Prioritized replay for Stable-Baselines3: change one import and one class name.

>>> from fastper.compat.sb3 import PERDQN          # instead of: from stable_baselines3 import DQN
>>> model = PERDQN("MlpPolicy", "CartPole-v1", seed=0,
...                replay_buffer_kwargs={"alpha": 0.6, "beta": 0.4})  # doctest: +SKIP
>>> model.learn(20_000)                                                 # doctest: +SKIP
>>> model.save_replay_buffer("replay.fpk")   # fastper's pickle-free file # doctest: +SKIP

or keep SB3's algorithm and only swap the buffer (SB3's ``train`` neither
weights the loss nor updates priorities, so the buffer then replays as if
uniform, and warns so after many samples, unless you update priorities)::

    from fastper.compat.sb3 import PrioritizedReplayBuffer
    model = SAC("MlpPolicy", env, replay_buffer_class=PrioritizedReplayBuffer)

Needs ``pip install 'fastper[sb3]'`` (stable-baselines3, torch, gymnasium;
tested with stable-baselines3 2.9.2). ``import fastper`` and ``import
fastper.compat`` never import this module.

The pieces (see each for details):

* :class:`PrioritizedReplayBuffer`, :class:`DictPrioritizedReplayBuffer`:
  SB3's ``ReplayBuffer`` / ``DictReplayBuffer`` API (and subclasses of them)
  over a fastper buffer, proportional by default (``scheme="rank"`` or
  ``"uniform"``); samples are :class:`PrioritizedReplayBufferSamples` /
  :class:`DictPrioritizedReplayBufferSamples`: SB3's fields plus ``weights``
  (``(B, 1)`` float32 tensor), ``indices`` and ``keys``; then
  ``buffer.update_priorities(indices, td, keys)``.
* :class:`PERDQN`, :class:`PERSAC`, :class:`PERTD3`: SB3's algorithms with
  IS-weighted TD losses, |TD| written back, beta annealed to 1 over ``learn()``
  (written into the buffer's beta: the buffer is its one source).
* :func:`save_replay_buffer`, :func:`load_replay_buffer`: the pickle-free
  buffer file for any SB3 algorithm using these buffers.

Defaults: proportional, alpha 0.6, beta 0.4 (annealed to 1 by the PER
algorithms), eps 1e-6, and IS weights divided by the batch's largest
(``weight_norm="batch"``), not the buffer's: the buffer-wide largest weight,
that of the smallest priority, shrank every loss by orders of magnitude and
PERDQN learned far less than SB3's DQN with SB3's own hyper-parameters.

SB3's public arrays (``observations``, ``next_observations``, ``actions``,
``rewards``, ``dones``, ``timeouts``) are views of the stored rows, with SB3's
shapes and dtypes; setting ``pos`` / ``full`` admits rows written through them
(SB3's way to load offline data). One-step buffers only.

What differs from SB3's buffer: transitions are drawn by priority, one
transition at a time (SB3 draws a step, then an env); ``optimize_memory_usage``
is refused; the buffer cannot be pickled (it is saved in fastper's checkpoint
format; SB3's own ``save_replay_buffer`` is refused and leaves no file).
"""

from __future__ import annotations

from .sb3_algorithms import PERDQN, PERSAC, PERTD3, load_replay_buffer, save_replay_buffer
from .sb3_buffers import (
    DictPrioritizedReplayBuffer,
    DictPrioritizedReplayBufferSamples,
    PrioritizedReplayBuffer,
    PrioritizedReplayBufferSamples,
)

__all__ = [
    "PERDQN",
    "PERSAC",
    "PERTD3",
    "DictPrioritizedReplayBuffer",
    "DictPrioritizedReplayBufferSamples",
    "PrioritizedReplayBuffer",
    "PrioritizedReplayBufferSamples",
    "load_replay_buffer",
    "save_replay_buffer",
]
