"""The import graph of ``torch_kernels``: no circle at module level, and no layer importing upward.

Read from the source (AST), not by importing: every ``import`` and ``from ... import`` of a
``torch_kernels`` module, at module level and inside functions, relative ones resolved.
``python tests/test_layers.py`` prints the cycles and the broken rules.

An edge ``a -> b`` means that running ``a`` may run ``b``: the module imported, every package above it
that is not already above ``a`` (importing ``torch_kernels.families.rope.ops`` from ``impl`` runs
``ops/__init__``), and the package itself for a name that is not a submodule (``from torch_kernels
import rmsnorm``, ``import torch_kernels``): that runs ``__init__``'s imports too. A ``KernelSpec``'s
``"module:attr"`` target is no edge: it is how the core reaches a backend without importing it.
"""

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = "torch_kernels"
SOURCE = Path(__file__).resolve().parent.parent / PACKAGE


def _modules(*names: str) -> Set[str]:
    return {f"{PACKAGE}.{n}" for n in names}


#: the bottom of the core: the inventory (it imports where torch is not installed) and what selection
#: pushes down to the kernels (``reporting``); the standard library only, torch inside a function
#: (``Platform.detect``). Every family's package ``__init__`` and ``manifest`` join them (:func:`stdlib_only`).
STDLIB_ONLY_CORE = _modules("spec", "registry", "manifest", "reporting", "_files", "families")
FAMILIES = f"{PACKAGE}.families"
#: (rule, the modules it binds, what they never import, module or function level); ``PACKAGE`` itself
#: stands for the package's ``__init__`` only, the others for everything under them
RULES = (
    ("kernels and op definitions never reach selection, registration, the inventory, tuning, the test kit, "
     "the benchmarks or the front door", {FAMILIES} | _modules("backends", "opdef", "checks"),
     {PACKAGE} | _modules("dispatch", "library", "fast_path", "registry", "ops", "tuning", "testing", "bench", "__main__")),
    ("a backend's shared code and the op kit never import a family", _modules("backends", "opdef", "checks"), {FAMILIES}),
    ("selection never reaches registration, a family, a backend or the front door (it pushes its "
     "settings down, or notifies)", _modules("dispatch", "tuning", "reporting"),
     {PACKAGE} | _modules("library", "fast_path", "ops", "families", "backends", "testing", "bench", "__main__")),
    ("registration never imports the test kit, the benchmarks or the front door", _modules("library", "fast_path"),
     {PACKAGE} | _modules("testing", "bench", "__main__")),
    ("registration names no family: it reaches them through the inventory", _modules("library", "ops", "fast_path"),
     _modules("families", "backends")),
    ("the shipped compiler passes name ops as torch.ops.deepinfer.* and read the FP8 numerics from fp8: no family, "
     "backend, selection, registration or inventory", _modules("passes"),
     {PACKAGE} | _modules("families", "backends", "dispatch", "library", "fast_path", "registry", "ops", "tuning",
                         "testing", "bench", "__main__")),
)


def stdlib_only(known: Dict[str, Path]) -> Set[str]:
    """The modules that import the standard library only: the core's bottom, and every family's package
    ``__init__`` and ``manifest`` (the inventory imports them where torch is not installed)."""
    family_level = FAMILIES.count(".") + 1
    return STDLIB_ONLY_CORE | {m for m, path in known.items() if m.startswith(FAMILIES + ".") and (
        m.count(".") == family_level and path.name == "__init__.py"
        or m.count(".") == family_level + 1 and m.endswith(".manifest"))}


def _family(module: str) -> str:
    """The family package ``module`` belongs to, or ``""``."""
    parts = module.split(".")
    return ".".join(parts[:3]) if module.startswith(FAMILIES + ".") else ""


