"""Copy the checkout's files (tracked, and untracked ones git does not ignore) to a new directory, as a fresh
clone would hold them: no virtual environment, no build outputs, no caches. ``python3 .ci/fresh_copy.py DEST``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def fresh_copy(dest: Path) -> None:
    if dest.exists():
        raise SystemExit(f"fresh_copy: {dest} exists already")
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout
    for name in filter(None, listing.decode().split("\0")):
        src = ROOT / name
        if not src.exists():  # deleted in the work tree, not yet in a commit
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)
    # git metadata too: the copy is a checkout (tools that ask git for the root or the version work in it)
    subprocess.run(["git", "init", "-q", str(dest)], check=True)


if __name__ == "__main__":
    fresh_copy(Path(sys.argv[1]))
