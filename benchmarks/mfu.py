"""MFU of ppo_step on the batch RL produces, against a naive padded HF step (one GPU).

    python benchmarks/mfu.py                                   # both shapes, every variant
    python benchmarks/mfu.py --shapes qwen3-1.7b --variants defaults,compile --steps 3
    python benchmarks/mfu.py --out /tmp/mfu.jsonl               # JSON lines too
    python benchmarks/mfu.py --device cpu --shapes tiny --variants defaults   # smoke run

Shapes (random init from config dicts, nothing downloaded): llama-3.2-1b (benchmarks/grpo_1p5b.py's
shape: head_dim 64, tied embeddings, llama3 rope scaling), qwen3-1.7b (benchmarks/defaults.py's
shape: head_dim 128, tied embeddings) and tiny (a 2-layer llama, for --device cpu).

The batch is drawn here with a seeded generator: 96 sequences whose lengths are lognormal
(mu 7.0, sigma 1.0: a mean of ~1,700 after clipping to [64, 8192]; seed 8 draws 160,605 real
tokens), ids uniform in the vocabulary, right padding, the first min(128, len // 4) tokens of a row
a prompt without loss, advantages standard normal; old log-probs come from forward_logp.

Variants, each on a fresh state (the previous one deleted, gc, cache emptied):
  naive          benchmarks/run.py's bench_naive_step: HF model, bf16 weights + AdamW, 2 padded
                 rows per micro-batch, sdpa, fp32 logits
  defaults       EngineConfig() with only the model set (automatic micro-batch budget)
  compile        defaults + compile=True
  compile-liger  defaults + compile=True, logprobs_impl="liger" (skipped without liger_kernel)
  32k-noreshard  32k-token micro-batches, FSDP reshard_after_forward=False
  compile-32k    compile-liger and 32k-noreshard together
  compile-64k    the same with 64k-token micro-batches
Per variant: the first ppo_step's seconds (compilation happens there), then the median of --steps
synchronised steps (host clock), real tokens/s, MFU, peak GiB (torch.cuda.max_memory_allocated)
and the speed-up over naive. A variant that fails records its error's first line; the rest go on.

FLOP convention, MFU on real (unpadded) tokens:
    MFU = (6·P·tokens + 6·layers·(heads·head_dim)·Σ len²) / step seconds / GEMM rate
P is the matmul parameter count of the built HF model: every nn.Linear weight, lm_head included
(a tied lm_head counted once, as the matmul it is), the embedding lookup excluded; the second term
is causal attention (QKᵀ and AV, 4·len²·d per layer forward, halved by causality, ×3 for forward
and backward). Recomputation under activation checkpointing is not counted. The rate is the
measured bf16 8192³ GEMM (run.bench_matmul) or --rate; on CPU, MFU only with --rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import run  # noqa: E402 - benchmarks/run.py: rows, the GEMM rate, the naive step
from _table import print_markdown_table  # noqa: E402
from defaults import QWEN3_1_7B  # noqa: E402 - benchmarks/defaults.py's Qwen3-1.7B shape
from grpo_1p5b import SHAPES as GRPO_SHAPES  # noqa: E402 - its Llama-3.2-1B shape
from run import ROWS, log, record  # noqa: E402

import fsdpfn as ff  # noqa: E402
from fsdpfn import keys as K  # noqa: E402
from fsdpfn.ops.logprobs import liger_available  # noqa: E402

LLAMA_3_2_1B = GRPO_SHAPES["llama-3.2-1b"]
SHAPES = {
    "llama-3.2-1b": LLAMA_3_2_1B,
    "qwen3-1.7b": dict(QWEN3_1_7B, rms_norm_eps=1e-6),
    "tiny": dict(LLAMA_3_2_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256),
}
# the batch per shape: rows, lognormal mu and sigma, clip bounds (tiny: a seconds-long CPU step)
FULL_BATCH = dict(n=96, mu=7.0, sigma=1.0, lo=64, hi=8192)
TINY_BATCH = dict(n=6, mu=math.log(32), sigma=0.5, lo=8, hi=64)


def tuned(mb_tokens: int, *, compiled: bool) -> dict:
    """Long micro-batches without resharding; with compile, the Liger head too."""
    out = {"mb_spec": ff.MicroBatchSpec(max_tokens_per_mb=mb_tokens),
           "fsdp": ff.FSDPConfig(reshard_after_forward=False)}
    return {"compile": True, "logprobs_impl": "liger", **out} if compiled else out


VARIANTS = {  # --variants key -> (label, EngineConfig keywords beyond the defaults)
    "defaults": ("defaults", {}),
    "compile": ("compile", {"compile": True}),
    "compile-liger": ("compile + liger head", {"compile": True, "logprobs_impl": "liger"}),
    "32k-noreshard": ("32k micro-batches, reshard_after_forward=False",
                      tuned(32768, compiled=False)),
    "compile-64k": ("compile + liger head, 64k micro-batches, reshard_after_forward=False",
                    tuned(65536, compiled=True)),
    "compile-32k": ("compile + liger head, 32k micro-batches, reshard_after_forward=False",
                    tuned(32768, compiled=True)),
    "compile-48k": ("compile + liger head, 48k micro-batches, reshard_after_forward=False",
                    tuned(49152, compiled=True)),
}
COLUMNS = ("section", "name", "first step s", "old logp s", "s/step", "tokens/s", "mfu",
           "peak GiB", "x naive")


# ---------------------------------------------------------------- batch and FLOPs


def rl_batch(vocab: int, *, n: int, mu: float, sigma: float, lo: int, hi: int, seed: int):
    """run.rl_batch's layout (right padding) with lognormal lengths and per-row prompts."""
    from tensordict import TensorDict
    g = torch.Generator().manual_seed(seed)
    lens = torch.empty(n).log_normal_(mu, sigma, generator=g).round().clamp(lo, hi).long()
    T = int(lens.max())
    pos = torch.arange(T)[None]
    attn = pos < lens[:, None]
    ids = torch.where(attn, torch.randint(0, vocab, (n, T), generator=g), 0)
    prompt = torch.clamp(lens // 4, max=128)
    loss = attn & (pos >= prompt[:, None])
    adv = torch.where(loss, torch.randn(n, T, generator=g), 0.0)
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss,
                       K.ADVANTAGES: adv}, batch_size=[n]), lens.tolist()


