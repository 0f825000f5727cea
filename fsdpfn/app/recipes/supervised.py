"""SFT, reward-model and DPO recipes on the user's model and data (or the embedded addition task).

Each is one loop over fsdpfn's public functions:

    sft:  batch = shard_batch(examples);               state, s = sft_step(state, batch, cfg.sft)
    rw:   batch = shard_batch(pairs, group_size=2);    state, s = rw_step(critic, batch, cfg.rw)
    dpo:  batch = forward_logp(ref, pairs, "ref_logp"); state, s = dpo_step(state, batch, cfg.dpo)

with held-out evaluation (``evaluate`` with a loss function written here), metrics, a progress
bar, checkpoints on schedule (resumable: the data cursor is saved in each checkpoint) and a clean
stop on Ctrl-C. SFT examples carry their loss mask (the response, or a chat's assistant turns);
pairs: row 2i the chosen response, row 2i+1 the rejected one (on the embedded task: the correct
sum against a near miss).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.algos import dpo_objective
from fsdpfn.app.recipes.data import load_source
from fsdpfn.app.recipes.engine import build_engine, engines, shard
from fsdpfn.app.recipes.model import initial_model_dir, load_tokenizer
from fsdpfn.app.recipes.runtime import Checkpoints, Metrics, Progress, RunContext, is_main, \
    log, mean_sequence_prob, step_stats, with_checkpoint
from fsdpfn.app.recipes.task import sequences_batch
from fsdpfn.wire.lifeline import freeze_long_lived

__all__ = ["run_sft", "run_rw", "run_dpo", "nll_loss", "pairwise_loss"]

HELD_OUT_SEED = 987_654_321


def _engine(cfg, ctx: RunContext, *, optimizer, critic: bool = False,
            role: str = "engine") -> ff.EngineConfig:
    """The YAML's ``engine`` (or ``ref_engine``) section plus what the recipe owns; the rw
    model is a critic."""
    return build_engine(engines(cfg)[role], model_path=initial_model_dir(cfg.model, ctx.run_dir),
                        device=ctx.device, optimizer=optimizer, seed=cfg.seed,
                        critic=critic)


def _state(cfg, ctx: RunContext, mesh, *, role: str = "engine", **kwargs) -> ff.EngineState:
    """``_engine``'s model sharded over ``mesh``; a ConfigError names the YAML key."""
    return shard(_engine(cfg, ctx, role=role, **kwargs), mesh, role)


def _sft_batch(examples):
    return sequences_batch([(e["ids"], e["loss"]) for e in examples])


def _pair_batch(examples):
    return sequences_batch([seq for e in examples for seq in (e["chosen"], e["rejected"])])


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


