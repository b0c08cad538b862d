"""Test-only hooks: a gate replaces one attribute of a class for the duration of a block to
record what the engine passes between its phases. The engine has no recording code; a
planted fault (faults.py) entered outside the block is what the hook wraps and records."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

Wrap = Callable[[Callable], Callable]  # the current attribute -> its replacement


@contextmanager
def hooked(*hooks: tuple[Any, str, Wrap]) -> Iterator[None]:
    """Install each (owner, attribute name, wrap) in turn until the block ends."""
    with ExitStack() as stack:
        for owner, name, wrap in hooks:
            current = getattr(owner, name)
            setattr(owner, name, wrap(current))
            stack.callback(setattr, owner, name, current)
        yield
