"""A built wheel holds every module and data file of the package: ``python3 .ci/check_wheel.py WHEEL SRC``.

pyproject.toml lists the packages and maps each to a source folder (``moeckpt.trainer`` = ``trainer``); a new
subpackage missing from that list is left out of the wheel, and an editable install (the README's) does not show
it. Every ``.py`` file under the mapped folders, and every file matching a ``package-data`` pattern, must be in the
wheel under its package's path. Exit 1 naming each file missing.
"""

from __future__ import annotations

import sys
import tomllib
import zipfile
from fnmatch import fnmatch
from pathlib import Path


def expected_files(src: Path) -> set[str]:
    """The paths in a wheel of the package at ``src`` (``moeckpt/trainer/train.py``)."""
    setup = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders: dict[str, str] = setup["package-dir"]
    data: dict[str, list[str]] = setup.get("package-data", {})
    wanted: set[str] = set()
    for package, folder in folders.items():
        inner = [src / f for f in folders.values() if f != folder and Path(f).is_relative_to(folder)]
        for path in (src / folder).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts or any(d in path.parents for d in inner):
                continue  # a file under a more specific mapping is counted there
            rel = path.relative_to(src / folder).as_posix()
            if path.suffix == ".py" or any(fnmatch(rel, p) for p in data.get(package, [])):
                wanted.add(f"{package.replace('.', '/')}/{rel}")
    return wanted


def main(argv: list[str]) -> int:
    wheel, src = Path(argv[0]), Path(argv[1])
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = expected_files(src)
    missing = sorted(wanted - names)
    for name in missing:
        print(f"check_wheel: {wheel.name} lacks {name} (pyproject.toml's packages or package-data?)", file=sys.stderr)
    if not missing:
        print(f"check_wheel: {wheel.name} holds all {len(wanted)} files of the package")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
