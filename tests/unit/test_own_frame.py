"""drafter/own_frame.py: compiled copies of closures of one def each get dynamo's recompile limit to
themselves (plain torch.compile of those closures shares one limit and runs the rest eagerly), and a
copy computes what the function computes (closure, defaults, keyword-only defaults kept)."""

from __future__ import annotations

import torch
import torch._dynamo

from dflash_trainer.drafter.own_frame import compile_own_frame


def _closures(n: int):
    def make(k):
        def scaled(x, shift=1.0, *, bias=0.5):
            return x * k + shift + bias
        return scaled
    return [make(k) for k in range(n)]


def _graphs_compiled(compile_fn, n: int) -> int:
    graphs = []

    def counting_backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        fns = [compile_fn(f, backend=counting_backend, dynamic=False) for f in _closures(n)]
        x = torch.ones(3)
        outs = [f(x) for f in fns]
    for k, out in enumerate(outs):  # compiled or eager fallback, the values are the function's
        torch.testing.assert_close(out, x * k + 1.5)
    return len(graphs)


def test_each_copy_has_its_own_recompile_limit():
    assert _graphs_compiled(torch.compile, 5) == 2  # one code object: 2 variants compile, 3 run eagerly
    assert _graphs_compiled(compile_own_frame, 5) == 5  # one code object each: all compile


def test_copy_keeps_closure_and_defaults():
    f = _closures(3)[2]
    g = compile_own_frame(f, backend="eager", dynamic=False)
    x = torch.arange(4.0)
    torch.testing.assert_close(g(x), f(x))
    torch.testing.assert_close(g(x, 2.0, bias=-1.0), f(x, 2.0, bias=-1.0))
