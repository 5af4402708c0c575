"""The layers import one way: cli -> {trainer, library} -> reshard -> formats; the top package (``import moeckpt``)
uses the library; ``moeckpt.testing`` is for tests (nothing else imports it). Every import counts, those inside
functions too: a lazy import still makes the lower layer depend on the upper one. No module takes part in an
import circle at run time (imports under ``if TYPE_CHECKING:``, which never run, may name a type either way)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: folder -> the import name it installs as (pyproject.toml's package-dir)
FOLDERS = {
    "toplevel": "moeckpt",
    "formats": "moeckpt.formats",
    "reshard": "moeckpt.reshard",
    "library": "moeckpt.library",
    "trainer": "moeckpt.trainer",
    "cli": "moeckpt.cli",
    "testing": "moeckpt.testing",
}
#: what each layer may import, besides itself
ALLOWED = {
    "formats": set(),
    "reshard": {"formats"},
    "library": {"formats", "reshard"},
    "trainer": {"formats", "reshard"},
    "toplevel": {"formats", "reshard", "library"},
    "cli": {"formats", "reshard", "library", "trainer", "toplevel"},
    "testing": {"formats", "reshard", "library", "trainer", "toplevel"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import statements under ``if TYPE_CHECKING:``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imports(module: str, path: Path, *, typing: bool = True) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    skip = set() if typing else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not (module == base or module.startswith(base + ".")):
                out.add(base)  # ``from . import sibling`` names the sibling, not the package that holds both
            out.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in out if m == "moeckpt" or m.startswith("moeckpt.")}


def _layer(module: str) -> str:
    for folder, name in sorted(FOLDERS.items(), key=lambda kv: -len(kv[1])):
        if module == name or module.startswith(name + "."):
            return folder
    raise AssertionError(module)


def _graph(*, typing: bool = True) -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        graph[module] = {m for m in _imports(module, path, typing=typing) if m in modules and m != module}
    return graph


def test_every_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, targets in _graph().items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            if there != here and there not in ALLOWED[here]:
                wrong.append(f"{module} imports {target} ({here} -> {there})")
    assert not wrong, "\n".join(sorted(wrong))


def test_nothing_but_tests_imports_the_testing_package():
    users = [
        m for m, targets in _graph().items() if _layer(m) != "testing" and any(_layer(t) == "testing" for t in targets)
    ]
    assert not users


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.add(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(component)
    return out


def test_no_import_circle():
    assert not _cycles(_graph(typing=False))
