"""Every object Carnator keeps for the life of its process, in one place, with the one `reset` the tests use.

Why one place: the entry writer's thread, the open stores, lookup indexes, caches, once-only log notes and the
server's route registrations live as long as the process; held here rather than in module globals, they can be
dropped together (a test starts from a fresh process's state) without knowing each module's internals. Each
object is made on first use by the module that owns its type, under a name that module gives it. This module
imports nothing of Carnator's nor ComfyUI, so every module (the kernels included) can use it without a cycle.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_held: dict[str, Any] = {}  # name -> object, in the order they were made
_making = threading.RLock()  # reentrant: a `make` may ask for another object


def one(name: str, make: Callable[[], T]) -> T:
    """The process's one object called `name`, made by `make` on first use (never twice, whatever the threads)."""
    try:
        return _held[name]
    except KeyError:
        pass
    with _making:
        if name not in _held:
            _held[name] = make()
        return _held[name]


def reset() -> None:
    """Drop every object, so the next use makes a fresh one; those with a `close` (the entry writer's thread, the
    open stores, the prompt-prefetch thread...) are closed, the latest made first: what was made to use another
    (the writer, on a run's first entry, writes into a store opened before it) ends before it."""
    with _making:
        dropped = list(_held.values())
        _held.clear()
    for held in reversed(dropped):
        close = getattr(held, "close", None)
        if callable(close):
            close()
