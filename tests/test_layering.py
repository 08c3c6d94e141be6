"""The package's import graph: sub-packages import downward only, and no module imports itself back.

Every ``import`` statement counts, including those inside functions (a function-level import is
still a dependency; hiding a circle there is what this test forbids). The ``*_command.py``
modules are the command line, the top layer, wherever they live.
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1] / "mist_compiler"
# lower layers first; a module may import its own layer and the layers below it
LAYERS = ["ir", "ops", "models", "passes", "frontend", "cost", "tuner", "backends", "driver", "commands"]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[-1].endswith("_command") or parts[-1] in ("cli", "worker"):  # programs users (or torchrun) start
        return "commands"
    if len(parts) == 1:
        return "commands"  # the package facade (lazy names) sits on top
    return parts[1] if parts[1] in LAYERS else "commands"


def imports(path: pathlib.Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("mist_compiler")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("mist_compiler"):
                found.add(target)
                for alias in node.names:  # "from . import kernels" names a module
                    candidate = f"{target}.{alias.name}"
                    if (ROOT.parent / (candidate.replace(".", "/") + ".py")).exists():
                        found.add(candidate)
    return found


def graph() -> nx.DiGraph:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges = nx.DiGraph()
    for module, path in modules.items():
        edges.add_node(module)
        for target in imports(path, module):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != module:
                edges.add_edge(module, target)
    return edges


def test_no_module_imports_a_higher_layer():
    upward = []
    for source, target in graph().edges:
        if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(source)):
            upward.append(f"{source} -> {target}")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_circles_between_modules():
    edges = graph()
    # a package's __init__ re-exporting its modules is not a circle of code
    edges.remove_edges_from([(s, t) for s, t in list(edges.edges) if t.startswith(s + ".") or s.startswith(t + ".")
                             and ROOT.joinpath(*t.split(".")[1:], "__init__.py").exists()])
    cycles = list(nx.simple_cycles(edges))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


def test_passes_never_import_the_runtime():
    offenders = [f"{s} -> {t}" for s, t in graph().edges
                 if layer_of(s) == "passes" and layer_of(t) in ("backends", "driver", "frontend")]
    assert not offenders, offenders
