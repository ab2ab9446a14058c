#!/usr/bin/env python3
"""Model checks for the GPU machine, run by `scripts/gpu-check.sh run`.

Builds checkpoints there in PyTorch (random weights, fixed seed, saved as safetensors
with transformers' own `save_pretrained`): BERT in the MiniLM shape and Llama in the
SmolLM2-135M shape. Runs PyTorch on token ids and RLX (`rlx forward`, on CUDA and on
the CPU) on the same ids and weights, and compares:

  * BERT last hidden state and Llama logits, f32 with TF32 off: within 1e-3, measured
    as max |rlx - torch| / max |torch| over the tensor;
  * greedy decoding of 32 tokens: CUDA identical to the CPU backend, from the
    safetensors checkpoint and from it written as GGUF with Q8_0 weights
    (`rlx convert`);
  * the same weights in fp16 (BERT) and bf16 (Llama), PyTorch computing in that
    dtype: within 2e-2.

Then a timing table (median of many runs, warm-up excluded, CUDA synchronized):
BERT in the MiniLM shape with fp16 weights at batch 32 x 128 and 1 x 128 for PyTorch
eager, `torch.compile` with CUDA graphs (mode "reduce-overhead") and RLX; and Llama in
a ~1B shape with bf16 weights, decode tokens/s for PyTorch eager (Hugging Face
generation) and RLX, against the copy bandwidth measured here.

Prints one line per check and a summary; exits non-zero when a check fails.
Usage: gpu_models.py RLX_BINARY WORK_DIR [--timing [--llama-only | --bert-only]]
(`--llama-only`: only the decode timing, which also makes the ~1B checkpoint;
`--bert-only`: only the BERT rows.)
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

RLX = sys.argv[1]
WORK = Path(sys.argv[2])
TOLERANCE = 1e-3
HALF_TOLERANCE = 2e-2

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

failures = []


def report(name, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def relative_error(got, want):
    scale = float(np.max(np.abs(want))) or 1.0
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) / scale


def rlx(*args, timeout=300, env=None):
    """Runs the rlx tool (with `env` added to the environment); a run past `timeout`
    seconds is an error (so one stuck command costs one check, not the whole call on
    the GPU machine)."""
    started = time.time()
    try:
        result = subprocess.run([RLX, *map(str, args)], capture_output=True, text=True,
                                timeout=timeout, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"rlx {' '.join(map(str, args))} ran past {timeout} s:\n"
                           f"{(e.stderr or b'')[-2000:]}") from None
    if result.returncode != 0:
        raise RuntimeError(f"rlx {' '.join(map(str, args))} failed:\n{result.stderr}")
    return result.stdout, time.time() - started


def bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
        attn_implementation="eager",
    )
    model = BertModel(config).eval()
    directory = WORK / "bert-minilm"
    model.save_pretrained(directory, safe_serialization=True)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, config.vocab_size, size=(4, 128), dtype=np.int64)
    np.save(WORK / "bert-ids.npy", ids)
    model = model.cuda()
    with torch.no_grad():
        want = model(torch.from_numpy(ids).cuda()).last_hidden_state.float().cpu().numpy()
    for device in ["cuda", "cpu"]:
        out = WORK / f"bert-{device}.npy"
        _, seconds = rlx("forward", directory, "--ids", WORK / "bert-ids.npy", "--output", out, "--device", device)
        err = relative_error(np.load(out), want)
        report(f"bert f32 last hidden state, {device} vs torch", err <= TOLERANCE, f"relative error {err:.2e} ({seconds:.1f} s)")
    # The same weights in fp16, PyTorch computing in fp16.
    half = model.half()
    directory = WORK / "bert-minilm-fp16-check"
    half.save_pretrained(directory, safe_serialization=True)
    with torch.no_grad():
        want = half(torch.from_numpy(ids).cuda()).last_hidden_state.float().cpu().numpy()
    out = WORK / "bert-fp16-cuda.npy"
    _, seconds = rlx("forward", directory, "--ids", WORK / "bert-ids.npy", "--output", out, "--device", "cuda")
    err = relative_error(np.load(out), want)
    report("bert fp16 last hidden state, cuda vs torch fp16", err <= HALF_TOLERANCE, f"relative error {err:.2e} ({seconds:.1f} s)")


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).eval()
    directory = WORK / "llama-smollm2"
    model.save_pretrained(directory, safe_serialization=True)
    rng = np.random.default_rng(2)
    ids = rng.integers(0, config.vocab_size, size=(24,), dtype=np.int64)
    np.save(WORK / "llama-ids.npy", ids)
    model = model.cuda()
    with torch.no_grad():
        want = model(torch.from_numpy(ids)[None].cuda()).logits[0].float().cpu().numpy()
    decoded = {}
    for device in ["cuda", "cpu"]:
        out = WORK / f"llama-{device}.npy"
        stdout, seconds = rlx(
            "forward", directory, "--ids", WORK / "llama-ids.npy", "--output", out,
            "--generate", 32, "--device", device, timeout=150,
        )
        decoded[device] = json.loads(stdout.strip().splitlines()[-1])
        err = relative_error(np.load(out), want)
        report(f"llama smollm2 f32 logits, {device} vs torch", err <= TOLERANCE, f"relative error {err:.2e} ({seconds:.1f} s)")
    same = decoded["cuda"] == decoded["cpu"]
    report(
        "llama smollm2 greedy 32 tokens, cuda vs cpu",
        same and len(decoded["cuda"]) == 32,
        f"cuda {decoded['cuda'][:8]}..., cpu {decoded['cpu'][:8]}...",
    )
    # The same checkpoint as GGUF with Q8_0 weights (RLX's own writer): the quantized
    # products on CUDA decode what the CPU backend decodes.
    gguf = WORK / "llama-smollm2-q8_0.gguf"
    rlx("convert", directory, gguf, "--weights", "q8_0")
    tokens = {}
    for device in ["cuda", "cpu"]:
        stdout, seconds = rlx("forward", gguf, "--ids", WORK / "llama-ids.npy", "--output",
                              WORK / f"llama-q8-{device}.npy", "--generate", 32, "--device",
                              device, timeout=150)
        print(f"  GGUF Q8_0 greedy on {device}: {seconds:.1f} s", flush=True)
        tokens[device] = json.loads(stdout.strip().splitlines()[-1])
    report(
        "llama smollm2 GGUF Q8_0 greedy 32 tokens, cuda vs cpu",
        tokens["cuda"] == tokens["cpu"] and len(tokens["cuda"]) == 32,
        f"cuda {tokens['cuda'][:8]}..., cpu {tokens['cpu'][:8]}...",
    )
    # bf16 weights (transformers' default initializer: the 0.1 above makes a chaotic
    # 30-layer network in which bf16 rounding alone moves the logits by ~15%).
    # RLX reads the bf16 weights and computes in f32: compared with PyTorch computing
    # in bf16 (within 2e-2) and in f32 on the same weights (within 1e-3).
    torch.manual_seed(0)
    config.initializer_range = 0.02
    half = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    directory = WORK / "llama-smollm2-bf16"
    half.save_pretrained(directory, safe_serialization=True)
    half = half.cuda()
    x = torch.from_numpy(ids)[None].cuda()
    with torch.no_grad():
        want_bf16 = half(x).logits[0].float().cpu().numpy()
        want_f32 = half.float()(x).logits[0].float().cpu().numpy()
    out = WORK / "llama-bf16-cuda.npy"
    _, seconds = rlx("forward", directory, "--ids", WORK / "llama-ids.npy", "--output", out, "--device", "cuda")
    got = np.load(out)
    err = relative_error(got, want_bf16)
    own = relative_error(want_bf16, want_f32)
    report("llama smollm2 bf16 weights, cuda vs torch bf16", err <= HALF_TOLERANCE,
           f"relative error {err:.2e} (torch bf16 vs torch f32: {own:.2e}; {seconds:.1f} s)")
    err = relative_error(got, want_f32)
    report("llama smollm2 bf16 weights, cuda vs torch f32 on them", err <= TOLERANCE, f"relative error {err:.2e}")


def cuda_median_ms(fn, runs=50, warmup=10):
    """Median wall time of `fn` in ms, each run synchronized, warm-up excluded."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def bert_config():
    from transformers import BertConfig

    return BertConfig(
        vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
        intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2,
        hidden_act="gelu", layer_norm_eps=1e-12, attn_implementation="sdpa",
    )


