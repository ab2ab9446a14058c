#!/usr/bin/env python3
"""The model zoo: RLX against ONNX Runtime on architectures nobody tuned for.

Every model in `bench/zoo/models.py` is built with random weights from a fixed seed,
exported to ONNX (TorchScript or dynamo exporter, as the entry says) once into the
cache, and then, side by side on the same inputs and thread count:

- the outputs of RLX (`rlx run`) and ONNX Runtime are compared: the max relative
  difference is max |rlx - ort| / max |ort| over each output, the worst output;
- both are timed in alternating rounds (which side goes first alternates), each
  round in fresh processes (`rlx bench onnx`, and an ONNX Runtime worker with all
  graph optimizations on and `intra_op_num_threads` = the thread count);
- RLX's kernel profile gives the share of time in reference kernels (`cpu.ref.*`).

It prints a table (median latencies, the median of the per-round ratios, the
difference, the reference-kernel share), the geometric mean of the ratios and the
worst model, and with `--json FILE` writes every figure; `--plot FILE.png` draws
the ratios.

Usage:
    python3 bench/zoo.py [--models a,b,...] [--threads 2] [--rounds 3]
                         [--json FILE] [--plot FILE.png] [--export-only] [--list]
    python3 bench/zoo.py --check [--models ...]   # outputs and RLX's profile only
    python3 bench/zoo.py --ort-profile [--models ...]  # ONNX Runtime's per-node profile
    python3 bench/zoo.py --conv-layers [--models ...]  # each convolution, RLX beside ORT

It makes its own virtual environment in the cache ($RLX_CACHE or ~/.cache/rlx) with
pinned PyTorch, torchvision, transformers, onnx, onnxscript and ONNX Runtime, and
re-runs itself there. Exports are kept in `$RLX_CACHE/zoo/` (delete one to remake
it).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = Path(os.environ.get("RLX_CACHE") or Path.home() / ".cache" / "rlx")
VENV = CACHE / "zoo-venv"
EXPORTS = CACHE / "zoo"
PACKAGES = [
    "torch==2.15.0",
    "torchvision==0.29.2",
    "transformers==5.23.0",
    "onnx==1.23.2",
    "onnxscript==0.7.2",
    "onnxruntime==1.31.1",
    "numpy",
    "matplotlib",
]
# Seconds of timed runs per side per round (the run count follows from a first run).
ROUND_SECONDS = 1.5

sys.path.insert(0, str(HERE))


def in_venv():
    return Path(sys.prefix).resolve() == VENV.resolve()


def ensure_venv():
    python = VENV / "bin" / "python"
    marker = VENV / ".rlx-zoo-ready"
    if not marker.exists() or marker.read_text() != " ".join(PACKAGES):
        print(f"setting up {VENV} (PyTorch and ONNX Runtime; a few minutes) ...", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
        subprocess.check_call([str(python), "-m", "pip", "install", "-q", *PACKAGES])
        marker.write_text(" ".join(PACKAGES))
    os.execv(str(python), [str(python), *sys.argv])


def model_dir(name):
    return EXPORTS / name


def export_worker(name):
    """Builds one model and exports it with its inputs (run in a process of its own)."""
    import numpy as np
    import torch

    from zoo.models import SEED, by_name

    entry = by_name()[name]
    torch.manual_seed(SEED)
    model = entry.build().eval()
    with torch.no_grad():
        # A weight matrix its initializer leaves at zero (ViT's classifier head) gets
        # small random values: with it the outputs were all zeros on both sides, and
        # the comparison tested nothing.
        for param in model.parameters():
            if param.dim() >= 2 and param.is_floating_point() and not param.any():
                param.normal_(0.0, 0.02)
    feeds = entry.inputs()
    out = model_dir(name)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / "model.onnx.partial"
    with torch.no_grad():
        torch.onnx.export(
            model,
            tuple(feeds.values()),
            str(partial),
            input_names=list(feeds),
            opset_version=entry.opset,
            dynamo=entry.exporter == "dynamo",
            external_data=False,
        )
    for k, (key, value) in enumerate(feeds.items()):
        np.save(out / f"input{k}.npy", value.numpy())
    (out / "inputs.json").write_text(json.dumps({key: f"input{k}.npy" for k, key in enumerate(feeds)}))
    partial.rename(out / "model.onnx")


def ensure_export(name):
    """The exported model and its input files, exported on first use."""
    out = model_dir(name)
    model = out / "model.onnx"
    if not model.exists():
        print(f"exporting {name} ...", file=sys.stderr)
        started = time.time()
        subprocess.check_call([sys.executable, __file__, "--export-worker", name])
        print(f"  exported in {time.time() - started:.0f} s", file=sys.stderr)
    names = json.loads((out / "inputs.json").read_text())
    return model, {k: out / f for k, f in names.items()}


def rlx_binary():
    subprocess.check_call(["cargo", "build", "--release", "-q", "-p", "rlx-cli"], cwd=ROOT)
    return ROOT / "target" / "release" / "rlx"


def rlx_bench(rlx, model, files, runs, warmup, threads, profile=False):
    cmd = [str(rlx), "bench", "onnx", str(model), "--runs", str(runs), "--warmup", str(warmup),
           "--threads", str(threads), "--json"]
    if profile:
        cmd.append("--profile")
    for k, p in files.items():
        cmd += ["--input", f"{k}={p}"]
    return json.loads(subprocess.check_output(cmd, text=True))


def difference(rlx, model, files, tmp):
    """Max over outputs of max |rlx - ort| / max |ort|, and the outputs' count."""
    import numpy as np
    from onnx_vs_ort import ort_session

    outdir = Path(tmp) / "rlx-out"
    cmd = [str(rlx), "run", str(model), "--output-dir", str(outdir), "--json"]
    for k, p in files.items():
        cmd += ["--input", f"{k}={p}"]
    report = json.loads(subprocess.check_output(cmd, text=True))
    feeds = {k: np.load(p) for k, p in files.items()}
    expected = ort_session(model, 1).run(None, feeds)
    if len(report["outputs"]) != len(expected):
        raise RuntimeError(f"RLX gave {len(report['outputs'])} outputs, ONNX Runtime {len(expected)}")
    worst = 0.0
    for out, want in zip(report["outputs"], expected):
        got = np.load(out["file"])
        if got.shape != want.shape:
            raise RuntimeError(f"output {out['name']}: RLX shape {got.shape}, ONNX Runtime {want.shape}")
        want = want.astype(np.float64)
        scale = max(float(np.max(np.abs(want))), 1e-30) if want.size else 1.0
        err = float(np.max(np.abs(got.astype(np.float64) - want))) if want.size else 0.0
        worst = max(worst, err / scale)
    return worst


