#!/usr/bin/env bash
# Builds and runs the loader fuzz targets (fuzz/, cargo-fuzz + libFuzzer).
#
#   scripts/fuzz.sh TARGET SECONDS   run one target (onnx, gguf, safetensors)
#   scripts/fuzz.sh all SECONDS      run each target in turn, SECONDS each
#
# Each run prints the number of executions. Environment:
#   RUNS=N                 also stop after N executions (whichever comes first)
#   SANITIZER=address      cargo-fuzz sanitizer (address, none, ...); default address
#   FUZZ_EXTRA_SEEDS="D.." more seed directories (read, never written)
#   FUZZ_ARGS="..."        more libFuzzer flags
#
# The onnx target also seeds from the ONNX backend tests when the model cache
# holds them (the onnx_backend_suite test fetches them into $RLX_CACHE, else
# $XDG_CACHE_HOME/rlx or ~/.cache/rlx): their model.onnx files under 64 KiB are
# copied to fuzz/node-seeds/ (ignored by git).
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`); nightly features come from
# RUSTC_BOOTSTRAP=1 on the stable toolchain. New corpus entries go to
# fuzz/corpus/TARGET, crashes to fuzz/artifacts/TARGET (both ignored by git); the
# committed seeds are fuzz/seeds/TARGET. One job: targets run one after another.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
if [ $# -ne 2 ]; then
    echo "usage: $0 TARGET|all SECONDS" >&2
    exit 2
fi
all_targets="onnx gguf safetensors"
if [ "$1" = all ]; then targets=$all_targets; else targets=$1; fi
seconds=$2
export RUSTC_BOOTSTRAP=1
sanitizer=${SANITIZER:-address}
status=0
for t in $targets; do
    case " $all_targets " in
    *" $t "*) ;;
    *) echo "unknown target '$t' (one of: $all_targets, all)" >&2; exit 2 ;;
    esac
    corpus="$root/fuzz/corpus/$t"
    artifacts="$root/fuzz/artifacts/$t"
    log="$root/fuzz/artifacts/$t.log"
    mkdir -p "$corpus" "$artifacts"
    extra=${FUZZ_EXTRA_SEEDS:-}
    if [ "$t" = onnx ]; then
        cache=${RLX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rlx}
        node_seeds="$root/fuzz/node-seeds"
        for d in "$cache"/models/onnx-backend-tests-*/*/*/; do
            [ -f "$d/model.onnx" ] || continue
            [ "$(stat -c %s "$d/model.onnx")" -lt 65536 ] || continue
            mkdir -p "$node_seeds"
            cp -u "$d/model.onnx" "$node_seeds/$(basename "$d").onnx"
        done
        if [ -d "$node_seeds" ]; then
            echo "onnx: also seeding from $(find "$node_seeds" -type f | wc -l) node-test models"
            extra="$extra $node_seeds"
        fi
    fi
    cargo fuzz build --fuzz-dir fuzz -a -s "$sanitizer" "$t"
    args=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048
        -print_final_stats=1 -artifact_prefix="$artifacts/")
    [ -n "${RUNS:-}" ] && args+=(-runs="$RUNS")
    # shellcheck disable=SC2206
    [ -n "${FUZZ_ARGS:-}" ] && args+=($FUZZ_ARGS)
    # shellcheck disable=SC2086
    set +e
    cargo fuzz run --fuzz-dir fuzz -a -s "$sanitizer" "$t" \
        "$corpus" "$root/fuzz/seeds/$t" $extra -- "${args[@]}" \
        >"$log" 2>&1
    rc=$?
    set -e
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)
    grep -E '^(==[0-9]+==|SUMMARY|Test unit written|thread .* panicked)' "$log" | head -20 || true
    echo "$t: ${execs:-?} executions in at most ${seconds}s, exit $rc (log: $log)"
    [ "$rc" -eq 0 ] || status=1
done
exit $status
