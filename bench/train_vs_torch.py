#!/usr/bin/env python3
"""RLX training against PyTorch: step-by-step parity and side-by-side step times.

PyTorch builds the same model from the same config (the character GPT of `rlx train
charlm`, or the digits CNN of `rlx train digits --model cnn`), with params laid out
and named as RLX names them (linear weights [in, out]). Every run is a fresh process.

    parity   PyTorch draws the initial weights (fixed seed) and writes them as
             safetensors; the script draws the training windows once and writes them
             to a file. `rlx train charlm --init --batches` and PyTorch (AdamW, the
             same warmup-cosine schedule, clipping at norm 1) train on exactly those.
             The losses are compared step by step (relative) and the params after the
             last step (absolute).
    speed    Times training steps of both, rounds alternating (and which side goes
             first alternating too): the median step of each round, the ratio of the
             medians per round, the median ratio. Also each side's peak resident
             memory (VmHWM). `--compile` adds torch.compile as a third side.

Usage:
    python3 bench/train_vs_torch.py parity [--steps 50] [--device cpu|cuda]
    python3 bench/train_vs_torch.py speed --job charlm|digits-cnn [--rounds 5]
                                    [--steps 20] [--threads 2] [--compile] [--device D]

It installs torch and numpy into a virtual environment in the cache
($RLX_CACHE or ~/.cache/rlx; $RLX_TORCH_VENV overrides) and re-runs itself there.
`--rlx PATH` chooses the rlx binary (default target/release/rlx).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("RLX_CACHE") or Path.home() / ".cache" / "rlx")
VENV = Path(os.environ.get("RLX_TORCH_VENV") or CACHE / "torch-venv")
PACKAGES = ["torch", "numpy"]

CHARLM = dict(layers=4, width=256, heads=4, context=128, batch=16, lr=2e-3)
DIGITS_BATCH = 32


def in_venv():
    return Path(sys.prefix).resolve() == VENV.resolve()


def ensure_venv():
    python = VENV / "bin" / "python"
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401

        return
    except ImportError:
        pass
    if in_venv():
        sys.exit("the venv lacks torch; remove it and run again")
    if not python.exists():
        print(f"setting up {VENV} ...", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
        subprocess.check_call([str(python), "-m", "pip", "install", "-q", *PACKAGES])
    os.execv(str(python), [str(python), *sys.argv])


def schedule(step, steps, lr):
    """The warmup-cosine schedule of `rlx train charlm` (LrSchedule::WarmupCosine)."""
    warmup, total, floor = min(steps // 20, 200), steps, lr * 0.1
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= total:
        return floor
    progress = (step - warmup) / max(total - warmup, 1)
    return floor + 0.5 * (lr - floor) * (1 + math.cos(math.pi * progress))


DTYPES = {"F32": "<f4", "F64": "<f8", "I64": "<i8"}


def save_safetensors(path, tensors):
    """Writes {name: numpy array} as a safetensors file (header JSON, then the data)."""
    import numpy as np

    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        kind = {np.dtype("<f4"): "F32", np.dtype("<f8"): "F64", np.dtype("<i8"): "I64"}[a.dtype.newbyteorder("<")]
        blob = a.astype(DTYPES[kind]).tobytes()
        header[name] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def load_safetensors(path):
    """Reads a safetensors file into {name: numpy array}."""
    import numpy as np

    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(data[start:end], dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def state_dict_numpy(model):
    return {n: p.detach().cpu().numpy() for n, p in model.named_parameters()}


def peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


# ---------------------------------------------------------------- PyTorch models


def torch_models():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Linear(nn.Module):
        """x @ weight + bias with weight [in, out], as RLX lays it out."""

        def __init__(self, i, o, bias=True):
            super().__init__()
            bound = 1 / math.sqrt(i)
            self.weight = nn.Parameter(torch.empty(i, o).uniform_(-bound, bound))
            self.bias = nn.Parameter(torch.empty(o).uniform_(-bound, bound)) if bias else None

        def forward(self, x):
            y = x @ self.weight
            return y if self.bias is None else y + self.bias

    class Attention(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.q, self.k, self.v, self.proj = (Linear(d, d) for _ in range(4))

        def forward(self, x):
            b, t, d = x.shape
            split = lambda y: y.view(b, t, self.h, d // self.h).transpose(1, 2)
            a = F.scaled_dot_product_attention(
                split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True
            )
            return self.proj(a.transpose(1, 2).reshape(b, t, d))

    class Mlp(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc, self.proj = Linear(d, 4 * d), Linear(4 * d, d)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x)))

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.ln1, self.attn = nn.LayerNorm(d), Attention(d, h)
            self.ln2, self.mlp = nn.LayerNorm(d), Mlp(d)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class CharLm(nn.Module):
        def __init__(self, layers, width, heads, context, **_):
            super().__init__()
            self.tok_emb = nn.Embedding(256, width)
            nn.init.normal_(self.tok_emb.weight, std=0.02)
            self.pos_emb = nn.Parameter(torch.randn(context, width) * 0.02)
            self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.head = Linear(width, 256, bias=False)

        def forward(self, tokens):
            x = self.tok_emb(tokens) + self.pos_emb
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)).reshape(-1, 256)

    class DigitsCnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
            self.out = Linear(32 * 16, 10)

        def forward(self, x):
            h = F.relu(self.conv1(x.view(-1, 1, 8, 8)))
            h = F.max_pool2d(F.relu(self.conv2(h)), 2)
            return self.out(h.flatten(1))

    return CharLm, DigitsCnn


# ---------------------------------------------------------------- workers


def torch_worker(args):
    """Trains with PyTorch in this process and writes a JSON result."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device.startswith("cuda") else "cpu")
    CharLm, DigitsCnn = torch_models()
    torch.manual_seed(0)
    if args.job == "charlm":
        model = CharLm(**CHARLM)
    else:
        model = DigitsCnn()
    if args.init:
        model.load_state_dict({n: torch.from_numpy(a.copy()) for n, a in load_safetensors(args.init).items()})
    model.to(device)
    if args.float64:
        model.double()
    step_fn_model = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=CHARLM["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    if args.job == "charlm":
        c, b = CHARLM["context"], CHARLM["batch"]
        raw = np.frombuffer(Path(args.batches).read_bytes(), dtype=np.uint8)
        rows = raw[: args.steps * b * (c + 1)].reshape(args.steps, b, c + 1).astype(np.int64)
        data = torch.from_numpy(rows).to(device)
        batch = lambda s: (data[s, :, :c], data[s, :, 1:].reshape(-1))
    else:
        gen = torch.Generator().manual_seed(1)
        xs = torch.rand(args.steps, DIGITS_BATCH, 64, generator=gen).to(device)
        ys = torch.randint(0, 10, (args.steps, DIGITS_BATCH), generator=gen).to(device)
        batch = lambda s: (xs[s], ys[s])

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, seconds = [], []
    for step in range(args.steps):
        began = time.perf_counter()
        lr = float(np.float32(schedule(step, args.schedule_steps, CHARLM["lr"])))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batch(step)
        if args.autocast:
            # Mixed precision as PyTorch recommends it: the products (and the ops
            # autocast lists) in bfloat16, the weights and the optimizer in f32.
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = step_fn_model(x)
            loss = F.cross_entropy(logits.float(), y)
        else:
            loss = F.cross_entropy(step_fn_model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.job == "charlm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        sync()
        seconds.append(time.perf_counter() - began)
    if args.params_out:
        save_safetensors(args.params_out, state_dict_numpy(model))
    result = dict(losses=losses, step_seconds=seconds, peak_rss_bytes=peak_rss(), torch=torch.__version__)
    Path(args.out).write_text(json.dumps(result))


def export_init(path):
    """The PyTorch model's initial weights (seed 0), as safetensors."""
    import torch

    CharLm, _ = torch_models()
    torch.manual_seed(0)
    model = CharLm(**CHARLM)
    save_safetensors(path, state_dict_numpy(model))


def write_batches(path, steps):
    """`steps` batches of random windows of the standard library's text."""
    import numpy as np
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
    rng = np.random.default_rng(0)
    c, b = CHARLM["context"], CHARLM["batch"]
    starts = rng.integers(0, len(text) - c - 1, steps * b)
    rows = np.stack([text[s : s + c + 1] for s in starts])
    Path(path).write_bytes(rows.tobytes())


def run_rlx(args, work, steps, tag):
    """Runs `rlx train` in a fresh process; returns its summary and output directory."""
    out = Path(work) / f"rlx-{tag}"
    if args.job == "charlm":
        cmd = [args.rlx, "train", "charlm", "--steps", str(args.schedule_steps), "--stop-after", str(steps),
               "--init", str(Path(work) / "init.safetensors"), "--batches", str(Path(work) / "batches.bin")]
        cmd += ["--layers", str(CHARLM["layers"]), "--width", str(CHARLM["width"]), "--heads",
                str(CHARLM["heads"]), "--context", str(CHARLM["context"]), "--batch", str(CHARLM["batch"]),
                "--lr", str(CHARLM["lr"])]
    else:
        cmd = [args.rlx, "train", "digits", "--model", "cnn", "--epochs", str(steps), "--batch", str(DIGITS_BATCH)]
    cmd += ["--device", args.device, "--threads", str(args.threads), "--out", str(out), "--json", "-q"]
    if args.bf16:
        cmd.append("--bf16")
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"rlx failed: {' '.join(cmd)}\n{result.stderr}")
    return json.loads(result.stdout), out


def run_torch(args, work, steps, tag, compile_=False, params_out=None, autocast=False):
    out = Path(work) / f"torch-{tag}.json"
    cmd = [sys.executable, __file__, "worker", "--job", args.job, "--steps", str(steps), "--out", str(out),
           "--threads", str(args.threads), "--device", args.device, "--schedule-steps", str(args.schedule_steps)]
    if args.job == "charlm":
        cmd += ["--init", str(Path(work) / "init.safetensors"), "--batches", str(Path(work) / "batches.bin")]
    if compile_:
        cmd.append("--compile")
    if autocast:
        cmd.append("--autocast")
    if getattr(args, "float64", False):
        cmd.append("--float64")
    if params_out:
        cmd += ["--params-out", str(params_out)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def parity(args):
    args.job = "charlm"
    with tempfile.TemporaryDirectory() as work:
        export_init(Path(work) / "init.safetensors")
        write_batches(Path(work) / "batches.bin", args.steps)
        rlx, rlx_dir = run_rlx(args, work, args.steps, "parity")
        torch_params = Path(work) / "torch-params.safetensors"
        ref = run_torch(args, work, args.steps, "parity", params_out=torch_params)
        worst_loss = 0.0
        for step, (a, b) in enumerate(zip(rlx["losses"], ref["losses"])):
            rel = abs(a - b) / abs(b)
            worst_loss = max(worst_loss, rel)
            if step < 3 or step % 10 == 9 or step == args.steps - 1:
                print(f"step {step + 1:3d}: rlx {a:.6f}  torch {b:.6f}  relative {rel:.2e}")
        mine = load_safetensors(rlx_dir / "checkpoint.safetensors")
        theirs = load_safetensors(torch_params)
        worst_param, where = 0.0, ""
        for name, value in theirs.items():
            diffs = abs(mine[name] - value)
            diff = float(diffs.max())
            if args.verbose:
                print(f"  {name:28s} max diff {diff:.2e}, {int((diffs > 1e-5).sum())} of {diffs.size} above 1e-5")
            if diff > worst_param:
                worst_param, where = diff, name
        ok = worst_loss <= 1e-4 and worst_param <= 1e-3
        if args.float64:
            # PyTorch f32 against the same float64 run: the drift of f32 rounding alone.
            args.float64 = False
            f32 = run_torch(args, work, args.steps, "parity-f32")
            drift = max(abs(a - b) / abs(b) for a, b in zip(f32["losses"], ref["losses"]))
            print(f"against PyTorch float64: rlx f32 drifts {worst_loss:.2e}, PyTorch f32 {drift:.2e}")
        print(f"torch {ref['torch']}, {args.steps} steps on {args.device}: worst loss difference "
              f"{worst_loss:.2e} (relative, goal 1e-4), worst param difference {worst_param:.2e} "
              f"in '{where}' (absolute, goal 1e-3): {'PASS' if ok else 'FAIL'}")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(
                steps=args.steps, device=args.device, worst_loss_relative=worst_loss,
                worst_param_absolute=worst_param, worst_param=where, torch=ref["torch"],
                rlx_losses=rlx["losses"], torch_losses=ref["losses"])))
        sys.exit(0 if ok else 1)