def ort_node_times(name, threads, runs=20):
    """ONNX Runtime's own per-node profile of one model: `(node, op, output shape, ms
    per run)` for every node, in the order the nodes first ran."""
    import collections
    import tempfile

    import numpy as np
    from onnx_vs_ort import ort_session

    model, files = ensure_export(name)
    feeds = {k: np.load(p) for k, p in files.items()}
    with tempfile.TemporaryDirectory() as tmp:
        session = ort_session(model, threads, profile_prefix=Path(tmp) / "ort")
        for _ in range(3 + runs):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    total, seen, order = collections.Counter(), collections.Counter(), {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            node = e["name"][: -len("_kernel_time")]
            seen[node] += 1
            order.setdefault(node, (e["args"]["op_name"], e["args"].get("output_type_shape")))
            # Each node's first three runs are warm-up.
            if seen[node] > 3:
                total[node] += e["dur"]
    return [(node, op, shape, total[node] / (1000.0 * runs)) for node, (op, shape) in order.items()]


def ort_profile(name, threads, runs=20, top=12):
    """Prints ONNX Runtime's per-node profile of one model: time per op type, then the
    slowest nodes, per run (what ORT fused into what shows in the node names)."""
    import collections

    nodes = ort_node_times(name, threads, runs)
    by_op = collections.Counter()
    for _, op, _, ms in nodes:
        by_op[op] += ms
    print(f"{name}: ONNX Runtime, {threads} threads, {sum(by_op.values()):.3f} ms a run in kernels")
    for op, ms in by_op.most_common():
        print(f"  {op:<28} {ms:8.3f} ms")
    print("  slowest nodes:")
    for node, op, shape, ms in sorted(nodes, key=lambda n: -n[3])[:top]:
        print(f"    {ms:8.3f} ms  {op:<16} {str(shape)[:48]:<48} {node[-60:]}")


def conv_layers(rlx, name, threads, runs=200):
    """Prints every convolution's time in the model, RLX's launch beside ONNX Runtime's
    node, paired in run order (both run their convolutions in graph order, one
    launch or node each), then the sums by RLX kernel family: where a model's gap to
    ONNX Runtime lies, measured inside the model rather than one layer alone (alone,
    ORT's time includes its layout reorders and the layer's input is not in cache).
    Parallel branches (SqueezeNet's fire modules, Inception-style blocks) may run in
    a different order on each side and pair crosswise: then only the totals hold."""
    import collections

    model, files = ensure_export(name)
    report = rlx_bench(rlx, model, files, runs, 3, threads, profile=True)
    ours = [(k["kernel"], k["ms"]) for k in report.get("launches", []) if ".conv" in k["kernel"]]
    theirs = [n for n in ort_node_times(name, threads, runs) if n[1] in ("Conv", "FusedConv")]
    print(f"{name}: {len(ours)} RLX convolution launches, {len(theirs)} ONNX Runtime Conv nodes"
          + ("" if len(ours) == len(theirs) else " (counts differ: pairs past the first mismatch are suspect)"))
    print(f"  {'#':>3} {'RLX kernel':<40} {'RLX ms':>8} {'ORT ms':>8} {'ratio':>6}  ORT output shape")
    families = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for i, ((kernel, ms), (_, _, shape, ort_ms)) in enumerate(zip(ours, theirs)):
        family = kernel.split(".")[1]
        families[family][0] += ms
        families[family][1] += ort_ms
        families[family][2] += 1
        dims = shape[0].get("float") if shape else None
        print(f"  {i:3d} {kernel:<40} {ms:8.3f} {ort_ms:8.3f} {ms / max(ort_ms, 1e-9):6.2f}  {dims}")
    for family, (ms, ort_ms, count) in families.items():
        print(f"  {family:<12} {count:3d} layers: RLX {ms:.3f} ms, ORT {ort_ms:.3f} ms, ratio {ms / max(ort_ms, 1e-9):.2f}")


def compare(rlx, name, args):
    import tempfile

    from onnx_vs_ort import time_ort

    model, files = ensure_export(name)
    with tempfile.TemporaryDirectory() as tmp:
        diff = difference(rlx, model, files, tmp)
    first = rlx_bench(rlx, model, files, 2, 1, args.threads, profile=True)
    reference_share = sum(k["percent"] for k in first.get("profile", []) if k["kernel"].startswith("cpu.ref."))
    slowest_ref = next((k for k in first.get("profile", []) if k["kernel"].startswith("cpu.ref.")), None)
    if args.check:
        print(f"  diff {diff:.1e}, rlx {first['median_ms']:.2f} ms, reference kernels {reference_share:.1f}%"
              + (f" (slowest {slowest_ref['kernel']} {slowest_ref['percent']:.1f}%)" if slowest_ref else ""),
              file=sys.stderr)
        for k in first.get("profile", [])[:args.top]:
            print(f"    {k['kernel']:<48} {k['ms']:>8.3f} ms {k['percent']:>5.1f}% ({k['launches']})", file=sys.stderr)
        return {"model": name, "max_rel_diff": diff, "rlx_median_ms": first["median_ms"],
                "reference_kernel_percent": reference_share, "slowest_reference_kernel": slowest_ref}
    per_run = max(first["median_ms"], 0.05)
    runs = int(min(200, max(5, ROUND_SECONDS * 1e3 / per_run)))
    warmup = max(2, runs // 10)
    ratios, rlx_all, ort_all = [], [], []
    for r in range(args.rounds):
        order = ["rlx", "ort"] if r % 2 == 0 else ["ort", "rlx"]
        times = {}
        for side in order:
            if side == "rlx":
                times[side] = rlx_bench(rlx, model, files, runs, warmup, args.threads)["times_ms"]
            else:
                times[side] = time_ort(model, files, runs, warmup, args.threads)
        a, b = statistics.median(times["rlx"]), statistics.median(times["ort"])
        ratios.append(a / b)
        rlx_all += times["rlx"]
        ort_all += times["ort"]
        print(f"  round {r + 1}: rlx {a:.3f} ms, ort {b:.3f} ms, ratio {a / b:.3f}", file=sys.stderr)
    return {
        "model": name,
        "threads": args.threads,
        "runs": runs,
        "rlx_median_ms": statistics.median(rlx_all),
        "ort_median_ms": statistics.median(ort_all),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "max_rel_diff": diff,
        "reference_kernel_percent": reference_share,
        "slowest_reference_kernel": slowest_ref,
    }


def cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(results, key=lambda r: r["ratio"])
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.2))
    ax.barh([r["model"] for r in rows], [r["ratio"] for r in rows],
            color=["#2a7" if r["ratio"] <= 1.0 else "#c44" for r in rows])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("RLX time / ONNX Runtime time (lower is faster)")
    ax.set_title(f"Model zoo, {results[0]['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--export-worker":
        export_worker(sys.argv[2])
        return
    from zoo.models import MODELS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated names (default: all; --list shows them)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--plot", help="draw the ratios into this PNG")
    parser.add_argument("--export-only", action="store_true", help="export the models and stop")
    parser.add_argument("--list", action="store_true", help="list the models and stop")
    parser.add_argument("--check", action="store_true",
                        help="compare outputs and print RLX's kernel profile; time nothing side by side")
    parser.add_argument("--top", type=int, default=8, help="with --check, kernels of the profile to print")
    parser.add_argument("--ort-profile", action="store_true",
                        help="print ONNX Runtime's own per-node profile of each model and stop")
    parser.add_argument("--conv-layers", action="store_true",
                        help="print every convolution's time, RLX beside ONNX Runtime in the model, and stop")
    args = parser.parse_args()
    if args.list:
        for m in MODELS:
            print(f"{m.name:<22} {m.family:<16} {m.exporter}")
        return
    names = [m.name for m in MODELS]
    if args.models:
        wanted = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            parser.error(f"unknown models {unknown}; --list shows them")
        names = wanted
    if args.threads < 1 or args.rounds < 1:
        parser.error("--threads and --rounds must be at least 1")
    if not in_venv():
        ensure_venv()
    results, failures = [], []
    for name in list(names):
        try:
            ensure_export(name)
        except subprocess.CalledProcessError as e:
            print(f"  export FAILED: {e}", file=sys.stderr)
            failures.append({"model": name, "error": f"export failed: {e}"})
            names.remove(name)
    if args.export_only:
        sys.exit(1 if failures else 0)
    if args.ort_profile:
        for name in names:
            ort_profile(name, args.threads, top=args.top)
        sys.exit(1 if failures else 0)
    rlx = rlx_binary()
    if args.conv_layers:
        for name in names:
            conv_layers(rlx, name, args.threads)
        sys.exit(1 if failures else 0)
    for name in names:
        print(f"{name}", file=sys.stderr)
        try:
            results.append(compare(rlx, name, args))
        except (subprocess.CalledProcessError, RuntimeError) as e:
            print(f"  FAILED: {e}", file=sys.stderr)
            failures.append({"model": name, "error": str(e)})
    if args.check:
        for r in results:
            print(f"{r['model']:<22} diff {r['max_rel_diff']:.1e}  rlx {r['rlx_median_ms']:9.2f} ms  "
                  f"reference kernels {r['reference_kernel_percent']:5.1f}%")
        for f in failures:
            print(f"{f['model']:<22} FAILED: {f['error'][:200]}")
        sys.exit(1 if failures else 0)
    print(f"CPU: {cpu_name()}, {args.threads} threads, {args.rounds} rounds")
    print(f"{'model':<22} {'rlx ms':>9} {'ort ms':>9} {'rlx/ort':>8} {'range':>13} {'rel diff':>9} {'ref %':>6}")
    for r in results:
        print(f"{r['model']:<22} {r['rlx_median_ms']:>9.3f} {r['ort_median_ms']:>9.3f} {r['ratio']:>8.3f} "
              f"{r['ratio_min']:>6.2f}-{r['ratio_max']:<6.2f} {r['max_rel_diff']:>9.1e} "
              f"{r['reference_kernel_percent']:>6.1f}")
    for f in failures:
        print(f"{f['model']:<22} FAILED: {f['error'][:100]}")
    summary = {}
    if results:
        geomean = math.exp(sum(math.log(r["ratio"]) for r in results) / len(results))
        worst = max(results, key=lambda r: r["ratio"])
        summary = {"geomean_ratio": geomean, "worst_model": worst["model"], "worst_ratio": worst["ratio"],
                   "models": len(results), "failed": len(failures)}
        print(f"geometric mean of rlx/ort: {geomean:.3f} over {len(results)} models; "
              f"worst: {worst['model']} at {worst['ratio']:.3f}; failed: {len(failures)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "rounds": args.rounds,
                                               "summary": summary, "results": results, "failures": failures},
                                              indent=2))
    if args.plot and results:
        plot(results, args.plot)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
