"""Fetch the widget JavaScript the site serves itself, pinned and checksum-verified.

RequireJS and ``@jupyter-widgets/html-manager``'s ``embed-amd.js`` (with the icon fonts it
loads beside itself) come from the npm registry as the tarballs ``npm pack`` would fetch;
each tarball's sha512 must equal the registry's published ``dist.integrity`` pinned below,
or nothing is written. The files land in ``site/_vendor/`` (not committed), which the
Sphinx build serves as static files, so the site's widgets need no CDN.

    python site/vendor.py          # fetch once; re-runs are no-ops while the stamp matches
"""

from __future__ import annotations

import base64
import hashlib
import io
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "_vendor"
REGISTRY = "https://registry.npmjs.org"
# (package, version, sha512 integrity as `npm view PKG@VERSION dist.integrity` prints it,
#  {path inside the tarball's package/ folder: path under _vendor/}, suffixes of files
#  kept from the tarball's dist/ folder beside them).
PACKAGES = [
    ("requirejs", "2.3.8",
     "sha512-7/cTSLOdYkNBNJcDMWf+luFvMriVm7eYxp4BcFCsAX0wF421Vyce5SXP17c+Jd5otXKGNehIonFlyQXSowL6Mw==",
     {"require.js": "require.js"}, ()),
    ("@jupyter-widgets/html-manager", "1.0.15",
     "sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA==",
     {"dist/embed-amd.js": "html-manager/embed-amd.js"}, (".woff2", ".woff", ".ttf")),
]
STAMP = OUT / ".vendored"


def tarball_url(name: str, version: str) -> str:
    return f"{REGISTRY}/{name}/-/{name.split('/')[-1]}-{version}.tgz"


def verified(data: bytes, integrity: str) -> bool:
    algo, _, digest = integrity.partition("-")
    return base64.b64encode(hashlib.new(algo, data).digest()).decode() == digest


def stamp_text() -> str:
    return "".join(f"{name}@{version} {integrity}\n" for name, version, integrity, *_ in PACKAGES)


def main() -> int:
    if STAMP.exists() and STAMP.read_text() == stamp_text():
        return 0
    staged: dict[str, bytes] = {}
    for name, version, integrity, files, kept in PACKAGES:
        url = tarball_url(name, version)
        with urllib.request.urlopen(url, timeout=120) as response:
            data = response.read()
        if not verified(data, integrity):
            print(f"vendor: {url} does not match its pinned checksum {integrity}",
                  file=sys.stderr)
            return 1
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            members = {m.name.removeprefix("package/"): m for m in tar.getmembers() if m.isfile()}
            for src, dst in files.items():
                staged[dst] = tar.extractfile(members[src]).read()
                folder = src.rpartition("/")[0]
                for path, member in members.items():
                    if path.rpartition("/")[0] == folder and path.endswith(kept):
                        staged[f"{dst.rpartition('/')[0]}/{path.rpartition('/')[2]}"] = (
                            tar.extractfile(member).read())
        print(f"vendor: {name}@{version} verified ({integrity[:20]}...)")
    shutil.rmtree(OUT, ignore_errors=True)
    for dst, data in staged.items():
        (OUT / dst).parent.mkdir(parents=True, exist_ok=True)
        (OUT / dst).write_bytes(data)
    STAMP.write_text(stamp_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
