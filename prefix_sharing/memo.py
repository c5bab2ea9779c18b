"""One memo for what is derived from a plan: built once per plan, freed with it.

A :class:`~prefix_sharing.plan.SharingPlan` is built once per micro-batch and read by every
layer. What the layers derive from it (a window's trimmed key segments, the recurrence
schedule, the MoE router's view of the plain batch, the log-probs' token views, the torch
recurrent kernel's chunk layout of a schedule) depends on the plan alone, so it is built on
first use, on the plan's device, and every later layer reads the same tensors: no layer
rebuilds an index, none copies one to the host. It must also die with the plan: a training
run makes a plan per micro-batch, and a memo that kept them would keep every step's index
tensors alive.

So the memo is keyed on the *object* (its identity, never its ``__eq__``/``__hash__``: a frozen
dataclass keeps its own equality and hashing, and an unhashable one works too) and held beside
it, not in it: nothing is written into a frozen instance, and ``dataclasses.replace`` /
:meth:`SharingPlan.to` give a new object with a memo of its own (its tensors on its own
device). Each owner's entries are dropped by a weak-reference callback when the owner is
collected; an owner must therefore support weak references (any class without ``__slots__``).
A derived value must not hold its owner (it would keep it alive): builders return index
tensors and host ints, not the plan.

Use :func:`derived` for a value with arguments (``derived(plan, build, window)`` is
``build(plan, window)``, once per plan and window) and :func:`derived_property` for a
property of the owner's class.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

__all__ = ["derived", "derived_property"]

T = TypeVar("T")

# id(owner) -> {(build, args): value}; an entry leaves when its owner is collected (the
# callback runs before the id can be reused).
_TABLES: dict[int, dict[tuple[Callable[..., Any], tuple[Hashable, ...]], Any]] = {}


def derived(owner: Any, build: Callable[..., T], *args: Hashable) -> T:
    """``build(owner, *args)``, computed once per ``owner`` and ``args`` and then reused.

    Args:
        owner: the object the value is derived from (a plan, a schedule); weak-referenceable.
        build: the function that derives it; with ``args`` it is the memo's key, so two
            callers of the same function share one value.
        args: hashable arguments of ``build`` beyond the owner (a window, a device).

    Returns:
        The value ``build`` returned the first time for this owner and these arguments; it
        lives until ``owner`` is collected.
    """
    key = id(owner)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = {}
        weakref.finalize(owner, _TABLES.pop, key, None)
    entry = (build, args)
    if entry not in table:
        table[entry] = build(owner, *args)
    return table[entry]


def derived_property(build: Callable[[Any], T]) -> property:
    """A read-only property computed once per instance through :func:`derived` (for frozen
    dataclasses, where ``functools.cached_property`` would write into the instance)."""
    prop = property(lambda self: derived(self, build))
    prop.__doc__ = build.__doc__
    return prop
