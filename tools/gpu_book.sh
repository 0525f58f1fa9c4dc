#!/usr/bin/env bash
# The whole book on a lent GPU machine without network, in one prepared run, one log.
#
#   tools/gpu_prep.sh            # here, with network: wheels, graphviz debs, the GGUF in 2 parts
#   tools/gpu_book.sh stage      # on the device, calls 1 and 2: keep what was carried in /tmp
#   tools/gpu_book.sh run        # on the device, call 3: install, check, execute, log
#
# What `run` does, each step timed in $OUT/gpu_book.log (the summary comes last):
#   1. the wheels in .whl/ installed offline (--no-index --no-deps --target /tmp/site);
#   2. Graphviz's dot: the machine's own, else the carried .debs unpacked under /tmp/gv
#      (never into /) behind a wrapper that sets their library path for dot alone;
#   3. the GGUF put back together from its parts, checksum checked, converted by
#      `python -m minirt.model fetch` into $MINIRT_CACHE (no network needed once it is there);
#   4. tools/gpu_check.py --skip-real (tiny model, host-tier copy bandwidth: no weights),
#      then --load-back-only (load-back vs recompute on the real model, fp32 and bf16);
#   5. tests/test_tiers.py on the device (its CUDA-only copy test included);
#   6. every chapter and solution with nbval-lax on the device: every assert runs, stored
#      outputs are not compared (GPU numbers differ from the stored CPU ones);
#   7. the rest of tools/gpu_check.py (the real model's equalities, routing, the burst), if
#      the time budget leaves room.
# Each step gets what is left of GPU_BOOK_BUDGET seconds (default 420), so the run ends in
# time to leave the device call room for its transfers, and the log is complete even when
# a step is cut short.
#
# A rehearsal on a CPU machine runs the same steps (see `make gpu-book-cpu`):
#   GPU_BOOK_DEVICE=cpu GPU_BOOK_INSTALL=0 GPU_BOOK_NOTEBOOKS="chapters/00_introduction.ipynb" \
#       tools/gpu_book.sh run
# Settings: OUT (log folder; the device tool sets it), GPU_BOOK_PYTHON (python3),
# GPU_BOOK_DEVICE (cuda), GPU_BOOK_INSTALL (1: install .whl/), GPU_BOOK_NOTEBOOKS (all),
# GPU_BOOK_WORKERS (6 notebooks at a time with pytest-xdist, if the machine has it),
# GPU_BOOK_STASH (/tmp/minirt-gpu), MINIRT_CACHE (/tmp/minirt-cache), GPU_BOOK_SKIP (a regex
# of step names to skip).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=${1:-run}
OUT=${OUT:-$ROOT/gpu_book_out}
STASH=${GPU_BOOK_STASH:-/tmp/minirt-gpu}
PY=${GPU_BOOK_PYTHON:-python3}
DEVICE=${GPU_BOOK_DEVICE:-cuda}
BUDGET=${GPU_BOOK_BUDGET:-420}
WORKERS=${GPU_BOOK_WORKERS:-6}
export MINIRT_CACHE=${MINIRT_CACHE:-/tmp/minirt-cache}
export MINIRT_DEVICE=$DEVICE TQDM_DISABLE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$STASH"
LOG=$OUT/gpu_book.log
SUMMARY=()

say() { echo "[gpu_book +${SECONDS}s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - SECONDS)); }

# step NAME MIN_SECONDS COMMAND...: run with what is left of the budget, log its output,
# record "NAME: ok|FAILED rc|TIMED OUT|SKIPPED, seconds" for the summary.
step() {
    local name=$1 need=$2; shift 2
    local t0=$SECONDS rest; rest=$(left)
    if [ -n "${GPU_BOOK_SKIP:-}" ] && [[ $name =~ $GPU_BOOK_SKIP ]]; then
        SUMMARY+=("$name: SKIPPED (GPU_BOOK_SKIP)")
        say "== $name: skipped (GPU_BOOK_SKIP)"
        return 0
    fi
    if [ "$rest" -lt "$need" ]; then
        SUMMARY+=("$name: SKIPPED (${rest} s of the budget left, needs ${need})")
        say "== $name: skipped, ${rest} s left"
        return 0
    fi
    say "== $name (at most ${rest} s)"
    timeout --kill-after=10 "$rest" bash -c '"$@"' _ "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]} verdict
    case $rc in
        0) verdict=ok ;;
        124|137) verdict="TIMED OUT" ;;
        *) verdict="FAILED rc $rc" ;;
    esac
    SUMMARY+=("$name: $verdict, $((SECONDS - t0)) s")
    return 0
}

