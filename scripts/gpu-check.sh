#!/usr/bin/env bash
# The GPU check, in two halves:
#
#   scripts/gpu-check.sh build   on the CPU machine: builds the test binaries that
#                                run on CUDA and copies them, stripped, to .device/bin
#                                (ignored by git; carry `.device` to the GPU machine)
#   scripts/gpu-check.sh run     on the GPU machine: runs them (nothing is built
#                                there) and writes logs under $OUT (or ./gpu-out)
#
# `run` finds the CUDA libraries (driver, NVRTC, cuBLAS) where the GPU machine keeps
# them, prints the card, runs the op suite on every available device with the CUDA
# cases compared against the reference evaluator, then the rlx-cuda unit tests, and
# ends with a summary table (passed/failed test counts, CUDA cases skipped for want
# of a kernel).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
bin=.device/bin
case "$mode" in
build)
    set -e
    mkdir -p "$bin"
    cargo test -p rlx --test ops --test quant_ops --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"]
        if m["target"]["kind"] == ["lib"]:
            name = "unit-" + name
        shutil.copy(m["executable"], sys.argv[1] + "/" + name)
        print(name)
' "$bin"
    cargo test -p rlx-cuda --lib --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        shutil.copy(m["executable"], sys.argv[1] + "/unit-rlx_cuda")
        print("unit-rlx_cuda")
' "$bin"
    strip "$bin"/* 2>/dev/null || true
    du -sh "$bin"
    ;;
run)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    # CUDA libraries: the toolkit's, then those of the Python CUDA wheels.
    libs=""
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
        [ -d "$d" ] && libs="$libs:$d"
    done
    for f in $(find / -xdev \( -name 'libnvrtc.so*' -o -name 'libcublas.so*' \) 2>/dev/null | head -20); do
        libs="$libs:$(dirname "$f")"
    done
    export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # The PTX cache stays off $OUT (thousands of files do not travel back).
    export RLX_CACHE=/tmp/rlx-gpu-check-cache
    {
        echo "== card"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    } 2>&1 | tee "$out/gpu-check.log"
    summary=""
    for t in "$bin"/*; do
        name=$(basename "$t")
        echo "== $name" | tee -a "$out/gpu-check.log"
        "$t" --test-threads=1 --nocapture >"$out/$name.log" 2>&1
        rc=$?
        result=$(grep -E '^test result' "$out/$name.log" | tail -1)
        skips=$(grep -c '^SKIP .* on cuda' "$out/$name.log")
        tail -5 "$out/$name.log" | tee -a "$out/gpu-check.log"
        summary="$summary\n$name: exit $rc; $result; CUDA cases skipped: $skips"
    done
    # A second run of the op suite must compile nothing (the PTX cache is warm).
    if [ -x "$bin/ops" ]; then
        before=$(ls "$RLX_CACHE/cuda" 2>/dev/null | wc -l)
        "$bin/ops" --test-threads=1 --nocapture >"$out/ops-second.log" 2>&1
        after=$(ls "$RLX_CACHE/cuda" 2>/dev/null | wc -l)
        summary="$summary\nops, second start: PTX files in the cache $before -> $after"
    fi
    grep -h '^SKIP .* on cuda' "$out/ops.log" | sed 's/.*: //' | sort | uniq -c | sort -rn >"$out/skipped-ops.txt"
    echo "== summary" | tee -a "$out/gpu-check.log"
    printf "$summary\n" | tee -a "$out/gpu-check.log"
    echo "skipped, by reason (top 15):" | tee -a "$out/gpu-check.log"
    head -15 "$out/skipped-ops.txt" | tee -a "$out/gpu-check.log"
    grep -h -A3 'panicked' "$out"/ops.log 2>/dev/null | cut -c1-600 | head -80 | tee -a "$out/gpu-check.log"
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
