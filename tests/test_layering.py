"""The package's import graph: sub-packages import downward only, no module imports itself back,
and no file grows past what a reader holds in their head.

Every ``import`` statement counts, including those inside functions (a function-level import is
still a dependency; hiding a circle there is what this test forbids). Every module belongs to
the layer of its folder (top-level modules to their own name); there are no exceptions.
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1] / "mist_compiler"
# lower layers first; a module may import its own layer and the layers below it
LAYERS = ["ir", "ops", "models", "passes", "frontend", "cost", "tuner", "lowering", "runtime", "profiling", "verify",
          "driver", "torch_compile", "launch", "training", "cli", "mist_compiler"]
MAX_LINES = 620


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]  # the package facade (lazy names) sits on top


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
                for alias in node.names:  # "from . import kernels" names a module, not the package
                    candidate = f"{target}.{alias.name}"
                    path = ROOT.parent / candidate.replace(".", "/")
                    found.add(candidate if path.with_suffix(".py").exists() or path.is_dir() else target)
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


def test_every_module_has_a_layer():
    unknown = sorted(m for m in graph().nodes if layer_of(m) not in LAYERS)
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown}"


def test_every_package_says_what_it_owns():
    missing = [str(p.relative_to(ROOT)) for p in ROOT.glob("*/__init__.py")
               if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert not missing, missing


def test_no_file_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