def speed(args):
    sides = ["rlx", "torch"] + (["compile"] if args.compile else []) + (["torch-f32"] if args.bf16 else [])
    times = {s: [] for s in sides}
    memory = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as work:
        if args.job == "charlm":
            export_init(Path(work) / "init.safetensors")
            write_batches(Path(work) / "batches.bin", args.steps)
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else list(reversed(sides))
            for side in order:
                if side == "rlx":
                    summary, _ = run_rlx(args, work, args.steps if args.job == "charlm" else 1, f"speed{r}")
                    times[side].append(statistics.median(summary["step_seconds"][3:]))
                    memory[side].append(summary["peak_rss_bytes"])
                else:
                    # The digits run of rlx is one epoch (44 steps); time as many.
                    steps = args.steps if args.job == "charlm" else 1437 // DIGITS_BATCH
                    res = run_torch(args, work, steps, f"speed{r}", compile_=(side == "compile"),
                                    autocast=args.bf16 and side != "torch-f32")
                    # Leave out the first steps (compilation, warm-up).
                    times[side].append(statistics.median(res["step_seconds"][3:]))
                    memory[side].append(res["peak_rss_bytes"])
            line = "  ".join(f"{s} {times[s][-1] * 1e3:.2f} ms" for s in sides)
            print(f"round {r + 1}: {line}")
    report = {}
    for s in sides[1:]:
        ratios = [a / b for a, b in zip(times["rlx"], times[s])]
        name = {"torch": "torch eager (bf16 autocast)" if args.bf16 else "torch eager",
                "compile": "torch.compile", "torch-f32": "torch eager (f32)"}[s]
        report[s] = statistics.median(ratios)
        print(f"rlx / {name}: median ratio {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f}); step {statistics.median(times['rlx']) * 1e3:.2f} ms "
              f"vs {statistics.median(times[s]) * 1e3:.2f} ms")
    for s in sides:
        print(f"peak RSS {s}: {max(memory[s]) / 2**20:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(job=args.job, times=times, memory=memory, ratios=report)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["parity", "speed", "worker"])
    p.add_argument("--job", choices=["charlm", "digits-cnn"], default="charlm")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--schedule-steps", type=int, default=2000,
                   help="charlm: the length of the run whose learning-rate schedule the steps follow "
                        "(2000, `rlx train charlm`'s default: 100 warmup steps)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--rlx", default=str(ROOT / "target" / "release" / "rlx"))
    p.add_argument("--json")
    p.add_argument("--verbose", action="store_true", help="parity: every param's largest difference")
    p.add_argument("--init")
    p.add_argument("--batches")
    p.add_argument("--out")
    p.add_argument("--params-out")
    p.add_argument("--bf16", action="store_true",
                   help="speed: RLX with --bf16 (products in bfloat16 on AMX) against PyTorch under "
                        "torch.autocast(bfloat16), and PyTorch in f32 as a third side")
    p.add_argument("--autocast", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--float64", action="store_true",
                   help="parity: compare both against PyTorch in float64 (how far f32 rounding alone drifts)")
    args = p.parse_args()
    ensure_venv()
    {"parity": parity, "speed": speed, "worker": torch_worker}[args.mode](args)


if __name__ == "__main__":
    main()
