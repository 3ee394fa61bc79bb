"""torch.compile of a function under a code object of its own.

dynamo keeps its compiled variants per code object and stops compiling one after
torch._dynamo.config.recompile_limit variants (8), silently running it eagerly from then on. Every
closure made by one `def` shares that def's code object, and every functools.partial shares one
wrapper frame inside dynamo, so "one compiled function per option set" built either way shares one
limit between all option sets, grad modes and shapes of the process. `compile_own_frame` compiles a
copy of the function whose code object is new, so each compiled function has a limit of its own.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable

import torch

_serial = itertools.count()


def compile_own_frame(fn: Callable, **compile_kwargs) -> Callable:
    """torch.compile(a copy of `fn` with its own code object, named `<name>_<n>`), same globals, defaults,
    keyword defaults and closure; `compile_kwargs` go to torch.compile. Call once per variant and keep
    the result."""
    n = next(_serial)
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{n}")
    if hasattr(code, "co_qualname"):  # Python ≥ 3.11
        code = code.replace(co_qualname=f"{fn.__code__.co_qualname}_{n}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = f"{fn.__qualname__}_{n}"
    copy.__doc__ = fn.__doc__
    return torch.compile(copy, **compile_kwargs)
