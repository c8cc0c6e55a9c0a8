#!/usr/bin/env bash
# tpurun on one NVIDIA GPU, once: the quickstart, the NAIC-like config and a LoRA fine-tune of a
# 2B-parameter Gemma-architecture model with random weights, each bounded in time (8 minutes in
# all), then a table of examples/s, tokens/s, TFLOP/s per device and MFU (docs/benchmarks.md,
# "On a GPU").
#
#   benchmarks/gpu_check.sh fetch   on a machine with network: the wheels the GPU machine lacks,
#                                   for CPython 3.12 on x86-64 Linux, into benchmarks/wheels/
#   benchmarks/gpu_check.sh         on the GPU machine (no network needed): installs the missing
#                                   ones from benchmarks/wheels/, then runs the three
#
# The GPU machine brings Python and JAX with CUDA; what it lacks of tpurun's needs (Keras,
# KerasHub, pydantic, google-crc32c, tensorboardX...) is installed from the carried wheels into
# a folder put on PYTHONPATH: a venv would not see the image's own packages where its python is
# itself a venv's. Only the distributions the interpreter does not have are installed; tpurun
# itself is installed from this checkout (from the carried wheel where setuptools is missing).
#
# Settings (environment):
#   PYTHON                   the interpreter that holds JAX (default python3)
#   GPU_CHECK_SCALE          full (default), or tiny: the same steps at toy sizes, a CPU rehearsal
#   GPU_CHECK_WHEELS         the wheels folder (default benchmarks/wheels)
#   GPU_CHECK_WORK           where runs and logs go (default /tmp/tpurun-gpu-check, emptied first)
#   GPU_CHECK_SECONDS        the whole check's bound (default 480)
#   GPU_CHECK_PEAK_TFLOPS    one device's peak for MFU (default 989: H100 SXM dense bfloat16)
#   GPU_CHECK_GEMMA_LAYERS, _SEQUENCE, _BATCH, _STEPS   a smaller Gemma run, if the full one fails
#   OUT                      if set: gpu_check.json and gpu_check.log are written there
#   WHEEL_PYTHON             fetch: the Python version the wheels are for (default 3.12)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$ROOT/benchmarks/gpu_check.sh"
HELPER="$ROOT/benchmarks/gpu_check.py"
PYTHON=${PYTHON:-python3}
[[ $PYTHON == */* ]] && PYTHON=$(realpath -s "$PYTHON") # a venv's python: its link, kept
SCALE=${GPU_CHECK_SCALE:-full}
WHEELS=$(realpath -m "${GPU_CHECK_WHEELS:-$ROOT/benchmarks/wheels}")
WORK=$(realpath -m "${GPU_CHECK_WORK:-/tmp/tpurun-gpu-check}")
BUDGET=${GPU_CHECK_SECONDS:-480}
PEAK=${GPU_CHECK_PEAK_TFLOPS:-989}
MAX_WHEELS_MIB=64

# What the GPU machine lacks (keras-hub without its tensorflow-text and kagglehub: token ids need
# neither, and KerasHub imports without them). Pinned to the versions the tests run.
MISSING_THERE=(
    keras==3.15.1 namex==0.1.0 optree==0.20.0 keras-hub==0.32.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    google-crc32c==1.9.0 tensorboardX==2.6.5
)
# Present there, carried for an image that lacks them (each installed only where missing).
PRESENT_THERE=(
    absl-py==2.5.1 h5py==3.16.0 ml-dtypes==0.6.0 packaging==26.4 typing-extensions==4.16.0
    protobuf==7.36.2 pillow==13.0.0 fsspec==2026.9.0 pyyaml==6.0.4
    rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
    typer==0.29.2 click==8.5.1 shellingham==1.5.4
    sentencepiece==0.2.3 tokenizers==0.23.3 regex==2026.11.19
)

fetch() {
    local py=${WHEEL_PYTHON:-3.12} platforms=() n
    for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    mkdir -p "$WHEELS"
    rm -f "$WHEELS"/*.whl
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
        --implementation cp "${platforms[@]}" -d "$WHEELS" "${MISSING_THERE[@]}" "${PRESENT_THERE[@]}"
    "$PYTHON" -m pip wheel --quiet --no-deps -w "$WHEELS" "$ROOT"
    ls -l "$WHEELS"/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}'
    local bytes
    bytes=$(du -cb "$WHEELS"/*.whl | tail -1 | cut -f1)
    printf '%d wheels, %.1f MiB in all (at most %d), for CPython %s\n' \
        "$(ls "$WHEELS"/*.whl | wc -l)" "$(echo "$bytes / 1048576" | bc -l)" "$MAX_WHEELS_MIB" "$py"
    if ((bytes > MAX_WHEELS_MIB * 1048576)); then
        echo "error: the wheels take more than $MAX_WHEELS_MIB MiB: carry fewer" >&2
        return 1
    fi
}

# One step, bounded by what is left of the budget (and its own cap); its output goes to the
# console and to WORK/NAME.log, its exit code and seconds to WORK/steps.tsv.
step() {
    local name=$1 cap=$2
    shift 2
    local left=$((DEADLINE - SECONDS)) code=0 started=$SECONDS
    local bound=$((cap < left ? cap : left))
    if ((bound < 10)); then
        echo "== $name: not run, the ${BUDGET}s budget is spent"
        printf '%s\t%d\t%d\t%d\n' "$name" 124 0 0 >>"$WORK/steps.tsv"
        return
    fi
    echo "== $name (at most ${bound}s): $*"
    timeout --kill-after=20 "$bound" "$@" 2>&1 | tee "$WORK/$name.log" || code=${PIPESTATUS[0]}
    printf '%s\t%d\t%d\t%d\n' "$name" "$code" $((SECONDS - started)) "$bound" >>"$WORK/steps.tsv"
    ((code == 0)) || echo "== $name: exit $code$( ((code == 124)) && echo ' (out of time)')"
    return 0
}

install() {
    local site="$WORK/site" names
    mkdir -p "$site"
    names=$("$PYTHON" "$HELPER" missing "$WHEELS")
    echo "installing from $WHEELS: ${names//$'\n'/ }"
    if [[ -n $names ]]; then
        # shellcheck disable=SC2086  # one name a word
        "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
            --find-links "$WHEELS" --target "$site" $names
    fi
    if ! "$PYTHON" -m pip install --quiet --no-index --no-deps --no-build-isolation --no-compile \
        --disable-pip-version-check --target "$site" "$ROOT" 2>"$WORK/tpurun-build.log"; then
        echo "tpurun: not built from the checkout here (see $WORK/tpurun-build.log): installing" \
            "$(basename "$WHEELS"/tpurun-*.whl), built by fetch"
        "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
            --find-links "$WHEELS" --target "$site" tpurun
    fi
}

prepare() {
    ((BUDGET > 0)) || { echo "error: GPU_CHECK_SECONDS must be positive" >&2; return 2; }
    [[ $SCALE == full || $SCALE == tiny ]] || {
        echo "error: GPU_CHECK_SCALE must be full or tiny, not '$SCALE'" >&2
        return 2
    }
    compgen -G "$WHEELS/*.whl" >/dev/null || {
        echo "error: no wheels in $WHEELS: run '$0 fetch' on a machine with network first" >&2
        return 2
    }
    rm -rf "$WORK"
    mkdir -p "$WORK"
    if [[ -n ${OUT:-} ]]; then mkdir -p "$OUT"; fi
}

run_all() {
    DEADLINE=$((SECONDS + BUDGET))
    echo "tpurun GPU check, scale $SCALE, at most ${BUDGET}s, python: $PYTHON, work: $WORK"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null ||
        echo "nvidia-smi: none here"
    step install 120 bash "$SELF" install
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    export TPURUN_CACHE_DIR="$WORK/cache" TPURUN_PLAIN=1
    cd "$WORK" # not the checkout: the installed tpurun runs
    step environment 60 "$PYTHON" "$HELPER" environment "$WORK"

    local tpurun=("$PYTHON" -m tpurun train --plain --output "$WORK/runs"
        --set "runtime.peak_tflops=$PEAK")
    local quick=() naic_size=(--train 8192 --validation 1024) naic=()
    if [[ $SCALE == tiny ]]; then
        quick=(--set train.epochs=2)
        naic_size=(--train 1024 --validation 256)
        naic=(--set train.epochs=2)
    fi
    step quickstart 100 "${tpurun[@]}" "$ROOT/configs/quickstart.yaml" --set name=quickstart "${quick[@]}"
    step naic_data 30 "$PYTHON" "$ROOT/configs/data/make_naic_like.py" "${naic_size[@]}" --out "$WORK/naic"
    step naic_like 100 "${tpurun[@]}" "$ROOT/configs/naic_like.yaml" --set name=naic_like \
        --set "data.train=$WORK/naic/naic-train-*.tfrecord" \
        --set "data.validation=$WORK/naic/naic-validation-*.tfrecord" "${naic[@]}"
    step gemma_inputs 120 "$PYTHON" "$HELPER" gemma "$WORK" "$SCALE" "$PEAK"
    step gemma_lora 240 "${tpurun[@]}" "$WORK/gemma/gemma_lora.yaml"
    printf '%s\t%d\t%d\t%d\n' total 0 "$SECONDS" "$BUDGET" >>"$WORK/steps.tsv"
    GPU_CHECK_SCALE=$SCALE "$PYTHON" "$HELPER" report "$WORK" "${OUT:-}"
}

case ${1:-run} in
fetch) fetch ;;
install) install ;; # a step of run, in a process of its own (bounded by timeout)
run)
    prepare
    run_all 2>&1 | tee "${OUT:-$WORK}/gpu_check.log"
    exit "${PIPESTATUS[0]}"
    ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
