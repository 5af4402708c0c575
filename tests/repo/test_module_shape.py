"""The engine's and the format layer's modules stay small and keep their private names to themselves: none is over
500 lines (one idea each), and none takes a name starting with ``_`` from another moeckpt module, by
``from x import _y`` or through a module it imported (``x._y``). A name another module needs is public where it
lives. ``formats/dcp`` is left out: its modules are being restructured on their own."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: folder -> the import name it installs as (pyproject.toml's package-dir)
FOLDERS = {"formats": "moeckpt.formats", "reshard": "moeckpt.reshard", "library": "moeckpt.library"}
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    found = {}
    for folder, name in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder)
            if folder == "formats" and rel.parts[0] == "dcp":
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


def _source_of(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _private_uses(module: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _source_of(module, path, node)
            if not src.startswith("moeckpt"):
                continue
            for a in node.names:
                if a.name.startswith("_") and src != module:
                    found.append(f"{_where(path)}:{node.lineno}: from {src} import {a.name}")
                aliases[a.asname or a.name] = f"{src}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("moeckpt"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            found.append(f"{_where(path)}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_engine_or_format_module_is_over_500_lines():
    modules = _modules()
    assert len(modules) > 40  # the walk found the tree
    long = {str(p.relative_to(ROOT)): n for p in modules.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_module_takes_another_modules_private_names():
    uses = [use for module, path in _modules().items() for use in _private_uses(module, path)]
    assert uses == []


def test_a_private_name_taken_from_another_module_is_found(tmp_path):
    """The walk sees both spellings (so the test above can fail)."""
    path = tmp_path / "probe.py"
    path.write_text("from .load import _hidden\nfrom moeckpt.reshard import executor\nexecutor._convert()\n")
    uses = _private_uses("moeckpt.reshard.probe", path)
    assert [u.split(": ", 1)[1] for u in uses] == [
        "from moeckpt.reshard.load import _hidden",
        "moeckpt.reshard.executor._convert",
    ]
