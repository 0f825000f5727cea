"""SFT, reward-model and DPO recipes on the addition task (tiny Qwen2 built from its config).

Each is one loop over fsdpfn's public functions:

    sft:  batch = shard_batch(solved problems);        state, s = sft_step(state, batch, cfg.sft)
    rw:   batch = shard_batch(pairs, group_size=2);    state, s = rw_step(critic, batch, cfg.rw)
    dpo:  batch = forward_logp(ref, pairs, "ref_logp"); state, s = dpo_step(state, batch, cfg.dpo)

with held-out evaluation (``evaluate`` with a loss function written here), metrics, a progress
bar, checkpoints on schedule (resumable) and a clean stop on Ctrl-C. Pairs: row 2i the correct
sum (chosen), row 2i+1 a near miss (rejected).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.recipes.runtime import Metrics, Progress, RunContext, is_main, log, \
    mean_sequence_prob
from fsdpfn.recipes.task import CharTokenizer, pair_batch, sft_batch

__all__ = ["run_sft", "run_rw", "run_dpo", "nll_loss", "pairwise_loss"]

HELD_OUT_SEED = 987_654_321


def _engine(cfg, tok: CharTokenizer, *, optimizer, critic: bool = False) -> ff.EngineConfig:
    return ff.EngineConfig(model_config=cfg.model.config_dict(tok.vocab_size), dtype=cfg.dtype,
                           mb_spec=cfg.mb_spec, optimizer=optimizer, is_critic=critic,
                           seed=cfg.model.seed)


# ---------------------------------------------------------------- evaluation losses


def nll_loss(outputs, mb, ctx):
    """−Σ logp over loss tokens (grad_step / evaluate divide by the global token count)."""
    mask = mb[K.LOSS_MASK]
    return -torch.where(mask, outputs[K.LOGP], torch.zeros(())).sum(), {}


def pairwise_loss(outputs, mb, ctx):
    """Bradley-Terry on each row's last-token score (rows 2i chosen, 2i+1 rejected)."""
    last = mb[K.ATTENTION_MASK].long().sum(-1) - 1
    scores = outputs["scores"].gather(-1, last[:, None]).view(-1, 2)
    diff = scores[:, 0] - scores[:, 1]
    return -F.logsigmoid(diff).sum(), {"accuracy": (diff > 0).float().sum()}


# ---------------------------------------------------------------- the shared loop