def matmul_shape(cfg: dict) -> tuple[int, int, int]:
    """(matmul params, layers, heads·head_dim) read off the HF model built on the meta device:
    run.param_count derives q/k/v widths from hidden/heads, wrong where head_dim is explicit."""
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = dict(cfg)
    hf = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    # modules() yields a tied lm_head once, and nn.Embedding is no nn.Linear
    params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return params, hf.num_hidden_layers, hf.num_attention_heads * head_dim


def train_flops(shape: tuple[int, int, int], lens: list[int]) -> float:
    params, layers, qdim = shape
    return 6 * params * sum(lens) + 6 * layers * qdim * sum(n * n for n in lens)


# ---------------------------------------------------------------- measuring


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def clocked(fn, device: str):
    """fn() and its seconds, synchronised on both sides (run.timed is CUDA-only and averages)."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def release(device: str, compiled: bool) -> None:
    """Free the last variant before the next: its state, compiled graphs and cached blocks."""
    if compiled:
        torch._dynamo.reset()  # compiled graphs hold the modules they traced
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"


def ppo_steps(config, mesh, batch, device: str, steps: int) -> dict:
    """A fresh state's old log-probs, one warm-up ppo_step, then ``steps`` timed steps."""
    state = ff.shard_model(config, mesh)
    batch, logp_s = clocked(lambda: ff.forward_logp(state, batch, out_key=K.OLD_LOGP), device)
    if device == "cuda":
        run.reset_peak()
    times = []
    for _ in range(steps + 1):
        (state, _), sec = clocked(lambda s=state: ff.ppo_step(s, batch, run.ppo_cfg()), device)
        times.append(sec)
    return {"first step s": round(times[0], 2), "old logp s": round(logp_s, 2),
            "s": statistics.median(times[1:]),
            "peak GiB": (round(torch.cuda.max_memory_allocated() / 2**30, 1)
                         if device == "cuda" else "")}


def skip_reason(extra: dict, device: str) -> str | None:
    if extra.get("logprobs_impl") == "liger" and not liger_available(device):
        return f"liger_kernel's fused head unavailable on {device}"
    return None


def rates(values: dict, tokens: int, flops: float, rate: float, naive_s: float | None) -> dict:
    """s/step, tokens/s, MFU and the speed-up over naive from the median step seconds."""
    sec = values.pop("s")
    return {**values, "s/step": round(sec, 3), "tokens/s": round(tokens / sec),
            "mfu": round(flops / sec / (rate * 1e12), 3) if rate else "",
            "x naive": round(naive_s / sec, 2) if naive_s else ""}


def bench_variant(shape: str, key: str, ctx: dict) -> None:
    label, extra = VARIANTS[key]
    reason = skip_reason(extra, ctx["device"])
    if reason:
        record(shape, label, skipped=reason)
        return
    try:
        config = ff.EngineConfig(model_config=ctx["cfg"], dtype=ctx["dtype"],
                                 peak_tflops=ctx["rate"] or None, **extra)  # no 2nd GEMM probe
        values = ppo_steps(config, ctx["mesh"], ctx["batch"], ctx["device"], ctx["steps"])
        record(shape, label, **rates(values, sum(ctx["lens"]), ctx["flops"], ctx["rate"],
                                     ctx["naive_s"]))
    except Exception as exc:  # noqa: BLE001 - out of memory, a compile error: a result
        record(shape, label, error=error_text(exc))
    release(ctx["device"], bool(extra.get("compile")))


