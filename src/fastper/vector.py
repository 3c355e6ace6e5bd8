"""Glue for Gymnasium vector envs (duck-typed: gymnasium is never imported).

:func:`autoreset_mode` turns a vector env's ``metadata["autoreset_mode"]`` into
a buffer's ``autoreset`` setting, and refuses the mode fastper cannot store
correctly (SAME_STEP).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._validation import show

SAME_STEP_MESSAGE = (
    "autoreset mode SAME_STEP is not supported: under SAME_STEP the vector env returns "
    "the reset observation in place of the final one, so next_obs of every episode's "
    "last step would be wrong. Use autoreset_mode=NEXT_STEP (Gymnasium's default) with "
    "autoreset='next_step', or substitute infos['final_obs'] into next_obs for the envs "
    "that ended and pass autoreset=None"
)


def mode_name(mode: Any) -> str | None:
    """'next_step' / 'same_step' / 'disabled' from an enum, its name or value."""
    for cand in (getattr(mode, "name", None), getattr(mode, "value", None), mode):
        if isinstance(cand, str):
            key = cand.lower().replace("_", "").replace("-", "").replace(" ", "")
            if key in ("nextstep", "samestep", "disabled"):
                return {"nextstep": "next_step", "samestep": "same_step"}.get(key, key)
    return None


def autoreset_mode(env: Any) -> str | None:
    """The ``autoreset`` setting for a Gymnasium vector env. O(1).

    Reads ``env.metadata["autoreset_mode"]`` (an ``AutoresetMode`` enum,
    duck-typed: gymnasium is not imported).

    Returns:
        ``"next_step"`` for ``NEXT_STEP``, ``None`` for ``DISABLED``.

    Raises:
        ValueError: ``SAME_STEP`` (the message says what to do instead), an
            unknown mode, or no ``autoreset_mode`` in the metadata.
    """
    metadata = getattr(env, "metadata", None)
    if not isinstance(metadata, Mapping) or "autoreset_mode" not in metadata:
        raise ValueError(
            f"cannot tell the autoreset mode of {show(env)}: its metadata has no "
            "'autoreset_mode' (Gymnasium >= 1.1 sets it; 1.0 vector envs always reset on "
            "the next step: pass autoreset='next_step')"
        )
    mode = metadata["autoreset_mode"]
    name = mode_name(mode)
    if name == "same_step":
        raise ValueError(SAME_STEP_MESSAGE)
    if name is None:
        raise ValueError(
            f"autoreset_mode must be NEXT_STEP, SAME_STEP or DISABLED, got {show(mode)}"
        )
    return None if name == "disabled" else name
