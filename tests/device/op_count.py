"""Count the tensor operations a piece of code dispatches: a TorchDispatchMode counter.

The rule: every ATen operator call that reaches the dispatcher is an
operation, except views and aliases, whose schema returns an alias of an
input (``view``, ``slice``, ``select``, ``unsqueeze``, ``expand``, ``t``,
``unfold``, ``as_strided``, ``detach``, ``view(dtype)``, ...): they only make
new metadata and never run a kernel. On a GPU each counted operation is (at
least) one kernel launch; on the CPU device it is one trip through the
dispatcher. Operations that an operator runs inside its own implementation
are not seen (the mode sees the calls made from Python), so the code under
test must not rely on hidden copies (a non-contiguous index, say) to keep its
count low.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


def is_view(func: Any) -> bool:
    """Whether ``func`` (an ATen overload) returns a view or alias of an input."""
    if getattr(func, "is_view", False):
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class count_ops(TorchDispatchMode):
    """``with count_ops() as c: ...`` then ``c.count`` (non-view operations) and ``c.ops``
    (a Counter of their names), ``c.views`` (the views seen, for reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        (self.views if is_view(func) else self.ops)[str(func)] += 1
        return func(*args, **(kwargs or {}))
