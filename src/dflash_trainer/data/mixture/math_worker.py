"""A child process that generates DeepMind mathematics_dataset questions and streams them as JSON
lines on stdout (run by data/mixture/maths.py; `python -m dflash_trainer.data.mixture.math_worker`).

Why a process of its own: the generator draws from the global `random` and `numpy.random` states
(and sympy's, e.g. `randprime`) and iterates over sets of sympy symbols, whose order follows
string hashing; the parent starts it with PYTHONHASHSEED=0 so the questions are the same on every
run, and the shims below stay out of the parent.

Determinism shim: `util.composition.expand_entities` puts `Entity` objects in a set before
shuffling them, so the order of the "Let x = ..." statements followed memory addresses (the
default id-based hash). Entities are hashed by creation order instead (a counter reset before
each question), which makes that order a function of the random state alone.

Shims for today's libraries (applied at import, nothing in site-packages is edited):
  current sympy (1.14 here) no longer has `base_solution_linear` in `sympy.solvers.diophantine`'s
  namespace (it lives in `sympy.solvers.diophantine.diophantine`); it is put back there before
  mathematics_dataset imports it.
  numpy ≥ 2 removed `ndarray.itemset` and `np.object`, used only by
  `mathematics_dataset.sample.polynomials`; that module alone gets a numpy namespace whose
  `zeros`/`empty` return an ndarray subclass with `itemset`, and whose `object` is `object`.

Protocol: the first line is `{"modules": [selected], "all_modules": [...], "shims": [...],
"versions": {...}}`. Then,
round after round, one line per module this worker owns (every `workers`-th module of the sorted
selection, from `worker` on): `{"module", "question", "answer", "too_long", "errors"}`, or once
`{"module", "error"}` when the module failed `MAX_TRIES` times in a row (it is then left out of
later rounds). Each module has its own random state, seeded from (seed, module name), so a
module's questions do not depend on the other modules or on the number of workers. Runs until
the parent closes the pipe.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import random
import sys
import types
from typing import Any

MAX_TRIES = 20  # consecutive failed calls before a module counts as failed
MAX_QUESTION_CHARS = 160  # mathematics_dataset.generate_settings: longer samples are redrawn
MAX_ANSWER_CHARS = 30


_entity_serial = [0]  # creation number of the next Entity within the current question


def reset_entity_serials() -> None:
    """Number the entities of the next question from 0 (the determinism shim)."""
    _entity_serial[0] = 0


def apply_shims() -> list[str]:
    """Apply the shims (module docstring) this environment needs; returns what was applied."""
    import numpy

    applied = []
    dio = importlib.import_module("sympy.solvers.diophantine")
    if not hasattr(dio, "base_solution_linear"):
        from sympy.solvers.diophantine.diophantine import base_solution_linear

        dio.base_solution_linear = base_solution_linear
        applied.append("sympy.solvers.diophantine.base_solution_linear")
    if not hasattr(numpy.ndarray, "itemset"):
        polynomials = importlib.import_module("mathematics_dataset.sample.polynomials")

        class _ItemsetArray(numpy.ndarray):
            def itemset(self, index: Any, value: Any) -> None:
                self[index] = value

        class _Numpy(types.ModuleType):
            object = object

            def __getattr__(self, name: str) -> Any:
                return getattr(numpy, name)

            @staticmethod
            def zeros(*args: Any, **kwargs: Any) -> Any:
                return numpy.zeros(*args, **kwargs).view(_ItemsetArray)

            @staticmethod
            def empty(*args: Any, **kwargs: Any) -> Any:
                return numpy.empty(*args, **kwargs).view(_ItemsetArray)

        polynomials.np = _Numpy("numpy")
        applied.append("mathematics_dataset.sample.polynomials.np (ndarray.itemset, np.object)")
    composition = importlib.import_module("mathematics_dataset.util.composition")
    entity_init = composition.Entity.__init__

    def numbered_init(self: Any, *args: Any, **kwargs: Any) -> None:
        self._creation_serial = _entity_serial[0]
        _entity_serial[0] += 1
        entity_init(self, *args, **kwargs)

    composition.Entity.__init__ = numbered_init
    composition.Entity.__hash__ = lambda self: self._creation_serial
    applied.append("mathematics_dataset.util.composition.Entity.__hash__ (creation order, for determinism)")
    return applied


def all_modules() -> dict[str, Any]:
    """Training-regime generators by name (`area__module`, sorted), full difficulty range."""
    from mathematics_dataset.modules import modules

    flat: dict[str, Any] = {}

    def add(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            name = f"{prefix}__{key}" if prefix else key
            if isinstance(value, dict):
                add(value, name)
            else:
                flat[name] = value

    add(modules.train(lambda entropy_range: entropy_range), "")
    return dict(sorted(flat.items()))


def select(names: list[str], wanted: list[str] | None) -> list[str]:
    """Names equal to, or starting with `<prefix>__`, any entry of `wanted` (None = all)."""
    if wanted is None:
        return names
    return [n for n in names if any(n == w or n.startswith(w + "__") for w in wanted)]


class RandomStates:
    """Every random state the generator draws from: Python's `random`, `numpy.random`, and
    sympy's own generators (`sympy.core.random`, used by e.g. `randprime`)."""

    def __init__(self) -> None:
        import numpy

        self.numpy = numpy
        self.sympy = importlib.import_module("sympy.core.random")

    def seeded(self, seed: int) -> tuple[Any, ...]:
        """The states after seeding every generator with `seed`."""
        random.seed(seed)
        self.numpy.random.seed(seed)
        self.sympy.rng.seed(seed)
        self.sympy._assumptions_rng.seed(seed)
        return self.get()

    def get(self) -> tuple[Any, ...]:
        return (random.getstate(), self.numpy.random.get_state(), self.sympy.rng.getstate(),
                self.sympy._assumptions_rng.getstate())

    def set(self, states: tuple[Any, ...]) -> None:
        random.setstate(states[0])
        self.numpy.random.set_state(states[1])
        self.sympy.rng.setstate(states[2])
        self.sympy._assumptions_rng.setstate(states[3])