def bert_timing(rounds=3):
    """BERT rows of the timing table. `torch.compile` and RLX alternate for `rounds`
    rounds (this card's speed drifts between runs); each figure is the median over
    rounds of per-round medians, and the ratio the median of per-round ratios."""
    from transformers import BertModel

    torch.manual_seed(0)
    model = BertModel(bert_config()).eval().half()
    directory = WORK / "bert-minilm-fp16"
    model.save_pretrained(directory, safe_serialization=True)
    model = model.cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    rows = []
    for batch in [32, 1]:
        ids = np.random.default_rng(3).integers(0, 30522, size=(batch, 128), dtype=np.int64)
        ids_file = WORK / f"bert-ids-{batch}.npy"
        np.save(ids_file, ids)
        x = torch.from_numpy(ids).cuda()
        forward = ["forward", directory, "--ids", ids_file, "--output",
                   WORK / "bert-fp16-out.npy", "--device", "cuda"]
        bests, mines, to_host = [], [], []
        with torch.no_grad():
            eager = cuda_median_ms(lambda: model(x))
            for _ in range(rounds):
                bests.append(cuda_median_ms(lambda: compiled(x), warmup=20))
                stdout, _ = rlx(*forward, "--bench", 50)
                result = json.loads(stdout.strip().splitlines()[-1])
                mines.append(result["median_ms"])
                to_host.append(result["median_ms_to_host"])
        ratio = float(np.median([m / b for m, b in zip(mines, bests)]))
        rows.append((f"BERT MiniLM shape fp16 weights, {batch} x 128 (RLX with the copy of the "
                     f"result to the host: {np.median(to_host):.3f} ms; rounds: torch.compile "
                     f"{', '.join(f'{b:.3f}' for b in bests)}, RLX "
                     f"{', '.join(f'{m:.3f}' for m in mines)})",
                     eager, float(np.median(bests)), float(np.median(mines)), ratio))
        # The products with their epilogues as separate kernels (no cuBLASLt).
        stdout, _ = rlx(*forward, "--bench", 50, env={"RLX_CUDA_LT": "0"})
        plain = json.loads(stdout.strip().splitlines()[-1])["median_ms"]
        print(f"BERT {batch} x 128 with RLX_CUDA_LT=0: {plain:.3f} ms", flush=True)
        # Where RLX's time goes (a separate pass: profiling launches step by step).
        stdout, _ = rlx(*forward, "--bench", 20, "--profile")
        save_profile(f"bert-fp16-{batch}x128", stdout)
    return rows


