"""GRPO and PPO recipes on the addition task, with the built-in rollout server.

Per RL step (every rank runs the same code; rank 0 talks to the server):

    prompts  = task.sample(prompts_per_step)                       # rank 0
    outputs  = POST /generate {prompts, n=group_size, seed}        # ids + behav_logp (server's)
    rewards  = task.reward(parse(outputs))                         # 1.0 when the sum is right
    batch    = shard_batch(global batch, mesh, group_size)         # this rank's groups
    batch    = forward_logp(ref,   batch, out_key="ref_logp")
    batch    = forward_logp(actor, batch, out_key="old_logp")
    [ppo]      batch = compute_values(critic, batch)
    batch    = compute_advantages(batch, cfg.advantage)            # grpo: group-normalised
    actor, s = ppo_step(actor, batch, cfg.ppo)                     # decoupled PPO (behav_logp)
    [ppo]      critic, c = critic_step(critic, batch, cfg.critic)
    receipt  = push_weights(actor, target)                         # server serves version v+1
    every N:   save_checkpoint(actor, run_dir/checkpoints/step_k)

Before RL, a supervised warm-up (sft_step on solved problems) makes the model partially
competent; its result (run_dir/sft) is the reference model and RL's starting point.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.recipes.runtime import (Metrics, Progress, RunContext, broadcast_from_main,
                                    is_main, log, mean_sequence_prob)
from fsdpfn.recipes.task import (AdditionTask, CharTokenizer, rollout_batch, sft_batch)
from fsdpfn.weights import RolloutTarget, push_weights
from fsdpfn.rollout import generate

__all__ = ["run", "warmup", "generate", "greedy_accuracy"]

INITIAL_MODEL = "model0"   # written by the launcher (random init + char_vocab.json)
WARMUP_MODEL = "sft"       # the warm-up's result: reference model and RL start


def _engine(cfg, model_path: Path, *, optimizer, critic: bool = False) -> ff.EngineConfig:
    return ff.EngineConfig(model_path=str(model_path), dtype=cfg.dtype, mb_spec=cfg.mb_spec,
                           optimizer=optimizer, is_critic=critic, seed=cfg.seed)


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


# ---------------------------------------------------------------- warm-up


def warmup(cfg, ctx: RunContext, mesh, tok: CharTokenizer, metrics: Metrics) -> bool:
    """SFT warm-up from run_dir/model0 to run_dir/sft; False when stopped by a signal."""
    run_dir = ctx.run_dir
    w = cfg.warmup
    state = ff.shard_model(_engine(cfg, run_dir / INITIAL_MODEL, optimizer=w.optimizer), mesh)
    held_out = sft_batch(cfg.task, tok, 256, seed=cfg.seed * 1_000_003 + 999_999)
    bar = Progress("warm-up (sft)", w.steps, every=max(w.steps // 10, 1),
                   enabled=cfg.log.progress)
    fields: dict = {}
    for i in range(w.steps):
        t0 = time.perf_counter()
        batch = sft_batch(cfg.task, tok, w.batch_size, seed=cfg.seed * 1_000_003 + 17 + i)
        state, stats = ff.sft_step(state, ff.shard_batch(batch, mesh), ff.SFTConfig())
        seconds = time.perf_counter() - t0
        tokens = int(batch[K.ATTENTION_MASK].sum())
        row = {"phase": "warmup", "step": i + 1, "loss": float(stats["loss"]),
               "tokens_per_s": tokens / seconds, "seconds": seconds}
        done = False
        if w.target_reward is not None and (i + 1) % w.check_every == 0:
            row["expected_reward"] = mean_sequence_prob(state, mesh, held_out)
            fields["p_correct"] = row["expected_reward"]
            done = row["expected_reward"] >= w.target_reward
        metrics.write(row)
        bar.update(i + 1, loss=row["loss"], **fields, tok_s=row["tokens_per_s"])
        if done:
            bar.close()
            log(f"warm-up reached expected reward {row['expected_reward']:.3f} >= "
                f"{w.target_reward} after {i + 1} steps")
            break
        if ctx.stop.agreed():
            bar.close()
            log(f"stopped during the warm-up at step {i + 1} (nothing saved; it reruns on "
                f"--resume)")
            return False
    else:
        bar.close()
    ff.export_hf(state, run_dir / WARMUP_MODEL, dtype="float32")
    if is_main():
        shutil.copy(run_dir / INITIAL_MODEL / "char_vocab.json", run_dir / WARMUP_MODEL)
    dist.barrier()
    return True


# ---------------------------------------------------------------- rollout (rank 0)


def _rollout(cfg, url: str, tok: CharTokenizer, step: int) -> dict:
    """Rank 0: one step's global batch (as plain tensors) and its rollout statistics."""
    task: AdditionTask = cfg.task
    G = cfg.advantage.group_size
    problems = task.sample(cfg.prompts_per_step, seed=cfg.seed * 1_000_003 + 1_000 + step)
    prompts = [cfg.task.prompt_ids(tok, a, b) for a, b in problems]
    answer = generate(url, prompts, n=G, max_new_tokens=task.max_answer_tokens,
                      temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                      seed=cfg.seed * 1_000_003 + step, stop_token_ids=[tok.eos_id],
                      timeout=cfg.rollout.timeout_s)
    outputs = answer["outputs"]
    rewards = [task.reward(*problems[i // G], tok.decode(o["output_ids"]))
               for i, o in enumerate(outputs)]
    batch = rollout_batch(prompts, outputs, G, rewards)
    return {"batch": batch.to_dict(), "served_version": answer["weight_version"],
            "response_len": sum(len(o["output_ids"]) for o in outputs) / len(outputs)}


def greedy_accuracy(cfg, url: str, tok: CharTokenizer, n_prompts: int) -> float:
    """Rank 0: exact-match rate of greedy answers on held-out problems (a fixed set)."""
    problems = cfg.task.sample(n_prompts, seed=987_654_321)
    prompts = [cfg.task.prompt_ids(tok, a, b) for a, b in problems]
    answer = generate(url, prompts, n=1, max_new_tokens=cfg.task.max_answer_tokens,
                      temperature=0.0, stop_token_ids=[tok.eos_id],
                      timeout=cfg.rollout.timeout_s)
    hits = [cfg.task.reward(a, b, tok.decode(o["output_ids"]))
            for (a, b), o in zip(problems, answer["outputs"])]
    return sum(hits) / len(hits)


def wait_for_server(url: str, timeout: float) -> None:
    """Rank 0: poll /health until the server answers (the launcher starts it in parallel)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while True:
        try:
            with opener.open(url.rstrip("/") + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ff.WeightSyncError(f"rollout server {url}: no answer on /health within "
                                     f"{timeout:.0f} s (rollout.health_timeout_s); see "
                                     f"run_dir/rollout.log")
        time.sleep(0.25)


# ---------------------------------------------------------------- the loop


def _resume_point(ctx: RunContext):
    if not ctx.resume:
        return None
    return ff.latest_checkpoint(ctx.run_dir / "checkpoints")


def _save(cfg, ctx, actor, critic, step: int) -> Path:
    name = f"step_{step:06d}"
    if critic is not None:  # the critic first: an actor checkpoint implies its critic's
        ff.save_checkpoint(critic, ctx.run_dir / "critic_checkpoints" / name,
                           extra={"step": step}, keep_last=cfg.checkpoint.keep_last)
    path = ctx.run_dir / "checkpoints" / name
    ff.save_checkpoint(actor, path, extra={"step": step, "recipe": cfg.recipe},
                       keep_last=cfg.checkpoint.keep_last)
    return path


def run(cfg, ctx: RunContext) -> int:
    """Train; returns the last RL step done (a stop saves a checkpoint of it)."""
    mesh = ff.build_mesh(cfg.parallel, device_type=ctx.device)
    tok = CharTokenizer()
    latest = _resume_point(ctx)
    start = read_step(latest) if latest is not None else 0
    warm_dir = ctx.run_dir / WARMUP_MODEL
    warm_done = _is_model_dir(warm_dir) and (ctx.resume or cfg.warmup.steps == 0)
    metrics = Metrics(ctx.run_dir / "metrics.jsonl",
                      keep_until=({cfg.recipe: start, "warmup": 10**9 if warm_done else 0}
                                  if ctx.resume else None))
    # 1. supervised warm-up (its result is reused on --resume)
    if cfg.warmup.steps > 0 and not warm_done:
        if not warmup(cfg, ctx, mesh, tok, metrics):
            return 0
    # 2. actor, reference (and critic), restored from the latest checkpoint on --resume
    source = warm_dir if cfg.warmup.steps > 0 else ctx.run_dir / INITIAL_MODEL
    actor, ref, critic = _states(cfg, ctx, mesh, source, latest, start)
    # 3. the rollout server serves the actor's weights from now on
    target = _connect(cfg, ctx, actor)
    # 4. RL steps
    return _train(cfg, ctx, mesh, tok, metrics, actor, ref, critic, target, start)


def _states(cfg, ctx: RunContext, mesh, source: Path, latest, start: int):
    actor = ff.shard_model(_engine(cfg, source, optimizer=cfg.optimizer), mesh)
    ref = ff.shard_model(_engine(cfg, source, optimizer=None), mesh)
    critic = None
    if cfg.recipe == "ppo":
        critic = ff.shard_model(_engine(cfg, source, optimizer=cfg.critic_optimizer,
                                        critic=True), mesh)
    if latest is not None:
        actor, _ = ff.load_checkpoint(actor, latest)
        if critic is not None:
            critic, _ = ff.load_checkpoint(critic, ctx.run_dir / "critic_checkpoints" /
                                           latest.name)
        log(f"resumed from {latest} at step {start} (weights version {actor.version})")
    return actor, ref, critic


def _connect(cfg, ctx: RunContext, actor) -> RolloutTarget:
    url = ctx.rollout_url
    if url is None:
        raise ff.ConfigError("rollout.url: the RL recipes need a rollout server; run them with "
                             "`fsdpfn run` (which starts one) or set rollout.url")
    broadcast_from_main(lambda: wait_for_server(url, cfg.rollout.health_timeout_s))
    disk = cfg.rollout.transport == "disk"
    target = RolloutTarget(url, transport=cfg.rollout.transport, timeout_s=cfg.rollout.timeout_s,
                           disk_root=ctx.run_dir / "push" if disk else None)
    receipt = push_weights(actor, target)
    log(f"pushed weights version {receipt.version} to {url} ({receipt.n_tensors} tensors, "
        f"{receipt.n_bytes / 1e6:.1f} MB, {receipt.seconds:.2f} s)")
    return target


def _train(cfg, ctx: RunContext, mesh, tok, metrics, actor, ref, critic, target,
           start: int) -> int:
    bar = Progress(cfg.recipe, cfg.steps, start=start, every=cfg.log.every,
                   enabled=cfg.log.progress)
    step, stop = start, False
    t_run = time.perf_counter()
    for step in range(start + 1, cfg.steps + 1):
        evaluate = bool(cfg.eval.every) and (step == start + 1 or step % cfg.eval.every == 0
                                             or step == cfg.steps)
        actor, critic, row = _rl_step(cfg, ctx, mesh, tok, actor, ref, critic, target, step,
                                      evaluate)
        row["elapsed"] = time.perf_counter() - t_run
        stop = ctx.stop.agreed()
        if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.steps \
                or stop:
            row["checkpoint"] = str(_save(cfg, ctx, actor, critic, step))
        metrics.write(row)
        bar.update(step, reward=row["reward_mean"], loss=row["loss"],
                   **({"greedy": row["greedy_accuracy"]} if evaluate else {}),
                   tok_s=row["tokens_per_s"], v=row["version"])
        if stop:
            break
    bar.close()
    if stop:
        log(f"stopped by {ctx.stop.signal_name or 'a signal'} after step {step}; its "
            f"checkpoint is saved; continue with --resume")
    target.close()
    return step


def _rl_step(cfg, ctx: RunContext, mesh, tok, actor, ref, critic, target, step: int,
             evaluate: bool):
    """One RL step on every rank; returns (actor, critic, metrics row)."""
    url = ctx.rollout_url
    t0 = time.perf_counter()
    rollout = broadcast_from_main(lambda: _rollout(cfg, url, tok, step))
    greedy = (broadcast_from_main(lambda: greedy_accuracy(cfg, url, tok, cfg.eval.n_prompts))
              if evaluate else None)
    t_rollout = time.perf_counter()
    full = TensorDict(rollout["batch"], batch_size=[len(rollout["batch"][K.REWARDS])])
    batch = ff.shard_batch(full, mesh, group_size=cfg.advantage.group_size)  # (b, T), groups
    batch = ff.forward_logp(ref, batch, out_key=K.REF_LOGP, temperature=cfg.ppo.temperature)
    batch = ff.forward_logp(actor, batch, out_key=K.OLD_LOGP, temperature=cfg.ppo.temperature)
    if critic is not None:
        batch = ff.compute_values(critic, batch)
    batch = ff.compute_advantages(batch, cfg.advantage)
    t_logp = time.perf_counter()
    actor, stats = ff.ppo_step(actor, batch, cfg.ppo)
    cstats = None
    if critic is not None:
        critic, cstats = ff.critic_step(critic, batch, cfg.critic)
    gap = _behav_gap(batch, mesh)
    t_update = time.perf_counter()
    receipt = push_weights(actor, target)
    seconds = time.perf_counter() - t0
    row = _metrics_row(cfg.recipe, step, full, rollout, stats, cstats, receipt, gap, seconds,
                       times={"rollout_seconds": t_rollout - t0,
                              "logp_seconds": t_logp - t_rollout,
                              "update_seconds": t_update - t_logp,
                              "push_seconds": receipt.seconds})
    if greedy is not None:
        row["greedy_accuracy"] = greedy  # of the weights this step sampled with
    return actor, critic, row


def _metrics_row(phase, step, full, rollout, stats, cstats, receipt, gap, seconds,
                 times) -> dict:
    """One metrics.jsonl line: rollout statistics (over the global batch), the update's stats
    (already reduced over ranks), the pushed weights version, and where the time went."""
    rewards = full[K.REWARDS]
    tokens = int(full[K.ATTENTION_MASK].sum())
    row = {"phase": phase, "step": step, "reward_mean": float(rewards.mean()),
           "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
           "loss": float(stats["loss"]), "pg_loss": float(stats["pg_loss"]),
           "kl": float(stats["kl"]) if "kl" in stats.keys() else None,
           "approx_kl": float(stats["approx_kl"]), "clip_frac": float(stats["clip_frac"]),
           "grad_norm": float(stats["grad_norm"]), "response_len": rollout["response_len"],
           "tokens": tokens, "tokens_per_s": tokens / seconds, "version": receipt.version,
           "served_version": rollout["served_version"], "behav_gap": gap,
           "seconds": seconds, **times}
    if cstats is not None:
        row.update(critic_loss=float(cstats["loss"]), value_mean=float(cstats["value_mean"]))
    return row


def _behav_gap(batch, mesh) -> float:
    """Mean |old_logp − behav_logp| over loss tokens (all ranks): how far the server's sampling
    distribution is from the trainer's (0 up to float noise when the push is in sync)."""
    mask = batch[K.LOSS_MASK]
    diff = (batch[K.OLD_LOGP] - batch[K.BEHAV_LOGP]).abs()
    totals = torch.tensor([float(torch.where(mask, diff, torch.zeros(())).sum()),
                           float(mask.sum())], dtype=torch.float64)
    if mesh.dp > 1:
        dist.all_reduce(totals, group=mesh.group("dp"))
    return float(totals[0] / max(totals[1], 1.0))


def read_step(path: Path) -> int:
    """The recipe step a checkpoint was saved at (its ``extra["step"]``), from its manifest."""
    manifest = json.loads((path / "fsdpfn.json").read_text())
    extra = manifest.get("extra") or {}
    return int(extra.get("step", manifest.get("step", 0)))