def modules(root: Path = SOURCE) -> Dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__``)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _ancestors(name: str) -> List[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_package(name: str, known: Dict[str, Path]) -> bool:
    return name in known and known[name].name == "__init__.py"


def imports(name: str, known: Dict[str, Path]) -> Tuple[Set[str], Set[str]]:
    """The modules ``name`` may run: (at module level, inside functions)."""
    tree = ast.parse(known[name].read_text(), str(known[name]))
    here = name if _is_package(name, known) else name.rpartition(".")[0]  # the package relative imports start from
    top: Set[str] = set()
    nested: Set[str] = set()

    def targets(node: ast.AST) -> Set[str]:
        found: Set[str] = set()
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[:len(here.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source != PACKAGE and not source.startswith(PACKAGE + "."):
                return found
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in known else source)  # a name that is no module: the package's __init__
        out = set()
        for target in found:
            out.add(target)
            out.update(a for a in _ancestors(target) + [target] if a in known and a != name
                       and a not in _ancestors(name))
        return {t for t in out if t in known and t != name}

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (nested if in_function else top).update(targets(child))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    visit(tree, False)
    return top, nested - top


def outside_imports(path: Path) -> Tuple[Set[str], Set[str]]:
    """The top-level names of the modules outside the package that ``path`` imports: (at module
    level, inside functions only)."""
    top: Set[str] = set()
    nested: Set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and not child.level:
                names = [child.module or ""]
            (nested if in_function else top).update(n.split(".")[0] for n in names if n.split(".")[0] != PACKAGE)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    visit(ast.parse(path.read_text(), str(path)), False)
    return top, nested - top


def graph(root: Path = SOURCE) -> Tuple[Dict[str, Set[str]], Dict[str, Set[str]]]:
    """(module-level edges, function-level edges) of every module."""
    known = modules(root)
    top, nested = {}, {}
    for name in known:
        top[name], nested[name] = imports(name, known)
    return top, nested


def cycles(edges: Dict[str, Set[str]], report_all: bool = False) -> List[List[str]]:
    """One shortest circle ``[a, b, ..., a]`` per strongly connected component of more than one module
    (Tarjan), through its first module; ``report_all``: through each of its modules, distinct ones."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    components: List[Set[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            strong(v)
    out = []
    for component in sorted(components, key=sorted):
        for start in sorted(component):
            circle = _shortest_circle(edges, component, start)
            if not any(set(circle) == set(c) for c in out):
                out.append(circle)
            if not report_all:
                break
    return out


def _shortest_circle(edges: Dict[str, Set[str]], component: Set[str], start: str) -> List[str]:
    """A shortest circle ``[start, ..., start]`` inside ``component`` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} lies on no circle")


def _under(module: str, prefixes: Set[str]) -> bool:
    return any(module == p or p != PACKAGE and module.startswith(p + ".") for p in prefixes)


def violations(top: Dict[str, Set[str]], nested: Dict[str, Set[str]], root: Path = SOURCE) -> List[str]:
    """Every import that breaks a layer rule, as ``a -> b: rule``."""
    stdlib = set(sys.stdlib_module_names)
    paths = modules(root)
    bottom = stdlib_only(paths)
    out = []
    for name in sorted(top):
        everything = top[name] | nested[name]
        if name in bottom:
            out += [f"{name} -> {t}: imports only the stdlib and the inventory's modules"
                    for t in sorted(everything - bottom)]
            at_top, inside = outside_imports(paths[name])
            out += [f"{name} -> {t}: imports only the stdlib (torch inside a function)"
                    for t in sorted((at_top - stdlib) | (inside - stdlib - {"torch"}))]
        for rule, bound, forbidden in RULES:
            if _under(name, bound):
                out += [f"{name} -> {t}: {rule}" for t in sorted(everything) if _under(t, forbidden)]
        if _family(name):
            out += [f"{name} -> {t}: a family never imports another family" for t in sorted(everything)
                    if _family(t) not in ("", _family(name))]
    return out


def test_no_import_circle_at_module_level():
    top, _ = graph()
    assert cycles(top) == []


def test_no_layer_imports_upward():
    assert violations(*graph()) == []


def test_the_graph_sees_relative_function_level_and_package_imports(tmp_path):
    """The reader itself, on a package of four files: a relative import inside a function, a name from
    the package's ``__init__``, the circle they close, and the rules they break."""
    pkg = tmp_path / PACKAGE
    for family in ("a", "b"):
        (pkg / "families" / family).mkdir(parents=True)
        (pkg / "families" / family / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import dispatch\n")
    (pkg / "dispatch.py").write_text("from .families.a import kernel\n")
    (pkg / "families" / "__init__.py").write_text("")
    (pkg / "families" / "a" / "kernel.py").write_text("def f():\n    from ... import dispatch\n    from torch_kernels import x\n")
    (pkg / "families" / "b" / "manifest.py").write_text("from ..a import kernel\n")
    (pkg / "spec.py").write_text("import os\nimport torch\n")
    top, nested = graph(pkg)
    a, kernel = f"{FAMILIES}.a", f"{FAMILIES}.a.kernel"
    assert top[f"{PACKAGE}.dispatch"] == {FAMILIES, a, kernel}
    assert nested[kernel] == {f"{PACKAGE}.dispatch", PACKAGE}
    assert cycles(top) == []
    merged = {k: top[k] | nested[k] for k in top}
    assert cycles(merged) == [[PACKAGE, f"{PACKAGE}.dispatch", kernel, PACKAGE]]
    assert [v.split(":")[0] for v in violations(top, nested, pkg)] == [
        f"{PACKAGE}.dispatch -> {FAMILIES}", f"{PACKAGE}.dispatch -> {a}", f"{PACKAGE}.dispatch -> {kernel}",
        f"{kernel} -> {PACKAGE}", f"{kernel} -> {PACKAGE}.dispatch",
        f"{FAMILIES}.b.manifest -> {kernel}",  # a manifest imports the stdlib and the inventory only
        f"{FAMILIES}.b.manifest -> {a}", f"{FAMILIES}.b.manifest -> {kernel}",  # and no other family
        f"{PACKAGE}.spec -> torch"]


def main() -> None:
    top, nested = graph()
    merged = {k: top[k] | nested[k] for k in top}
    for title, edges in (("module level", top), ("module and function level", merged)):
        found = cycles(edges, report_all=True)
        print(f"cycles at {title}: {len(found)}")
        for c in found:
            print("  " + " -> ".join(m.replace(PACKAGE + ".", "") for m in c))
    broken = violations(top, nested)
    print(f"layer rules broken: {len(broken)}")
    for line in broken:
        print("  " + line)


if __name__ == "__main__":
    main()
