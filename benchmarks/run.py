"""GPU benchmarks of fsdpfn against a naive Hugging Face baseline, measured in the same process.

Prints one table (and writes JSON lines to --out when given). Models are built from configs with
random init; nothing is downloaded.

    python benchmarks/run.py                         # all sections, one GPU
    python benchmarks/run.py --only logprobs,ppo     # some sections
    torchrun --nproc-per-node 2 benchmarks/run.py --only ppo,tp   # dp=2 scaling and tp=2 parity

Sections:
  matmul    bf16 8192^3 matmul rate: the ceiling MFU is quoted against
  logprobs  log-probs of N=16k tokens, V=151936: full logits vs chunked_logprobs (fwd, fwd+bwd)
  forward   forward_logp of 4x4096 tokens under its options vs a naive HF forward with full
            fp32 logits (also: forward_variants)
  ppo       ppo_step on 64 sequences, lengths uniform in [256, 4096], vs a naive padded HF step
  tp        (2 GPUs) tp=2 log-probs against dp layouts
  largest   the largest Qwen2 shape that trains on one GPU with fp32 master weights
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdpfn as ff  # noqa: E402
from _table import print_markdown_table  # noqa: E402 - benchmarks/ is this script's folder
from fsdpfn import keys as K  # noqa: E402
from fsdpfn.ops import chunked_logprobs  # noqa: E402
from fsdpfn.ops.logprobs import liger_available, liger_logprobs  # noqa: E402

QWEN2_1_5B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, rope_theta=1000000.0)
QWEN2_7B = dict(QWEN2_1_5B, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
QWEN2_3B = dict(QWEN2_1_5B, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                num_attention_heads=16, num_key_value_heads=2)
QWEN2_14B = dict(QWEN2_7B, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                 num_attention_heads=40, num_key_value_heads=8)

ROWS: list[dict] = []


def rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def log(*args):
    if rank0():
        print(*args, flush=True)


def record(section: str, name: str, **values):
    row = {"section": section, "name": name, **values}
    ROWS.append(row)
    log(json.dumps(row))


def reset_peak():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_gib(base: int) -> float:
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def timed(fn, *, warmup: int = 1, iters: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


# ---------------------------------------------------------------- flops


def _q_width(cfg: dict) -> int:
    """Query heads · head size (head_dim where the config sets it, else hidden / heads)."""
    heads = cfg["num_attention_heads"]
    return (cfg.get("head_dim") or cfg["hidden_size"] // heads) * heads


def param_count(cfg: dict) -> int:
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], \
        cfg["vocab_size"]
    q = _q_width(cfg)
    kv = q // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    # q and o, k and v, the MLP, two norms, the q/k/v biases
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h + q + 2 * kv
    head = 0 if cfg.get("tie_word_embeddings") else v * h
    return L * per_layer + v * h + head + h


def train_flops(cfg: dict, lens: list[int]) -> float:
    """6·(matmul params)·tokens + causal attention 6·L·q·Σ len² (forward 2·len²·q per layer, q:
    query heads · head size, halved by causality, times 3 for forward+backward), counting the
    lm_head but not embeddings."""
    h, L, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    embedding = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    matmul_params = param_count(cfg) - embedding + v * h  # lm_head yes, embedding lookup no
    tokens = sum(lens)
    return 6 * matmul_params * tokens + 6 * L * _q_width(cfg) * sum(n * n for n in lens)


# ---------------------------------------------------------------- sections


def bench_matmul() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    sec = timed(lambda: a @ b, warmup=3, iters=20)
    rate = 2 * 8192 ** 3 / sec / 1e12
    record("matmul", "bf16 8192^3", tflops=round(rate, 1))
    return rate


def bench_logprobs(n=16384, v=151936, h=1536):
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16) * 0.5
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, v, (n,), device="cuda")

    def full(grad):
        x = hidden.detach().requires_grad_(grad)
        logits = (x @ weight.T).float()
        lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        if grad:
            lp.sum().backward()
        return lp

    def chunked(grad, chunk=1024):
        x = hidden.detach().requires_grad_(grad)
        lp, _ = chunked_logprobs(x, weight, targets, chunk_size=chunk)
        if grad:
            lp.sum().backward()
        return lp

    def liger(grad):
        x = hidden.detach().requires_grad_(grad)
        lp = liger_logprobs(x, weight, targets)
        if grad:
            lp.sum().backward()
        return lp

    with torch.no_grad():
        ref64 = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(
            -1, targets[:, None])[:, 0]
    paths = [("full logits", full), ("chunked 1024", chunked)]
    if liger_available("cuda"):
        paths.append(("liger fused linear CE", liger))
    for name, fn in paths:
        with torch.no_grad():
            err = float((fn(False).double() - ref64).abs().max())
        for grad in (False, True):
            base = reset_peak()
            ctx = torch.enable_grad() if grad else torch.no_grad()
            with ctx:
                sec = timed(lambda: fn(grad))
            record("logprobs", f"{name} {'fwd+bwd' if grad else 'fwd'}", n=n, v=v,
                   ms=round(sec * 1e3, 2), peak_extra_gib=round(peak_gib(base), 3),
                   max_abs_err_vs_float64=err)


def rl_batch(n_seqs: int, lo: int, hi: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n_seqs,), generator=g)
    T = int(lens.max())
    ids = torch.randint(0, vocab, (n_seqs, T), generator=g)
    attn = torch.arange(T)[None] < lens[:, None]
    ids = torch.where(attn, ids, 0)
    loss = attn.clone()
    loss[:, :min(128, lo // 2)] = False  # prompts
    from tensordict import TensorDict
    adv = torch.where(loss, torch.randn(n_seqs, T, generator=g), 0.0)
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss,
                       K.ADVANTAGES: adv}, batch_size=[n_seqs]), lens.tolist()


def fsdpfn_state(cfg: dict, *, optimizer=True, budget=16384, mesh=None, offload=False,
                 ac=False, reshard=True, fused=None, dtype="bfloat16", chunk=1024,
                 logprobs_impl="chunked"):
    mesh = mesh or ff.build_mesh(ff.ParallelStrategy(dp=-1))
    fused = ff.EngineConfig.__attrs_attrs__.fused_kernels.default if fused is None else fused
    ecfg = ff.EngineConfig(model_config=cfg, dtype=dtype, optimizer_dtype="float32",
                           gradient_checkpointing=ac, fused_kernels=fused,
                           logprobs_impl=logprobs_impl,
                           logprobs_chunk_size=chunk,
                           mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=budget),
                           fsdp=ff.FSDPConfig(offload_params=offload,
                                              reshard_after_forward=reshard),
                           optimizer=ff.OptimizerConfig(lr=1e-6) if optimizer else None)
    return ff.shard_model(ecfg, mesh), mesh


def naive_model(cfg: dict, dtype=torch.bfloat16):
    from transformers import AutoConfig, AutoModelForCausalLM
    spec = dict(cfg)
    hf = AutoConfig.for_model(spec.pop("model_type"), **spec)
    hf._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf, dtype=dtype)
    return model


def bench_forward(cfg: dict):
    """forward_logp of 4x4096 tokens under its options, against a naive HF forward with full
    fp32 logits measured first in the same process."""
    batch, _ = rl_batch(4, 4096, 4096, cfg["vocab_size"])
    gpu_batch = batch.to("cuda")
    logps = {}
    model = naive_model(cfg)
    ids = gpu_batch[K.INPUT_IDS]

    @torch.no_grad()
    def naive():
        logits = model(input_ids=ids).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])

    base = reset_peak()
    sec = timed(naive, iters=5)
    record("forward", "naive HF full logits", ms=round(sec * 1e3, 1),
           peak_extra_gib=round(peak_gib(base), 2))
    model = None  # freed (the closure above holds the name, not the model)
    variants = [("default", {}), ("fused_kernels=False", {"fused": False}),
                ("chunk 4096", {"chunk": 4096}),
                ("reshard_after_forward=False", {"reshard": False})]
    if liger_available("cuda"):
        variants.append(("logprobs_impl=liger", {"logprobs_impl": "liger"}))
    for name, kw in variants:
        state, _ = fsdpfn_state(cfg, optimizer=False, budget=16384, **kw)
        base = reset_peak()
        sec = timed(lambda: ff.forward_logp(state, batch), iters=5)
        sec_gpu = timed(lambda: ff.forward_logp(state, gpu_batch), iters=5)
        logps[name] = ff.forward_logp(state, batch)[K.LOGP]
        diff = float((logps[name] - logps["default"]).abs().max())
        record("forward", f"forward_logp {name}", ms=round(sec * 1e3, 1),
               ms_gpu_batch=round(sec_gpu * 1e3, 1), peak_extra_gib=round(peak_gib(base), 2),
               max_abs_diff_vs_default=diff)
        state = None


def ppo_cfg():
    return ff.PPOConfig(clip_low=0.2, clip_high=0.28)


def bench_ppo(cfg: dict, rate: float, *, budget=16384, naive=True, n_seqs=64, ac=False,
              fused=None, reshard=True, chunk=1024, logprobs_impl="chunked"):
    world = dist.get_world_size() if dist.is_initialized() else 1
    batch, lens = rl_batch(n_seqs * world, 256, 4096, cfg["vocab_size"], seed=1)
    if naive and world == 1:
        bench_naive_step(cfg, batch, lens, rate)
    state, mesh = fsdpfn_state(cfg, budget=budget, ac=ac, fused=fused, reshard=reshard,
                               chunk=chunk, logprobs_impl=logprobs_impl)
    local = ff.shard_batch(batch, mesh) if world > 1 else batch
    local_lens = local[K.ATTENTION_MASK].sum(-1).tolist()
    local = ff.forward_logp(state, local, out_key=K.OLD_LOGP)
    holder = {"state": state}

    def step():
        holder["state"], _ = ff.ppo_step(holder["state"], local, ppo_cfg())

    reset_peak()
    sec = timed(step, warmup=1, iters=3)
    tok = sum(local_lens)
    mfu = train_flops(cfg, local_lens) / sec / (rate * 1e12)
    record("ppo", f"fsdpfn ppo_step dp={world} budget={budget}{' ac' if ac else ''}"
                  f"{' liger' if fused is not False else ' no-liger'}{'' if reshard else ' no-reshard'}"
                  f"{f' chunk={chunk}' if chunk != 1024 else ''}"
                  f"{' liger-head' if logprobs_impl == 'liger' else ''}",
           real_tokens_per_gpu=tok, s=round(sec, 3),
           tokens_per_s_per_gpu=round(tok / sec), mfu=round(mfu, 3),
           peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
    holder = state = None


def bench_naive_step(cfg, batch, lens, rate, rows_per_mb=4):
    model = naive_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids_all = batch[K.INPUT_IDS]
    attn_all = batch[K.ATTENTION_MASK]
    loss_all, adv_all = batch[K.LOSS_MASK], batch[K.ADVANTAGES]
    ntok = loss_all.sum()

    def step():
        for i in range(0, len(lens), rows_per_mb):
            sl = slice(i, i + rows_per_mb)
            T = int(attn_all[sl].sum(-1).max())
            ids = ids_all[sl, :T].cuda()
            attn = attn_all[sl, :T].cuda()
            lm = loss_all[sl, 1:T].cuda()
            adv = adv_all[sl, 1:T].cuda()
            logits = model(input_ids=ids, attention_mask=attn.long()).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            old = logp.detach()
            ratio = torch.exp(logp - old)
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
            ((pg * lm).sum() / ntok).backward()
            del logits, logp
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_peak()
    sec = timed(step, warmup=1, iters=2)
    tok = sum(lens)
    record("ppo", "naive padded HF step (bf16 weights+Adam, 4 rows/mb, sdpa, fp32 logits)",
           real_tokens_per_gpu=tok, s=round(sec, 3), tokens_per_s_per_gpu=round(tok / sec),
           mfu=round(train_flops(cfg, lens) / sec / (rate * 1e12), 3),
           peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
    model = opt = None


def bench_tp(cfg: dict):
    """tp=2 vs dp=2 log-probs of the same weights (random init is drawn on rank 0 and
    broadcast, so both layouts hold the same model)."""
    batch, lens = rl_batch(8, 512, 2048, cfg["vocab_size"], seed=2)
    out = {}
    for dtype in ("float32", "bfloat16"):
        for name, strategy in (("dp2", ff.ParallelStrategy(dp=2)),
                               ("tp2", ff.ParallelStrategy(dp=1, tp=2))):
            mesh = ff.build_mesh(strategy)
            state, _ = fsdpfn_state(cfg, optimizer=False, mesh=mesh, dtype=dtype,
                                    budget=8192)
            local = ff.shard_batch(batch, mesh)
            out[name, dtype] = ff.gather_batch(ff.forward_logp(state, local), mesh)[K.LOGP]
            base = reset_peak()
            sec = timed(lambda: ff.forward_logp(state, local))
            record("tp", f"forward_logp {name} {dtype}", ms=round(sec * 1e3, 1),
                   peak_extra_gib=round(peak_gib(base), 2))
            state = None
        diff = (out["dp2", dtype] - out["tp2", dtype]).abs()
        record("tp", f"|logp dp2 - logp tp2| {dtype}", max=float(diff.max()),
               mean=float(diff.mean()), mean_abs_logp=float(out["dp2", dtype].abs().mean()))


def bench_largest(rate: float):
    """Each candidate in a subprocess: an OOM must not poison the next."""
    import subprocess
    for name, offload in (("7B", False), ("7B", True)):
        if offload and any(r.get("ok") for r in ROWS if r["section"] == "largest"):
            break  # it trains without offload: nothing to learn from the slower run
        cmd = [sys.executable, __file__, "--only", "one_train", "--model", name,
               "--offload", str(int(offload)), "--rate", str(rate)]
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        except subprocess.TimeoutExpired:
            record("largest", f"Qwen2-{name} offload={offload}", ok=False,
                   error="did not finish within 300 s")
            continue
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        if lines:
            ROWS.append(json.loads(lines[-1]))
            print(lines[-1], flush=True)
        else:
            text = res.stderr or res.stdout
            errors = [ln for ln in text.splitlines() if "Error" in ln]
            tail = (errors[-1] if errors else text[-400:].replace("\n", " | "))[:400]
            record("largest", f"Qwen2-{name} offload={offload}", ok=False, error=tail)


def one_train(name: str, offload: bool, rate: float):
    cfg = {"7B": QWEN2_7B, "14B": QWEN2_14B, "3B": QWEN2_3B}[name]
    torch.cuda.set_device(0)
    batch, lens = rl_batch(16, 256, 4096, cfg["vocab_size"], seed=3)
    try:
        state, _ = fsdpfn_state(cfg, budget=8192, offload=offload, ac=True)
        batch = ff.forward_logp(state, batch, out_key=K.OLD_LOGP)
        holder = {"state": state}

        def step():
            holder["state"], _ = ff.ppo_step(holder["state"], batch, ppo_cfg())

        sec = timed(step, warmup=1, iters=1)
        tok = sum(lens)
        record("largest", f"Qwen2-{name} offload={offload} ac", ok=True,
               params_b=round(param_count(cfg) / 1e9, 2), s=round(sec, 2),
               tokens_per_s=round(tok / sec), mfu=round(train_flops(cfg, lens) / sec /
                                                        (rate * 1e12), 3),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
    except torch.OutOfMemoryError as exc:
        record("largest", f"Qwen2-{name} offload={offload} ac", ok=False,
               params_b=round(param_count(cfg) / 1e9, 2), error=f"OOM: {str(exc)[:120]}",
               allocated_gib=round(torch.cuda.memory_allocated() / 2**30, 1),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1),
               where="".join(__import__("traceback").format_exc().splitlines(True)[-8:])[:600])


def print_table():
    if not rank0():
        return
    print_markdown_table(ROWS, ("section", "name"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="matmul,logprobs,forward,ppo,largest")
    parser.add_argument("--model", default="1.5B")
    parser.add_argument("--offload", default="0")
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    only = args.only.split(",")
    if "RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        ff.build_mesh(ff.ParallelStrategy(dp=-1))  # the process group, before any section
    if "one_train" in only:
        torch.cuda.set_device(0)
        ff.build_mesh(ff.ParallelStrategy(dp=-1))
        one_train(args.model, args.offload == "1", args.rate)
        return
    cfg = {"1.5B": QWEN2_1_5B, "3B": QWEN2_3B, "7B": QWEN2_7B}[args.model]
    log(f"# {torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch "
        f"{torch.__version__}, model Qwen2-{args.model}-shaped ({param_count(cfg)/1e9:.2f}B)")
    rate = args.rate or bench_matmul()
    if "logprobs" in only:
        bench_logprobs()
    if "forward" in only or "forward_variants" in only:
        bench_forward(cfg)
    if "ppo" in only:
        bench_ppo(cfg, rate, budget=args.budget)
    if "ppo_variants" in only:
        bench_ppo(cfg, rate, budget=2 * args.budget, naive=False, fused=True, reshard=False,
                  chunk=2048)
        if liger_available("cuda"):
            bench_ppo(cfg, rate, budget=2 * args.budget, naive=False, fused=True,
                      reshard=False, logprobs_impl="liger")
    if "tp" in only:
        bench_tp(cfg)
    if "largest" in only:
        bench_largest(rate)
    print_table()
    if args.out and rank0():
        with open(args.out, "w") as f:
            for row in ROWS:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
