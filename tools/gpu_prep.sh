#!/usr/bin/env bash
# Download, here (with network), what tools/gpu_book.sh carries to a GPU machine without
# network, into folders git ignores, and print what each device call carries:
#
#   .whl/     wheels of tools/gpu_wheels.txt for CPython 3.12, manylinux x86_64 (no deps)
#   .gl/      Debian's graphviz .debs (dot and the libraries it loads; unpacked to /tmp there)
#   .gpu/a/   the default model's GGUF, first part   (the GGUF alone is over the 64 MiB limit
#   .gpu/b/   the default model's GGUF, second part   of one call, so it travels in two)
#
#   tools/gpu_prep.sh        # or: make gpu-prep
#
# The GGUF comes from the model cache (`make model` fills it). Safe to rerun: each folder is
# rebuilt from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))
PART_A=$((50 * 1024 * 1024))   # first part: what the tracked tree (about 6 MiB) leaves of 64 MiB, with room to grow

rm -rf .whl .gl .gpu
mkdir -p .whl .gl .gpu/a .gpu/b
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" \
    -d .whl -r tools/gpu_wheels.txt
expected=$(grep -c '==' tools/gpu_wheels.txt)
got=$(find .whl -type f -name '*.whl' | wc -l)
[ "$got" -eq "$expected" ] || { echo "gpu_prep: $got wheels for $expected pins" >&2; exit 1; }

# dot -Tsvg needs only these (its core and dot-layout plugins); the others fail to load
# without cairo/pango and dot skips them. apt-get download needs no root.
(cd .gl && apt-get download -q graphviz libgvc6 libcgraph6 libcdt5 libpathplan4 libxdot4 \
    libltdl7 > /dev/null 2>&1)

gguf=$("$PY" -c "import minirt.model as m; print(m.cache_dir() / 'gguf' / m.GGUF_MEMBER.rsplit('/', 1)[1])")
sha=$("$PY" -c "import minirt.model as m; print(m.GGUF_SHA256)")
[ -f "$gguf" ] || { echo "gpu_prep: $gguf missing: run make model first" >&2; exit 1; }
[ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$sha" ] || { echo "gpu_prep: bad checksum $gguf" >&2; exit 1; }
head -c "$PART_A" "$gguf" > .gpu/a/model.gguf.part-a
tail -c +"$((PART_A + 1))" "$gguf" > .gpu/b/model.gguf.part-b
echo "$sha" > .gpu/b/model.gguf.sha256

tree=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
size() { du -cb "$@" | tail -1 | cut -f1; }
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
status=0
report() {  # call name, paths...
    local name=$1; shift
    local s; s=$(size "$@")
    local total=$((s + tree))
    echo "  $name: carry $* = $(mib "$s"); with the tracked tree ($(mib "$tree")) $(mib "$total")"
    [ "$total" -lt "$LIMIT" ] || { echo "    OVER the 64 MiB limit" >&2; status=1; }
}
echo "gpu_prep: $got wheels, $(find .gl -type f -name '*.deb' | wc -l) debs, GGUF in 2 parts"
report "call 1 (stage)" .gpu/a
report "call 2 (stage)" .gpu/b .gl
report "call 3 (run)  " .whl
exit $status
