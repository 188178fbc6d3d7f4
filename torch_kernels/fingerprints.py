"""Fingerprints of implementations: a short hash of the source an implementation runs, launch configs included.

A tuned table (``tuning.py``) records the fingerprint of every backend it timed; under
``DEEPINFER_OPS_BACKEND=auto`` an entry whose winner's fingerprint differs from the installed
implementation's measured another kernel and is ignored. The fingerprint of a :class:`KernelSpec` hashes
its ``target``, ``check``, ``host`` and ``dtypes`` and the text of every module of this package that its
target, check and host modules import, transitively: the family's kernel module, the shared ``backends/``
modules, and the core modules they import (``fp8.py``), without those modules' own imports. The launch
configs are records in those modules, so an edit to a kernel, its heuristic or a shared helper changes
it. A framework's modules do not count: its version is in the table's key.

Standard library only, and no module is imported: the files are read (``ast``), each once per process.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

from .spec import KernelSpec

PACKAGE = __package__
PACKAGE_ROOT = Path(__file__).resolve().parent
#: hex digits kept: 48 bits, no collision to expect among a few hundred implementations
DIGITS = 12


def _module_file(name: str, root: Path) -> Optional[Path]:
    """The source file of module ``name`` of this package under ``root``, or ``None`` if there is none."""
    parts = name.split(".")[1:]
    base = root.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=None)
def _imports(name: str, path: Path, root: Path) -> Tuple[str, ...]:
    """The modules of this package that module ``name`` (at ``path``) imports, anywhere in its body."""
    return tuple(_walk_imports(name, path, root))


def _walk_imports(name: str, path: Path, root: Path) -> Iterable[str]:
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_bytes(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not (source == PACKAGE or source.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                # ``from . import fp8`` names a module; ``from .rows import rows_view`` a name in one
                yield sub if _module_file(sub, root) is not None else source


def sources(modules: Iterable[str], root: Path = PACKAGE_ROOT) -> List[Tuple[str, Path]]:
    """(module, file) of ``modules`` and of every module of this package they import, transitively, sorted;
    never the package's own ``__init__`` (it registers every op, and is no kernel's source). A core module (one
    directly in the package, as ``fp8``) counts without its own imports: those (``checks``, ``opdef``) are
    the op definitions' plumbing, and an edit there would make every table stale."""
    seen: Dict[str, Path] = {}
    todo = [m for m in modules if m.startswith(PACKAGE + ".")]
    while todo:
        name = todo.pop()
        if name in seen or name == PACKAGE:
            continue
        path = _module_file(name, root)
        if path is None:
            continue
        seen[name] = path
        if name.count(".") > 1:
            todo.extend(_imports(name, path, root))
    return sorted(seen.items())


@functools.lru_cache(maxsize=None)
def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def of(spec: KernelSpec, root: Path = PACKAGE_ROOT) -> str:
    """The fingerprint of ``spec``: :data:`DIGITS` hex digits (computed once per process and ``root``)."""
    return _of(spec, root)


@functools.lru_cache(maxsize=None)
def _of(spec: KernelSpec, root: Path) -> str:
    targets = [t for t in (spec.target, spec.check, spec.host) if t]
    modules = list(dict.fromkeys(t.partition(":")[0] for t in targets))
    h = hashlib.sha256()
    h.update(repr((targets, spec.dtypes)).encode())
    for name, path in sources(modules, root):
        h.update(f"\0{name}\0{_file_digest(path)}".encode())
    outside: Set[str] = {m for m in modules if not m.startswith(PACKAGE + ".")}
    for name in sorted(outside):  # a module of another package (a test's stand-in): its file where one is found
        h.update(f"\0{name}\0{_outside_digest(name)}".encode())
    return h.hexdigest()[:DIGITS]


def _outside_digest(name: str) -> str:
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    return _file_digest(Path(origin)) if origin and Path(origin).is_file() else "no source"


def clear() -> None:
    """Forget every fingerprint and file digest (after a kernel file changed in this process)."""
    for cached in (_of, _file_digest, _imports):
        cached.cache_clear()
