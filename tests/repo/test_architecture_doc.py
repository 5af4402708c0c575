"""docs/architecture.md describes the layout: every module of every package is named in its tables or text, so a
newcomer finds each module's one idea there (and a module added without a word in the doc fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("toplevel", "formats", "reshard", "library", "trainer", "cli", "testing")


def _modules() -> list[str]:
    """Every module, as its path below its folder (``backends/zarr.py``), package ``__init__`` files left out
    where the folder's own section describes them."""
    out = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "__init__.py" and path.parent != ROOT / folder:
                continue  # a sub-package: its folder is named (``dcp/``, ``models/zaya/``)
            if path.name == "__init__.py":
                continue
            out.append(f"{folder}/{path.relative_to(ROOT / folder).as_posix()}")
    return out


def _named(doc: str, module: str) -> bool:
    folder, rel = module.split("/", 1)
    name = rel.rsplit("/", 1)[-1]
    parent = rel.rsplit("/", 1)[0] + "/" if "/" in rel else ""
    candidates = {f"`{rel}`", f"`{module}`", f"`{name}`"}
    if parent:
        candidates.add(f"`{parent}`")  # a sub-package described as a whole (``dcp/``, ``interop/``, ``models/``)
        candidates.add(f"`{folder}/{parent}`")
    return any(c in doc for c in candidates) or re.search(rf"`{re.escape(name)}`, ", doc) is not None


def test_every_module_is_named_in_the_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [m for m in _modules() if not _named(doc, m)]
    assert not missing, "modules docs/architecture.md does not name: " + ", ".join(missing)
