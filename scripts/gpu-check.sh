#!/usr/bin/env bash
# The GPU check, in parts:
#
#   scripts/gpu-check.sh build   on the CPU machine: builds the test binaries that
#                                run on CUDA and the rlx tool, and packs the ONNX node
#                                suite, all under .device (ignored by git; carry
#                                `.device` to the GPU machine)
#   scripts/gpu-check.sh run     on the GPU machine: the CUDA test suites (nothing is
#                                built there); logs under $OUT (or ./gpu-out)
#   scripts/gpu-check.sh models  on the GPU machine: PyTorch checkpoints made there
#                                compared with RLX (scripts/gpu_models.py), and the
#                                ONNX node suite on CUDA against the CPU's pass list
#   scripts/gpu-check.sh timing  on the GPU machine: the timing table (PyTorch eager,
#                                torch.compile, RLX; scripts/gpu_models.py --timing;
#                                `timing --bert-only` leaves out the decode row)
#   scripts/gpu-check.sh train   on the GPU machine: the training step on CUDA against
#                                PyTorch (bench/train_vs_torch.py): parity over the
#                                first 50 steps of the character GPT, then step times
#                                against PyTorch eager and torch.compile
#   scripts/gpu-check.sh ab A B  on the GPU machine: decode of two rlx builds (A, B:
#                                paths of rlx binaries carried in .device/tools)
#                                alternated over 4 rounds, making the ~1B checkpoint
#                                first when `timing` has not
#   scripts/gpu-check.sh bench   on the GPU machine: kernel benchmarks (matrix-vector
#                                and group variants; decode with and without
#                                programmatic launches and groups, making the ~1B
#                                checkpoint first when `timing` has not)
#
# `run` finds the CUDA libraries (driver, NVRTC, cuBLAS) where the GPU machine keeps
# them, prints the card, runs the op suites on every available device with the CUDA
# cases compared against the reference evaluator, then the rlx-cuda unit tests, and
# ends with a summary table (passed/failed test counts, CUDA cases skipped for want
# of a kernel). Each part fits one 10-minute call.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
bin=.device/bin

# Puts the CUDA libraries on LD_LIBRARY_PATH: the toolkit's, then those of the
# Python CUDA wheels.
cuda_libraries() {
    local libs="" d f
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
        [ -d "$d" ] && libs="$libs:$d"
    done
    for f in $(find / -xdev \( -name 'libnvrtc.so*' -o -name 'libcublas.so*' \) 2>/dev/null | head -20); do
        libs="$libs:$(dirname "$f")"
    done
    export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    # The PTX cache stays off $OUT (thousands of files do not travel back).
    export RLX_CACHE=/tmp/rlx-gpu-check-cache
}

# Builds the test binaries `cargo test ARGS` names and copies them into $bin: an
# integration test under its target's name, a library's unit tests as unit-NAME.
test_binaries() {
    cargo test "$@" --no-run --message-format=json 2>/dev/null |
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
}