def _loop(cfg, ctx: RunContext, state, *, source, per_step: int, make_batch, step_fn,
          group_size: int = 1, evaluate=None, eval_every: int = 0, keys: tuple[str, ...] = ()):
    """Steps 1..cfg.steps (from the checkpoint's step and data cursor on --resume); returns the
    final state. Step k trains on examples [cursor, cursor + per_step) of ``source``."""
    mesh = state.mesh
    phase = cfg.recipe
    start, cursor = 0, 0
    latest = ff.latest_intact_checkpoint(ctx.run_dir / "checkpoints") if ctx.resume else None
    if latest is not None:
        state, extra = ff.load_checkpoint(state, latest)
        start = int(extra["step"])
        cursor = int(extra.get("data_cursor", start * per_step))
        log(f"resumed from {latest} at step {start}")
    metrics = Metrics(ctx.run_dir / "metrics.jsonl",
                      keep_until={phase: start} if ctx.resume else None,
                      tensorboard=ctx.run_dir / "tensorboard" if cfg.log.tensorboard else None,
                      wandb=cfg.log.wandb)
    bar = Progress(phase, cfg.steps, start=start, every=cfg.log.every, enabled=cfg.log.progress)
    saves = Checkpoints(cfg.checkpoint)
    freeze_long_lived()  # the engine and the data: alive until the end
    began = time.perf_counter()
    for step in range(start + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        batch = make_batch(source.take(cursor, per_step))  # the global batch, on every rank
        first, cursor = cursor, cursor + per_step
        state, stats = step_fn(state, ff.shard_batch(batch, mesh, group_size=group_size))
        seconds = time.perf_counter() - t0
        tokens = int(batch[K.ATTENTION_MASK].sum())
        row = {**step_stats(stats),  # the step's time_* parts, lr, ...; the row's own below
               "phase": phase, "step": step, "loss": float(stats["loss"]),
               **{k: float(stats[k]) for k in keys}, "grad_norm": float(stats["grad_norm"]),
               "tokens": tokens, "loss_tokens": int(stats["tokens"]),
               "tokens_per_s": tokens / seconds, "version": state.version,
               "seconds": seconds, "data_first": first, "data_last": cursor - 1,
               "data_cursor": cursor}
        # the run's first step (the initial weights' baseline), every N and the last: a
        # resumption keeps the cadence of the run it continues
        if evaluate is not None and eval_every and (step % eval_every == 0 or step == cfg.steps
                                                    or step == 1):
            t_eval = time.perf_counter()
            row.update(evaluate(state))
            row["eval_seconds"] = time.perf_counter() - t_eval
        stop = ctx.stop.agreed()
        every = cfg.checkpoint.every
        if (every and step % every == 0) or step == cfg.steps or stop:
            path = ctx.run_dir / "checkpoints" / f"step_{step:06d}"
            row.update(saves.save([(state, path, {"step": step, "recipe": phase,
                                                  "data_cursor": cursor})],
                                  final=step == cfg.steps or stop))
        else:
            row.update(saves.poll())
        with_checkpoint(row)
        row["elapsed"] = time.perf_counter() - began  # the step's evaluation and save included
        metrics.write(row)
        bar.update(step, loss=row["loss"], **{k: row[k] for k in keys[:2]},
                   **{k: v for k, v in row.items()
                      if k.startswith("eval_") and k != "eval_seconds"},
                   tok_s=row["tokens_per_s"])
        if stop:
            bar.close()
            metrics.close()
            log(f"stopped by {ctx.stop.signal_name or 'a signal'} after step {step}; "
                f"checkpoint saved; continue with --resume")
            return state
    bar.close()
    metrics.close()
    return state


def _export(state, ctx: RunContext, tok) -> Path:
    path = ctx.run_dir / "model"
    ff.export_hf(state, path, dtype=ctx.dtype, merged=True)  # with lora: adapters folded in
    if is_main():
        tok.save(path)
    log(f"exported the model to {path} (HF layout, with its tokenizer)")
    return path


def _held_out(cfg, ctx, tok, n: int):
    """Held-out examples: the eval files, or the embedded task's held-out problems."""
    held = load_source(cfg, tok, ctx.run_dir, "eval")
    if held is None and not cfg.data.from_files:
        held = load_source(cfg, tok, ctx.run_dir, "train")
    if held is None:
        if cfg.eval_every != 0:  # said once, rather than evaluating nothing without a word
            log("no held-out evaluation: data.train_files without data.eval_files (eval_every "
                "applies to the eval files' rows)")
        return None
    if cfg.data.eval_size is not None:
        return held.head(cfg.data.eval_size)
    # null: every held-out row of the eval files; the embedded task's endless stream: n
    return held.head(len(held) if cfg.data.from_files else n)


# ---------------------------------------------------------------- recipes


def run_sft(cfg, ctx: RunContext):
    mesh = ff.build_mesh(cfg.parallel, device_type=ctx.device)
    tok = load_tokenizer(cfg.model)
    state = _state(cfg, ctx, mesh, optimizer=cfg.optimizer)
    held = _held_out(cfg, ctx, tok, 256)
    evaluate = None
    if held:
        held_out = _sft_batch(held)
        held_local = ff.shard_batch(held_out, mesh)

        def evaluate(s):
            loss = float(ff.evaluate(s, held_local, nll_loss)["loss"])
            return {"eval_loss": loss, "eval_p_correct": mean_sequence_prob(s, mesh, held_out)}

    state = _loop(cfg, ctx, state, source=load_source(cfg, tok, ctx.run_dir, "train"),
                  per_step=cfg.batch_size, make_batch=_sft_batch,
                  step_fn=lambda s, b: ff.sft_step(s, b, cfg.sft),
                  evaluate=evaluate, eval_every=_eval_every(cfg))
    if cfg.export and not ctx.stop.requested:
        _export(state, ctx, tok)


def run_rw(cfg, ctx: RunContext):
    mesh = ff.build_mesh(cfg.parallel, device_type=ctx.device)
    tok = load_tokenizer(cfg.model)
    state = _state(cfg, ctx, mesh, optimizer=cfg.optimizer, critic=True)
    held = _held_out(cfg, ctx, tok, 128)
    evaluate = None
    if held:
        held_local = ff.shard_batch(_pair_batch(held), mesh, group_size=2)

        def evaluate(s):
            stats = ff.evaluate(s, held_local, ff.Objective(
                pairwise_loss, normalizer="pairs", require=(), group_size=2, pairs=True))
            return {"eval_loss": float(stats["loss"]),
                    "eval_accuracy": float(stats["accuracy"])}

    _loop(cfg, ctx, state, source=load_source(cfg, tok, ctx.run_dir, "train"),
          per_step=cfg.pairs_per_step, make_batch=_pair_batch,
          step_fn=lambda s, b: ff.rw_step(s, b, cfg.rw), group_size=2,
          evaluate=evaluate, eval_every=_eval_every(cfg), keys=("accuracy", "margin"))


def run_dpo(cfg, ctx: RunContext):
    mesh = ff.build_mesh(cfg.parallel, device_type=ctx.device)
    tok = load_tokenizer(cfg.model)
    state = _state(cfg, ctx, mesh, optimizer=cfg.optimizer)
    ref = None  # with lora: the policy with its adapters disabled, no second model
    if cfg.engine.lora is None:
        # the same initial weights
        ref = _state(cfg, ctx, mesh, optimizer=None, role="ref_engine")
    held = _held_out(cfg, ctx, tok, 256)

    def step_fn(s, local):
        local = (ff.forward_logp(ref, local, out_key=K.REF_LOGP) if ref is not None
                 else ff.forward_logp(s, local, out_key=K.REF_LOGP, adapters=False))
        return ff.dpo_step(s, local, cfg.dpo)

    evaluate = None
    if held:
        held_out = _sft_batch([{"ids": e["chosen"][0], "loss": e["chosen"][1]} for e in held])
        # the held-out pairs' reference log-probs, once: the reference never changes (with
        # lora it is the base model, the adapters off, whatever they have learnt)
        pairs = ff.shard_batch(_pair_batch(held), mesh, group_size=2)
        pairs = (ff.forward_logp(ref, pairs, out_key=K.REF_LOGP) if ref is not None
                 else ff.forward_logp(state, pairs, out_key=K.REF_LOGP, adapters=False))
        objective = dpo_objective(cfg.dpo)

        def evaluate(s):
            stats = ff.evaluate(s, pairs, objective)
            return {"eval_loss": float(stats["loss"]),
                    "eval_reward_accuracy": float(stats["reward_accuracy"]),
                    "eval_p_correct": mean_sequence_prob(s, mesh, held_out)}

    _loop(cfg, ctx, state, source=load_source(cfg, tok, ctx.run_dir, "train"),
          per_step=cfg.pairs_per_step, make_batch=_pair_batch, step_fn=step_fn, group_size=2,
          evaluate=evaluate, eval_every=_eval_every(cfg),
          keys=("reward_accuracy", "margin"))


def _eval_every(cfg) -> int:
    """A supervised recipe's ``eval_every``: null is a fifth of the run (0: off)."""
    return max(cfg.steps // 5, 1) if cfg.eval_every is None else cfg.eval_every
