"""The package order, read from the source: data flows one way (docs/architecture.md).

Every `import` / `from … import` of a dflash_trainer module, at module level or inside a function,
is an edge. Each package may import only the packages listed before it in LAYERS; modules never
import each other in a cycle, inside a package or across packages.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "dflash_trainer"

# Lowest first. A package may import its own modules and any package before it, never one after.
LAYERS = ("files", "telemetry", "config", "target_model", "drafter", "interop", "decoding", "data",
          "preflight", "training", "pipeline", "evaluation", "recipe", "bench", "cli")


def modules() -> dict[str, Path]:
    """Dotted name (without the dflash_trainer prefix) → file, for every module of the package."""
    out = {}
    for p in SRC.rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the dflash_trainer modules it imports (a `from pkg import name` of a module counts as that module)."""
    out: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                elif node.module and (node.module == "dflash_trainer" or node.module.startswith("dflash_trainer.")):
                    mod = node.module.removeprefix("dflash_trainer").lstrip(".")
                else:
                    continue
                for alias in node.names:
                    sub = f"{mod}.{alias.name}" if mod else alias.name
                    targets.append(sub if sub in mods else mod)
            elif isinstance(node, ast.Import):
                targets = [a.name.removeprefix("dflash_trainer.") for a in node.names if a.name.startswith("dflash_trainer.")]
            out[name].update(t for t in targets if t in mods and t != name)
    return out


def layer(module: str) -> str:
    return module.split(".")[0] if module else ""


def test_every_module_is_in_a_layer():
    mods = modules()
    strays = sorted(m for m in mods if m and layer(m) not in LAYERS)
    assert not strays, f"modules outside the listed packages (add the package to LAYERS or move them): {strays}"
    assert set(LAYERS) == {layer(m) for m in mods if m}, "LAYERS names a package that does not exist"


def test_no_import_points_back_up():
    mods = modules()
    rank = {p: i for i, p in enumerate(LAYERS)}
    back = sorted(f"{a} -> {b}" for a, bs in edges(mods).items() for b in bs
                  if a and b and layer(a) != layer(b) and rank[layer(b)] > rank[layer(a)])
    assert not back, "imports against the package order:\n" + "\n".join(back)
    assert not edges(mods)[""], "the top-level package (its version) imports nothing"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    nodes = set(graph) | {b for bs in graph.values() for b in bs}
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_cycles():
    assert _cycles(edges(modules())) == []


def test_no_package_cycles():
    packages: dict[str, set[str]] = defaultdict(set)
    for a, bs in edges(modules()).items():
        packages[layer(a)].update(layer(b) for b in bs if layer(b) != layer(a))
    assert _cycles(packages) == []


def test_only_the_bench_command_imports_bench():
    """`bench` is the benchmark harness behind `dflash-train bench`: no product module leans on it."""
    users = sorted({a for a, bs in edges(modules()).items() for b in bs
                    if layer(b) == "bench" and layer(a) != "bench"})
    assert users == ["cli.bench"]


def test_only_the_recipe_command_imports_recipe():
    """`recipe` runs the commands as child processes: only `dflash-train recipe` imports it (and cli/oom.py, the
    commands' out-of-memory exit, which reads the plan's memory rules backwards, and bench/regen_shapes.py, which
    measures at the rows those rules give), and it imports no cli."""
    graph = edges(modules())
    users = sorted({a for a, bs in graph.items() for b in bs if layer(b) == "recipe" and layer(a) != "recipe"})
    assert users == ["bench.regen_shapes", "cli.oom", "cli.recipe"]
    assert not [b for a, bs in graph.items() if layer(a) == "recipe" for b in bs if layer(b) == "cli"]
