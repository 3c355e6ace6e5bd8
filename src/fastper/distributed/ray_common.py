"""What the Ray back end's modules share: importing Ray, its errors, counting rows.

The Ray modules depend on each other in one direction only::

    ray_common  <-  ray_limiter  <-  ray_backend
         ^                               |
         +--------  ray_router  <--------+

(``ray_backend`` re-exports the others' names). Importing this module does
not import Ray; :func:`require_ray` does, on first use, and says how to install
it when it is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import require
from ..limiter import RateLimiterCancelled, RateLimitTimeout

__all__ = [
    "LIMITER_CALL_TIMEOUT",
    "LIMITER_GRACE",
    "call_limiter",
    "count_rows",
    "lost_types",
    "require_ray",
    "unwrap_ray_error",
]

#: seconds a client waits for the rate limiter's reply beyond the timeout the
#: limiter itself waits with (``await_insert`` / ``await_sample``), so that the
#: limiter's own answer (which says why it held the call) comes first
LIMITER_GRACE = 1.0
#: seconds a limiter call that does not wait inside the limiter (counts, stats, state) may
#: take before it is reported as not answering (long enough for a limiter actor still starting)
LIMITER_CALL_TIMEOUT = 120.0


def require_ray() -> Any:
    """The ``ray`` module, imported on first use.

    Raises:
        MissingExtraError: Ray is not installed (one line with the install hint).
    """
    return require("ray", "fastper's Ray back end", "ray")


def lost_types(ray: Any) -> tuple[type[BaseException], ...]:
    """Ray errors meaning the callee's process or machine is gone (not a method's error)."""
    ex = ray.exceptions
    # RayActorError covers ActorDiedError and ActorUnavailableError; a reply
    # whose node died raises ObjectLostError (and its subclasses)
    return (ex.RayActorError, ex.ObjectLostError, ex.NodeDiedError)


def unwrap_ray_error(exc: BaseException) -> BaseException:
    """The error a remote method raised, as itself (a ValueError stays a ValueError).

    Ray wraps a method's exception in ``RayTaskError``; its ``cause`` is the
    original object (unpickled here). Anything else is returned unchanged.
    """
    ray = require_ray()
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayTaskError):
            if cause.__cause__ is None:
                cause.__cause__ = exc  # keeps the remote traceback in the chain
            return cause
        return exc.as_instanceof_cause()
    return exc


def call_limiter(
    ref: Any, timeout: float | None = None, *, what: str = "a call", allowed: float | None = None
) -> Any:
    """``ray.get`` of a limiter call; its errors as themselves, a gone limiter as cancelled.

    Args:
        ref: the reply of a call on the rate limiter actor.
        timeout: seconds to wait for the reply (``None``: for ever). A call
            that waits inside the limiter (``await_insert``, ``await_sample``)
            ends there by its own timeout; give this one
            :data:`LIMITER_GRACE` more, so that the limiter's answer, which
            says why it waited, comes first.
        what: the call, for the message (e.g. ``"await_insert(8 rows)"``).
        allowed: the whole time the caller gave the call, for the message,
            when ``timeout`` is only what is left of it (default ``timeout``).

    Raises:
        RateLimitTimeout: no reply within ``timeout`` (the limiter actor is
            stuck, overloaded or on an unreachable node; the call may still
            take effect there later).
        RateLimiterCancelled: the limiter actor is gone.
        Exception: what the limiter's method raised, as itself.
    """
    ray = require_ray()
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        limit = timeout if allowed is None else allowed
        raise RateLimitTimeout(
            f"the rate limiter actor did not answer {what} within {limit:g} s: it is "
            "stuck, overloaded or on an unreachable node (the call may still take effect "
            "there); check the limiter actor (its stats(), Ray's dashboard), or allow a "
            "longer timeout"
        ) from None
    except ray.exceptions.RayTaskError as exc:
        raise unwrap_ray_error(exc)  # noqa: B904 - its __cause__ is the remote error
    except lost_types(ray) as exc:
        raise RateLimiterCancelled(f"the rate limiter actor is gone: {exc}") from exc


def count_rows(fields: Mapping[str, Any], transition: Mapping[str, Any]) -> int:
    """Rows in ``transition``: B for a batch (one leading dimension more than the field), else 1.

    ``fields`` maps names to ``(shape, dtype)`` (a shard's ``describe()["fields"]``). O(fields).
    """
    for name, value in transition.items():
        spec = fields.get(name)
        if spec is None:
            continue
        shape = tuple(np.shape(value))
        return int(shape[0]) if len(shape) == len(tuple(spec[0])) + 1 else 1
    return 1
