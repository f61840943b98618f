"""Copies of upstream functions that behave as the original but read differently, for the tests
that a fix's behavioural probe is not fooled by reformatting (it must give the same verdict)."""

from __future__ import annotations

import functools
import inspect
import re
import textwrap
import types
from typing import Callable


def rewritten_copy(fn: Callable, renames: dict[str, str]) -> Callable:
    """``fn`` recompiled from its source with each identifier of ``renames`` renamed (whole words;
    choose local variables only) and a comment added, running in ``fn``'s own module globals (the
    probes' stand-ins there reach it), so that it behaves as ``fn`` but its text differs.

    Raises:
        AssertionError: a name of ``renames`` does not occur in the source (the copy would not
            differ), or ``fn`` is decorated (its source would re-apply the decorator).
    """
    src = textwrap.dedent(inspect.getsource(fn))
    assert not src.lstrip().startswith("@"), f"{fn.__qualname__} is decorated"
    for old, new in renames.items():
        assert re.search(rf"\b{old}\b", src), f"{old!r} not in {fn.__qualname__}"
        src = re.sub(rf"\b{old}\b", new, src)
    src = f"# rewritten copy: same behaviour, other text\n\n{src}\n"
    namespace = dict(fn.__globals__)
    exec(compile(src, f"<rewritten {fn.__qualname__}>", "exec"), namespace)
    compiled = namespace[fn.__name__]
    copy = types.FunctionType(
        compiled.__code__, fn.__globals__, fn.__name__, compiled.__defaults__, compiled.__closure__
    )
    copy.__kwdefaults__ = compiled.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    assert inspect.getsource(fn) != src
    return copy


def trivial_wrapper(fn: Callable) -> Callable:
    """A function that only calls ``fn`` (another source text, another code object; no
    ``__wrapped__``, so nothing unwraps it)."""

    def passes_through(*args, **kwargs):
        return fn(*args, **kwargs)

    functools.update_wrapper(passes_through, fn, updated=())
    del passes_through.__wrapped__
    passes_through.__module__ = __name__
    return passes_through