def _loop(cfg, ctx: RunContext, state, *, make_batch, step_fn, group_size: int = 1,
          evaluate=None, eval_every: int = 0, keys: tuple[str, ...] = ()):
    """Steps 1..cfg.steps (from the checkpoint's step on --resume); returns the final state."""
    mesh = state.mesh
    phase = cfg.recipe
    start = 0
    latest = ff.latest_checkpoint(ctx.run_dir / "checkpoints") if ctx.resume else None
    if latest is not None:
        state, extra = ff.load_checkpoint(state, latest)
        start = int(extra["step"])
        log(f"resumed from {latest} at step {start}")
    metrics = Metrics(ctx.run_dir / "metrics.jsonl",
                      keep_until={phase: start} if ctx.resume else None)
    bar = Progress(phase, cfg.steps, start=start, every=cfg.log.every, enabled=cfg.log.progress)
    for step in range(start + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        batch = make_batch(step)  # the global batch, the same on every rank
        state, stats = step_fn(state, ff.shard_batch(batch, mesh, group_size=group_size))
        seconds = time.perf_counter() - t0
        tokens = int(batch[K.ATTENTION_MASK].sum())
        row = {"phase": phase, "step": step, "loss": float(stats["loss"]),
               **{k: float(stats[k]) for k in keys}, "grad_norm": float(stats["grad_norm"]),
               "tokens_per_s": tokens / seconds, "version": state.version,
               "seconds": seconds}
        if evaluate is not None and eval_every and (step % eval_every == 0 or step == cfg.steps
                                                    or step == start + 1):
            row.update(evaluate(state))
        stop = ctx.stop.agreed()
        every = cfg.checkpoint.every
        if (every and step % every == 0) or step == cfg.steps or stop:
            path = ctx.run_dir / "checkpoints" / f"step_{step:06d}"
            ff.save_checkpoint(state, path, extra={"step": step, "recipe": phase},
                               keep_last=cfg.checkpoint.keep_last)
            row["checkpoint"] = str(path)
        metrics.write(row)
        bar.update(step, loss=row["loss"], **{k: row[k] for k in keys[:2]},
                   **{k: v for k, v in row.items() if k.startswith("eval_")},
                   tok_s=row["tokens_per_s"])
        if stop:
            bar.close()
            log(f"stopped by {ctx.stop.signal_name or 'a signal'} after step {step}; "
                f"checkpoint saved; continue with --resume")
            return state
    bar.close()
    return state


def _seed(cfg, step: int) -> int:
    return cfg.seed * 1_000_003 + step


def _export(state, ctx: RunContext, tok: CharTokenizer) -> Path:
    path = ctx.run_dir / "model"
    ff.export_hf(state, path, dtype="float32")
    if is_main():
        tok.save(path)
    log(f"exported the model to {path} (HF layout + char_vocab.json)")
    return path


# ---------------------------------------------------------------- recipes


def run_sft(cfg, ctx: RunContext):
    mesh = ff.build_mesh(cfg.parallel, device_type=ctx.device)
    tok = CharTokenizer()
    state = ff.shard_model(_engine(cfg, tok, optimizer=cfg.optimizer), mesh)
    held_out = sft_batch(cfg.task, tok, 256, seed=HELD_OUT_SEED)
    held_local = ff.shard_batch(held_out, mesh)

    def evaluate(s):
        loss = float(ff.evaluate(s, held_local, nll_loss)["loss"])
        return {"eval_loss": loss, "eval_p_correct": mean_sequence_prob(s, mesh, held_out)}

    state = _loop(cfg, ctx, state,
                  make_batch=lambda step: sft_batch(cfg.task, tok, cfg.batch_size,
                                                    seed=_seed(cfg, step)),
                  step_fn=lambda s, b: ff.sft_step(s, b, cfg.sft),
                  evaluate=evaluate, eval_every=cfg.eval_every)
    if cfg.export and not ctx.stop.requested:
        _export(state, ctx, tok)


def run_rw(cfg, ctx: RunContext):
    mesh = ff.build_mesh(cfg.parallel, device_type=ctx.device)
    tok = CharTokenizer()
    state = ff.shard_model(_engine(cfg, tok, optimizer=cfg.optimizer, critic=True), mesh)
    held_local = ff.shard_batch(pair_batch(cfg.task, tok, 128, seed=HELD_OUT_SEED), mesh,
                                group_size=2)

    def evaluate(s):
        stats = ff.evaluate(s, held_local, pairwise_loss, normalizer="pairs", require=(),
                            group_size=2, pairs=True)
        return {"eval_loss": float(stats["loss"]), "eval_accuracy": float(stats["accuracy"])}

    _loop(cfg, ctx, state,
          make_batch=lambda step: pair_batch(cfg.task, tok, cfg.pairs_per_step,
                                             seed=_seed(cfg, step)),
          step_fn=lambda s, b: ff.rw_step(s, b, cfg.rw), group_size=2,
          evaluate=evaluate, eval_every=max(cfg.steps // 5, 1), keys=("accuracy", "margin"))


def run_dpo(cfg, ctx: RunContext):
    mesh = ff.build_mesh(cfg.parallel, device_type=ctx.device)
    tok = CharTokenizer()
    state = ff.shard_model(_engine(cfg, tok, optimizer=cfg.optimizer), mesh)
    ref = ff.shard_model(_engine(cfg, tok, optimizer=None), mesh)  # same seed: same weights
    held_out = sft_batch(cfg.task, tok, 256, seed=HELD_OUT_SEED)

    def step_fn(s, local):
        local = ff.forward_logp(ref, local, out_key=K.REF_LOGP)
        return ff.dpo_step(s, local, cfg.dpo)

    _loop(cfg, ctx, state,
          make_batch=lambda step: pair_batch(cfg.task, tok, cfg.pairs_per_step,
                                             seed=_seed(cfg, step)),
          step_fn=step_fn, group_size=2,
          evaluate=lambda s: {"eval_p_correct": mean_sequence_prob(s, mesh, held_out)},
          eval_every=max(cfg.steps // 5, 1), keys=("reward_accuracy", "margin"))
