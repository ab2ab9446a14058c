#!/usr/bin/env bash
# MiniLM encoder latency with RLX alone (no peer yet): batch 1 x 16, 1 x 128 and
# 32 x 128 tokens, median of repeated in-process runs after warm-up, plus compile time.
# Prints a Markdown table for docs/BENCHMARKS.md.
#
#   bench/minilm_latency.sh            # default run counts
#   RUNS_SCALE=2 bench/minilm_latency.sh  # twice as many timed runs
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p rlx-cli
scale="${RUNS_SCALE:-1}"
results=$(mktemp)
for spec in "1 16 50" "1 128 20" "32 128 5"; do
    set -- $spec
    ./target/release/rlx bench minilm --batch "$1" --seq "$2" \
        --runs $(( $3 * scale )) --warmup 1 --json >> "$results"
done
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("| shape (batch x seq) | median latency | min | runs | tokens/s | threads | compile |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['batch']} x {r['seq']} | {r['median_ms']:.1f} ms | {r['min_ms']:.1f} ms "
          f"| {r['runs']} | {r['tokens_per_s']:.0f} | {r['threads']} | {r['compile_ms']:.0f} ms |")
PY
rm -f "$results"