# A Python with PyTorch: the first of these that imports it.
torch_python() {
    local p
    for p in python3 /opt/torch/.venv/bin/python python; do
        if "$p" -c 'import torch' 2>/dev/null; then
            echo "$p"
            return
        fi
    done
    echo python3
}
case "$mode" in
build)
    set -e
    mkdir -p "$bin"
    test_binaries -p rlx --test ops --test quant_ops --test fusion --test training
    # The embedder's half-precision compute on CUDA (and its CPU tests beside it).
    test_binaries -p rlx-models --test tiny_bert
    test_binaries -p rlx-cuda --lib
    strip "$bin"/* 2>/dev/null || true
    mkdir -p .device/tools
    cargo build --release -p rlx-cli
    cp target/release/rlx .device/tools/rlx
    strip .device/tools/rlx
    # The node suite, fetched by its test the way CI fetches it.
    suite=${RLX_CACHE:-$HOME/.cache/rlx}/models/onnx-backend-tests-1.22.0
    [ -d "$suite" ] || cargo test -p rlx-models --test onnx_backend_suite >/dev/null
    tar czf .device/node-tests.tgz -C "$suite" .
    du -sh .device/*
    ;;
run)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    cuda_libraries
    {
        echo "== card"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    } 2>&1 | tee "$out/gpu-check.log"
    summary=""
    # Tests run 4 at a time (several programs on one GPU from several threads is
    # also how an application uses it); a test that fails is run again alone, so a
    # failure that only shows under concurrency is told apart.
    for t in "$bin"/*; do
        name=$(basename "$t")
        echo "== $name" | tee -a "$out/gpu-check.log"
        "$t" --test-threads=4 --nocapture >"$out/$name.log" 2>&1
        rc=$?
        result=$(grep -E '^test result' "$out/$name.log" | tail -1)
        skips=$(grep -c '^SKIP .* on cuda' "$out/$name.log")
        tail -5 "$out/$name.log" | tee -a "$out/gpu-check.log"
        summary="$summary\n$name: exit $rc; $result; CUDA cases skipped: $skips"
        failed=$(grep -E '^test .* \.\.\. FAILED$' "$out/$name.log" | awk '{print $2}')
        for f in $failed; do
            "$t" --test-threads=1 --exact "$f" >"$out/$name-$f-alone.log" 2>&1
            summary="$summary\n  $f alone: exit $?"
        done
    done
    # A second start must compile nothing (the PTX cache is warm): a few tests again.
    if [ -x "$bin/ops" ]; then
        before=$(ls "$RLX_CACHE/cuda" 2>/dev/null | wc -l)
        "$bin/ops" --test-threads=4 elementwise reductions permute >"$out/ops-second.log" 2>&1
        after=$(ls "$RLX_CACHE/cuda" 2>/dev/null | wc -l)
        summary="$summary\nops, second start: PTX files in the cache $before -> $after"
    fi
    grep -h '^SKIP .* on cuda' "$out/ops.log" | sed 's/.*: //' | sort | uniq -c | sort -rn >"$out/skipped-ops.txt"
    echo "== summary" | tee -a "$out/gpu-check.log"
    printf "$summary\n" | tee -a "$out/gpu-check.log"
    echo "skipped, by reason (top 15):" | tee -a "$out/gpu-check.log"
    head -15 "$out/skipped-ops.txt" | tee -a "$out/gpu-check.log"
    # No panic found is not a failure of the check.
    { grep -h -A3 'panicked' "$out"/*.log 2>/dev/null || true; } | cut -c1-600 | head -80 | tee -a "$out/gpu-check.log"
    ;;
models)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    cuda_libraries
    py=$(torch_python)
    rlx=.device/tools/rlx
    echo "== models (PyTorch checkpoints made here, RLX on the same weights)" | tee "$out/models.log"
    "$py" scripts/gpu_models.py "$rlx" /tmp/rlx-gpu-models 2>&1 | tee -a "$out/models.log"
    # The node suite on CUDA, in 8 shards at once (NVRTC compiles on the CPU cores).
    suite=/tmp/rlx-node-tests
    mkdir -p "$suite"
    tar xzf .device/node-tests.tgz -C "$suite"
    ls -d "$suite"/*/test_* | xargs -P 8 -n 120 "$rlx" onnx-test --device cuda >"$out/nodes-cuda.log" 2>&1
    grep -E '^(PASS|FAIL|UNSUPPORTED) ' "$out/nodes-cuda.log" | sort >"$out/nodes-cuda-lines.txt"
    expected=crates/rlx-models/tests/data/onnx_backend_expected_pass.txt
    passed=$(grep -c '^PASS ' "$out/nodes-cuda-lines.txt")
    grep '^PASS ' "$out/nodes-cuda-lines.txt" | awk '{print $2}' | sort >"$out/nodes-cuda-pass.txt"
    grep -v '^#' "$expected" | sed '/^$/d' | sort >"$out/nodes-cpu-pass.txt"
    both=$(comm -12 "$out/nodes-cpu-pass.txt" "$out/nodes-cuda-pass.txt" | wc -l)
    cpu=$(wc -l <"$out/nodes-cpu-pass.txt")
    comm -23 "$out/nodes-cpu-pass.txt" "$out/nodes-cuda-pass.txt" >"$out/nodes-cpu-only.txt"
    {
        echo "== node suite on CUDA: $passed passed; $both of the CPU's $cpu passing tests pass on CUDA"
        echo "CPU passes that fail on CUDA (first 40, reasons):"
        while read -r t; do
            grep -E "^(FAIL|UNSUPPORTED) $t[: ]" "$out/nodes-cuda-lines.txt" | cut -c1-300
        done <"$out/nodes-cpu-only.txt" | head -40
    } | tee -a "$out/models.log"
    ;;