def module_seed(seed: int, name: str) -> int:
    """A 32-bit seed for one module, stable across processes and Python versions."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:4], "little")


def main(argv: list[str] | None = None) -> None:
    """Run the protocol of the module docstring on stdout."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--worker", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--modules", default="null", help="JSON list of names or prefixes, or null")
    args = parser.parse_args(argv)
    out, sys.stdout = sys.stdout, sys.stderr  # only protocol lines on stdout, whatever the imports print

    import numpy

    shims = apply_shims()
    generators = all_modules()
    names = select(list(generators), json.loads(args.modules))
    import sympy

    versions = {"numpy": numpy.__version__, "sympy": sympy.__version__}
    header = {"modules": names, "all_modules": list(generators), "shims": shims, "versions": versions}
    out.write(json.dumps(header) + "\n")
    out.flush()
    own = names[args.worker::args.workers]
    rngs = RandomStates()
    states = {name: rngs.seeded(module_seed(args.seed, name)) for name in own}
    try:
        while own:
            for name in list(own):
                rngs.set(states[name])
                line = _one(name, generators[name])
                states[name] = rngs.get()
                if "error" in line:
                    own.remove(name)
                out.write(json.dumps(line) + "\n")
            out.flush()
    except BrokenPipeError:  # the parent has what it needs
        sys.stderr.close()  # nothing left to report; keep Python from complaining at exit


def _one(name: str, generate: Any) -> dict[str, Any]:
    """One question of module `name`, redrawn while too long (as the package's generate.py does)."""
    too_long = errors = 0
    while True:
        try:
            reset_entity_serials()
            problem = generate()
            question, answer = str(problem.question), str(problem.answer)
        except Exception as e:  # the package's own failure: count it, give up after MAX_TRIES in a row
            errors += 1
            if errors >= MAX_TRIES:
                return {"module": name, "error": f"{type(e).__name__}: {e}"[:300]}
            continue
        if len(question) > MAX_QUESTION_CHARS or len(answer) > MAX_ANSWER_CHARS:
            too_long += 1
            continue
        return {"module": name, "question": question, "answer": answer, "too_long": too_long, "errors": errors}


if __name__ == "__main__":
    main()