stage() {  # keep what this call carried (the GGUF's parts, the debs) where later calls find it
    for d in .gpu/a .gpu/b .gl; do
        [ -d "$d" ] && cp -f "$d"/* "$STASH"/ 2>/dev/null
    done
    say "stash $STASH: $(ls "$STASH" | tr '\n' ' ')"
}

install_wheels() {
    local n; n=$(ls .whl/*.whl 2>/dev/null | wc -l)
    [ "$n" -gt 0 ] || { echo "no wheels in .whl/: carry .whl (tools/gpu_prep.sh makes it)"; return 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return 1
    echo "installed $n wheels into /tmp/site"
}

setup_dot() {
    if command -v dot > /dev/null; then
        echo "dot: the machine's own, $(dot -V 2>&1)"
        return 0
    fi
    ls "$STASH"/*.deb > /dev/null 2>&1 || { echo "no dot and no carried .debs"; return 1; }
    rm -rf /tmp/gv && mkdir -p /tmp/gv/bin
    for f in "$STASH"/*.deb; do dpkg-deb -x "$f" /tmp/gv || return 1; done
    local lib=/tmp/gv/usr/lib/x86_64-linux-gnu
    cat > /tmp/gv/bin/dot <<EOF
#!/bin/sh
LD_LIBRARY_PATH=$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} GVBINDIR=$lib/graphviz exec /tmp/gv/usr/bin/dot "\$@"
EOF
    chmod +x /tmp/gv/bin/dot
    /tmp/gv/bin/dot -c 2> /dev/null  # the plugin list; those needing cairo/pango are skipped
    echo 'digraph { a -> b }' | /tmp/gv/bin/dot -Tsvg | grep -q '<svg' || return 1
    echo "dot: carried, $(/tmp/gv/bin/dot -V 2>&1)"
}

model() {
    local dir=$MINIRT_CACHE/gguf name=SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p "$dir"
    if [ ! -f "$dir/$name" ]; then
        [ -f "$STASH/model.gguf.part-a" ] && [ -f "$STASH/model.gguf.part-b" ] || {
            echo "the GGUF's parts are not both in $STASH ($(ls "$STASH" | tr '\n' ' ')):"
            echo "calls 1 and 2 (stage) must come first, on the same warm machine"
            return 1
        }
        cat "$STASH/model.gguf.part-a" "$STASH/model.gguf.part-b" > "$dir/$name"
    fi
    local want; want=$(cat "$STASH/model.gguf.sha256" 2>/dev/null)
    [ "$(sha256sum "$dir/$name" | cut -d' ' -f1)" = "$want" ] || {
        echo "GGUF checksum differs from $want"; rm -f "$dir/$name"; return 1; }
    "$PY" -m minirt.model fetch
}

versions() {
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$PY" - <<'EOF'
import sys
import torch, transformers
print(f"python {sys.version.split()[0]}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"transformers {transformers.__version__} from {transformers.__file__}")
if torch.cuda.is_available():
    print(f"device {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
EOF
    "$PY" -m pip check 2>&1 | head -20 || true
}

notebooks() {
    local nbs par=()
    if [ -n "${GPU_BOOK_NOTEBOOKS:-}" ]; then
        read -r -a nbs <<< "$GPU_BOOK_NOTEBOOKS"
    else
        nbs=(chapters/*.ipynb solutions/*.ipynb)
    fi
    if [ "$WORKERS" -gt 1 ] && "$PY" -c "import xdist" 2> /dev/null; then
        par=(-n "$WORKERS" --dist loadfile)
        export OMP_NUM_THREADS=$(( $(nproc) / WORKERS > 0 ? $(nproc) / WORKERS : 1 ))
    fi
    echo "${#nbs[@]} notebooks, ${par[*]:-one at a time}"
    "$PY" -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env \
        --nbval-cell-timeout=600 "${par[@]}" --junitxml="$OUT/notebooks.xml" "${nbs[@]}"
}

notebook_table() {  # one line per notebook from the junit file: cells passed / failed
    "$PY" - "$OUT/notebooks.xml" <<'EOF'
import collections, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    sys.exit(f"no notebook results ({e})")
cells = collections.defaultdict(lambda: [0, 0, 0])
for case in root.iter("testcase"):
    nb = case.get("classname", "?").replace(".", "/").removesuffix("/ipynb") + ".ipynb"
    nb = case.get("file") or nb
    bad = case.find("failure") is not None or case.find("error") is not None
    skip = case.find("skipped") is not None
    cells[nb][1 if bad else 2 if skip else 0] += 1
for nb, (ok, bad, skip) in sorted(cells.items()):
    print(f"  {'ok    ' if not bad else 'FAILED'} {nb}: {ok} cells passed, {bad} failed, {skip} skipped")
print(f"  {sum(not v[1] for v in cells.values())}/{len(cells)} notebooks passed")
EOF
}

export ROOT STASH PY OUT WORKERS LOG
export -f install_wheels setup_dot model versions notebooks

case $MODE in
    stage)
        stage
        exit 0
        ;;
    run) ;;
    *) echo "usage: tools/gpu_book.sh stage|run" >&2; exit 2 ;;
esac

: > "$LOG"
say "minirt gpu_book on $(hostname), device $DEVICE, budget ${BUDGET} s, $(nproc) cores"
stage
if [ "${GPU_BOOK_INSTALL:-1}" = 1 ]; then
    step "install wheels" 5 install_wheels
    export PYTHONPATH=/tmp/site:$ROOT
else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
step "graphviz dot" 5 setup_dot
[ -x /tmp/gv/bin/dot ] && export PATH=/tmp/gv/bin:$PATH
step versions 5 versions
step "model (GGUF -> safetensors)" 30 model
step "gpu_check: tiny model, host-tier copies" 30 "$PY" tools/gpu_check.py --skip-real
step "gpu_check: load-back vs recompute" 30 "$PY" tools/gpu_check.py --load-back-only
step "tests/test_tiers.py" 30 "$PY" -m pytest -q -p no:cacheprovider tests/test_tiers.py
step "notebooks (nbval-lax)" 60 notebooks
step "gpu_check: real model" 60 "$PY" tools/gpu_check.py --real-only
{
    echo
    echo "== summary ($SECONDS s in all, budget $BUDGET s)"
    printf '  %s\n' "${SUMMARY[@]}"
    echo "== notebooks"
    notebook_table
} 2>&1 | tee -a "$LOG"