timing)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    cuda_libraries
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/timing.log"
    # Extra arguments go to the script (`--bert-only`, `--llama-only`).
    "$(torch_python)" scripts/gpu_models.py .device/tools/rlx /tmp/rlx-gpu-models --timing "${@:2}" 2>&1 |
        grep -v 'Writing model shards' | tee -a "$out/timing.log"
    ;;
bench)
    # Kernel benchmarks: the matrix-vector and group variants (rlx-cuda's
    # gemv_bench), and Llama decode with programmatic launches and groups on and off.
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    cuda_libraries
    # RLX_BENCH_GEMV=0 leaves the kernel variants out (decode only).
    if [ "${RLX_BENCH_GEMV:-1}" != 0 ]; then
        "$bin/unit-rlx_cuda" --ignored --nocapture gemv_bandwidth >"$out/gemv-bench.txt" 2>&1
        grep -E 'test result|panicked' "$out/gemv-bench.txt"
    fi
    model=/tmp/rlx-gpu-models/llama-1b-bf16
    # A fresh machine has no checkpoint yet: the decode timing makes it.
    if [ ! -d "$model" ]; then
        "$(torch_python)" scripts/gpu_models.py .device/tools/rlx /tmp/rlx-gpu-models --timing --llama-only 2>&1 |
            grep -E '^Llama|failed'
    fi
    if [ -d "$model" ]; then
        # Where a token's time goes (CUDA events around every kernel).
        .device/tools/rlx bench llm --model "$model" --prompt 0 --gen 32 --reps 1 \
            --device cuda --profile >"$out/profile-decode.txt" 2>&1
        head -14 "$out/profile-decode.txt"
        # Alternating: everything on; products not grouped; no programmatic launches.
        for setting in "1 1" "0 1" "1 0" "1 1" "0 1" "1 0"; do
            set -- $setting
            printf "decode, RLX_CUDA_PDL=%s RLX_CUDA_GROUPS=%s: " "$1" "$2"
            RLX_CUDA_PDL=$1 RLX_CUDA_GROUPS=$2 .device/tools/rlx bench llm --model "$model" \
                --prompt 0 --gen 64 --reps 3 --device cuda --json |
                python3 -c 'import json,sys; print(json.load(sys.stdin)["tests"][0]["median_tokens_per_s"], "tok/s")'
        done
    fi
    ;;
train)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    cuda_libraries
    py=$(torch_python)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/train.log"
    "$py" bench/train_vs_torch.py parity --device cuda --rlx .device/tools/rlx --verbose \
        --json "$out/train-parity.json" 2>&1 | tee -a "$out/train.log"
    "$py" bench/train_vs_torch.py speed --job charlm --device cuda --compile --rounds 3 --steps 40 \
        --rlx .device/tools/rlx --json "$out/train-speed.json" 2>&1 | tee -a "$out/train.log"
    ;;
ab)
    out=${OUT:-gpu-out}
    mkdir -p "$out"
    cuda_libraries
    first=${2:?the first rlx binary}
    second=${3:?the second rlx binary}
    model=/tmp/rlx-gpu-models/llama-1b-bf16
    if [ ! -d "$model" ]; then
        "$(torch_python)" scripts/gpu_models.py .device/tools/rlx /tmp/rlx-gpu-models --timing --llama-only 2>&1 |
            grep -E '^Llama|failed' | tee -a "$out/ab.log"
    fi
    for round in 1 2 3 4; do
        for tool in "$first" "$second"; do
            printf "round %s, %s: " "$round" "$tool" | tee -a "$out/ab.log"
            "$tool" bench llm --model "$model" --prompt 0 --gen 64 --reps 3 --device cuda --json |
                python3 -c 'import json,sys; print(json.load(sys.stdin)["tests"][0]["median_tokens_per_s"], "tok/s")' |
                tee -a "$out/ab.log"
        done
    done
    ;;
*)
    echo "usage: $0 build|run|models|timing|train|ab|bench" >&2
    exit 2
    ;;
esac