def bench_naive(shape: str, ctx: dict) -> float | None:
    """run.bench_naive_step's seconds (mean of 2 after a warm-up), its row re-recorded with this
    script's FLOP count; None when it fails."""
    try:
        # 2 rows per micro-batch: 4 rows of 8,192 tokens need 16 GiB for one copy of their fp32
        # logits over Llama's 128k vocabulary, and the naive step ran out of memory on the H200
        run.bench_naive_step(ctx["cfg"], ctx["batch"], ctx["lens"], ctx["rate"], rows_per_mb=2)
    except Exception as exc:  # noqa: BLE001 - out of memory: the naive step's own result
        record(shape, "naive", error=error_text(exc))
        return None
    finally:
        release(ctx["device"], compiled=False)
    raw = ROWS.pop()  # run.py's row, its MFU by run.train_flops
    values = {"s": raw["s"], "peak GiB": raw["peak_gib"]}
    record(shape, "naive", **rates(values, sum(ctx["lens"]), ctx["flops"], ctx["rate"],
                                   raw["s"]))
    return raw["s"]


# ---------------------------------------------------------------- main


def describe(shape: str, mm: tuple[int, int, int], lens: list[int], flops: float) -> None:
    params, layers, qdim = mm
    log(f"# {shape}: {layers} layers, heads·head_dim {qdim}, {params / 1e6:,.1f}M matmul params; "
        f"batch {len(lens)} rows, {sum(lens)} real tokens (min {min(lens)}, median "
        f"{int(statistics.median(lens))}, max {max(lens)}); {flops:.3e} FLOP per step")


def bench_shape(shape: str, variants: list[str], args, mesh, rate: float) -> None:
    cfg = SHAPES[shape]
    spec = TINY_BATCH if shape == "tiny" else dict(FULL_BATCH, n=args.seqs)
    batch, lens = rl_batch(cfg["vocab_size"], seed=args.seed, **spec)
    mm = matmul_shape(cfg)
    ctx = dict(cfg=cfg, batch=batch, lens=lens, flops=train_flops(mm, lens), rate=rate,
               mesh=mesh, device=args.device, steps=args.steps, naive_s=None,
               dtype="bfloat16" if args.device == "cuda" else "float32")
    describe(shape, mm, lens, ctx["flops"])
    if "naive" in variants:
        if args.device == "cuda":
            ctx["naive_s"] = bench_naive(shape, ctx)
        else:
            record(shape, "naive", skipped="bench_naive_step runs on CUDA only")
    for key in variants:
        if key != "naive":
            bench_variant(shape, key, ctx)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=None,
                   help=f"comma list of {', '.join(SHAPES)} (default: the two real shapes on "
                        "cuda, tiny on cpu)")
    p.add_argument("--variants", default=",".join(["naive", *VARIANTS]),
                   help="comma list of naive, " + ", ".join(VARIANTS))
    p.add_argument("--no-naive", action="store_true", help="leave the naive step out")
    p.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    p.add_argument("--seqs", type=int, default=96, help="rows of the real shapes' batch")
    p.add_argument("--seed", type=int, default=8, help="the batch's generator seed")
    p.add_argument("--rate", type=float, default=0.0,
                   help="peak TFLOP/s for MFU (0: the measured bf16 GEMM on cuda, none on cpu)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=None, help="write the rows as JSON lines here")
    args = p.parse_args()
    args.shapes = (args.shapes or ("tiny" if args.device == "cpu" else "llama-3.2-1b,qwen3-1.7b"))
    if args.steps < 1:
        p.error("--steps: at least 1 timed step")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    unknown += [v for v in args.variants.split(",") if v not in ("naive", *VARIANTS)]
    if unknown:
        p.error(f"unknown shape or variant: {', '.join(unknown)}")
    return args


def main() -> None:
    args = parse_args()
    variants = [v for v in args.variants.split(",") if not (args.no_naive and v == "naive")]
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type=args.device)  # one process
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    rate = args.rate or (run.bench_matmul() if args.device == "cuda" else 0.0)
    log(f"# {device}, torch {torch.__version__}, MFU against "
        f"{f'{rate:.1f} TFLOP/s' if rate else 'no rate (give --rate)'}"
        f"{'' if args.rate or not rate else ' (measured bf16 8192^3 GEMM)'}")
    log("# MFU on real (unpadded) tokens = (6·P·tokens + 6·layers·(heads·head_dim)·Σ len²) / "
        "step s / rate; P: nn.Linear weights incl. lm_head (tied: once), no embedding lookup; "
        "recomputation under checkpointing not counted")
    for shape in args.shapes.split(","):
        bench_shape(shape, variants, args, mesh, rate)
    print_markdown_table([r for r in ROWS if r["section"] != "matmul"], COLUMNS)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in ROWS)


if __name__ == "__main__":
    main()