def save_profile(name, text):
    """Writes an `rlx ... --profile` output under $OUT (or the work directory)."""
    out = Path(os.environ.get("OUT", WORK))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile-{name}.txt").write_text(text)


def copy_bandwidth():
    """Device-to-device copy bandwidth in bytes/s (read + write), 1 GiB buffers."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = cuda_median_ms(lambda: b.copy_(a), runs=20, warmup=3)
    return 2 * a.numel() / (ms / 1e3)


def llama_timing():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    directory = WORK / "llama-1b-bf16"
    model.save_pretrained(directory, safe_serialization=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt = torch.randint(0, config.vocab_size, (1, 16), device="cuda")
    new = 64
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        eager = new / (time.perf_counter() - start)
    del model
    torch.cuda.empty_cache()
    stdout, _ = rlx("bench", "llm", "--model", directory, "--prompt", 0, "--gen", new,
                    "--reps", 3, "--device", "cuda", "--json")
    report_json = json.loads(stdout)
    mine = report_json["tests"][0]["median_tokens_per_s"]
    stdout, _ = rlx("bench", "llm", "--model", directory, "--prompt", 0, "--gen", 32,
                    "--reps", 1, "--device", "cuda", "--profile")
    save_profile("llama-1b-bf16-decode", stdout)
    bandwidth = copy_bandwidth()
    limit = bandwidth / weight_bytes
    return eager, mine, limit, weight_bytes, bandwidth


def timing(llama_only=False, bert_only=False):
    print("== timing", flush=True)
    try:
        for name, eager, best, mine, ratio in ([] if llama_only else bert_timing()):
            print(f"{name}: torch eager {eager:.3f} ms, torch.compile (CUDA graphs) {best:.3f} ms, "
                  f"RLX {mine:.3f} ms, RLX / torch.compile {ratio:.2f}x", flush=True)
    except Exception as e:
        print(f"bert timing failed: {type(e).__name__}: {e}", flush=True)
    if bert_only:
        return
    try:
        eager, mine, limit, weight_bytes, bandwidth = llama_timing()
        print(f"Llama ~1B shape bf16 decode: torch eager (HF generate) {eager:.1f} tok/s, RLX {mine:.1f} tok/s; "
              f"weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e9:.0f} GB/s, "
              f"limit {limit:.0f} tok/s, RLX at {100 * mine / limit:.1f}% of it", flush=True)
    except Exception as e:
        print(f"llama timing failed: {type(e).__name__}: {e}", flush=True)


def main():
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    if "--timing" in sys.argv:
        timing(llama_only="--llama-only" in sys.argv, bert_only="--bert-only" in sys.argv)
        return
    for check in [bert, llama]:
        try:
            check()
        except Exception as e:  # one model's failure does not hide the other's result
            report(check.__name__, False, f"{type(e).__name__}: {e}")
    print(f"models: {len(failures)} failed" + (f" ({', '.join(failures)})" if failures else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
