"""Give every book notebook the kernelspec and language_info exactly as ipykernel writes them.

Without a stored kernelspec JupyterLab warns "No exact match found for python3"; with one
that differs from ipykernel's (``display_name`` "Python 3" rather than "Python 3
(ipykernel)") it rewrites it on open, so an unchanged notebook saves as changed. Only
notebook-level metadata is touched (jupytext's authoring leftovers are dropped too);
cells and outputs stay byte for byte. Re-runnable.

    python tools/nb_kernelspec.py            # fix chapters/, exercises/, solutions/
    python tools/nb_kernelspec.py --check    # exit 1 if any notebook needs fixing
    python tools/nb_kernelspec.py NB.ipynb   # only these notebooks
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import nbformat

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("chapters", "exercises", "solutions")
# What `python -m ipykernel install` writes into kernel.json, and JupyterLab copies on save.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
}


def book_notebooks(root: Path = ROOT) -> list[Path]:
    """Every notebook of the book, folder by folder, in name order."""
    return [p for folder in FOLDERS for p in sorted((root / folder).glob("*.ipynb"))]


def normalized(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` with the book's kernelspec and language_info (a kernel's version kept)."""
    out = {k: v for k, v in metadata.items() if k != "jupytext"}
    out["kernelspec"] = dict(KERNELSPEC)
    info = dict(LANGUAGE_INFO)
    version = metadata.get("language_info", {}).get("version")
    if version:
        info["version"] = version
    out["language_info"] = info
    return out


def fix(path: Path, check: bool = False) -> bool:
    """Normalise one notebook's metadata; True if it was (or, with ``check``, would be) changed."""
    nb = nbformat.read(path, as_version=4)
    wanted = normalized(dict(nb.metadata))
    if wanted == nb.metadata:
        return False
    if not check:
        nb.metadata = nbformat.from_dict(wanted)
        path.write_text(nbformat.writes(nb) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="notebooks (default: the book's)")
    parser.add_argument("--check", action="store_true", help="fail if a notebook needs fixing")
    args = parser.parse_args(argv)
    paths = args.paths or book_notebooks()
    changed = [p for p in paths if fix(p, check=args.check)]
    if args.check:
        for p in changed:
            print(f"{p}: kernelspec/language_info differ; run tools/nb_kernelspec.py")
        return 1 if changed else 0
    print(f"set kernelspec python3 in {len(changed)} of {len(paths)} notebooks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
