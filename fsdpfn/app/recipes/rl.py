"""GRPO and PPO recipes with the built-in rollout server, on the user's model, data and reward
(or the embedded addition task).

Per RL step (every rank runs the same code; rank 0 talks to the server and scores):

    examples = source.take(cursor, prompts_per_step)                # the data cursor advances
    outputs  = POST /generate {prompt ids, n=group_size, seed}      # ids + behav_logp (server's)
    rewards  = reward.fn(prompt, completion, answer, sample)        # worker processes, timeout
    batch    = shard_batch(global batch, mesh, group_size)          # this rank's groups
    batch    = forward_logp(ref,   batch, out_key="ref_logp")
    batch    = forward_logp(actor, batch, out_key="old_logp")
    [ppo]      batch = compute_values(critic, batch)
    batch    = compute_advantages(batch, cfg.advantage)             # grpo: group-normalised
    actor, s = ppo_step(actor, batch, cfg.ppo)                      # decoupled PPO (behav_logp)
    [ppo]      critic, c = critic_step(critic, batch, cfg.critic)
    receipt  = push_weights(actor, target)                          # server serves version v+1
    every N:   save_checkpoint(actor, run_dir/checkpoints/step_k, extra={step, data_cursor})

On the embedded task a supervised warm-up (sft_step on solved problems) first makes the model
partially competent; its result (run_dir/sft) is the reference model and RL's starting point.
Each step's metrics row holds the time of every stage (generate, reward, ref_logp, old_logp,
values, train, push), tokens/s, response lengths and the clipped fraction, and reward statistics.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.app.recipes.data import AdditionSource, load_source
from fsdpfn.app.recipes.engine import build_engine, engines, shard
from fsdpfn.app.recipes.model import has_weights, initial_model_dir, load_tokenizer
from fsdpfn.app.recipes.reward import build_reward_pool, reward_spec
from fsdpfn.app.recipes.runtime import (Checkpoints, Metrics, Progress, RunContext,
                                        all_reduce_sum, broadcast_from_main, is_main, log,
                                        mean_sequence_prob, step_stats, with_checkpoint)
from fsdpfn.app.recipes.rollout_stage import build_rollout, sampling, score
from fsdpfn.app.recipes.task import sequences_batch
from fsdpfn.app.run_dir import read_progress  # re-exported: its home is run_dir
from fsdpfn.engine.timing import Phases, peak_tflops
from fsdpfn.rollout.balance import generate_balanced
from fsdpfn.weights import RolloutTarget, push_weights
from fsdpfn.wire.lifeline import freeze_long_lived

__all__ = ["run", "warmup", "greedy_reward", "wait_for_servers", "read_progress"]

WARMUP_MODEL = "sft"       # the warm-up's result: reference model and RL start


def _engine(cfg, ctx: RunContext, model_path: Path, *, optimizer,
            role: str = "engine") -> ff.EngineConfig:
    """The EngineConfig of the policy (``engine``), the reference (``ref_engine``) or the
    critic (``critic_engine``): the YAML's section plus what the recipe owns."""
    return build_engine(engines(cfg)[role], model_path=model_path, device=ctx.device,
                        optimizer=optimizer, seed=cfg.seed, critic=role == "critic_engine")


def _state(cfg, ctx: RunContext, mesh, model_path: Path, *, optimizer,
           role: str = "engine") -> ff.EngineState:
    """``_engine``'s model sharded over ``mesh``; a ConfigError names the YAML key."""
    return shard(_engine(cfg, ctx, model_path, optimizer=optimizer, role=role), mesh, role)


def warmup_steps(cfg) -> int:
    if cfg.warmup.steps is not None:
        return cfg.warmup.steps
    return 0 if cfg.data.from_files else 600


# ---------------------------------------------------------------- warm-up (embedded task)


def warmup(cfg, ctx: RunContext, mesh, tok, metrics: Metrics) -> bool:
    """SFT warm-up from the run's starting model (model.path, or run_dir/model0: the embedded
    model or random_init's) to run_dir/sft, with the tokenizer beside it; False when stopped by
    a signal."""
    run_dir = ctx.run_dir
    w = cfg.warmup
    steps = warmup_steps(cfg)
    state = _state(cfg, ctx, mesh, initial_model_dir(cfg.model, run_dir), optimizer=w.optimizer)
    train = AdditionSource(cfg.task, tok, seed=cfg.seed * 1_000_003 + 17)
    held_out = sequences_batch([(e["ids"], e["loss"]) for e in train.head(256)])
    bar = Progress("warm-up (sft)", steps, every=max(steps // 10, 1), enabled=cfg.log.progress)
    fields: dict = {}
    for i in range(steps):
        t0 = time.perf_counter()
        batch = sequences_batch([(e["ids"], e["loss"])
                                 for e in train.take(i * w.batch_size, w.batch_size)])
        state, stats = ff.sft_step(state, ff.shard_batch(batch, mesh), cfg.warmup.sft)
        seconds = time.perf_counter() - t0
        tokens = int(batch[K.ATTENTION_MASK].sum())
        row = {**step_stats(stats, skip=("tokens",)), "phase": "warmup", "step": i + 1,
               "loss": float(stats["loss"]), "tokens": tokens,
               "loss_tokens": int(stats["tokens"]), "tokens_per_s": tokens / seconds,
               "seconds": seconds}
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
    ff.export_hf(state, run_dir / WARMUP_MODEL, dtype="float32", merged=True)
    if is_main():  # char_vocab.json of the embedded tokenizer, or the model's own tokenizer
        tok.save(run_dir / WARMUP_MODEL)
    dist.barrier()
    return True


# ---------------------------------------------------------------- rollout (rank 0)


def greedy_reward(cfg, ctx: RunContext, tok, held_out, pool, n_prompts: int, *,
                  balancer=None) -> float:
    """Rank 0: the mean reward of greedy answers to held-out prompts (a fixed set); the
    accuracy when rewards are 0/1. Sent through ``balancer`` (the rollout producer's: the
    servers' outstanding work; None: a fresh one over ctx.rollout_urls)."""
    examples = held_out.head(n_prompts)
    answer = generate_balanced(balancer or ctx.rollout_urls,
                               [e["prompt_ids"] for e in examples], n=1,
                               timeout=cfg.rollout.timeout_s, **sampling(cfg, tok, greedy=True))
    rewards = score(pool, tok, examples, answer["outputs"], 1).rewards
    return sum(rewards) / len(rewards)


def wait_for_servers(urls: list[str], timeout: float, *, external: bool = False) -> None:
    """Rank 0: poll every server's /health until each has answered, all within one ``timeout``
    (rollout.health_timeout_s). The launcher starts its servers in parallel with the trainer;
    ``external`` servers (rollout.url) are not started by anyone here: a line says which are
    awaited and for how long, and a failure names those that never answered."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    if external:
        log(f"waiting up to {timeout:g} s (rollout.health_timeout_s) for the external "
            f"rollout server(s) {', '.join(urls)} to answer on /health")
    waiting = list(urls)
    while True:
        waiting = [u for u in waiting if not _healthy(opener, u)]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise ff.WeightSyncError(_no_answer(urls, waiting, timeout, external))
        time.sleep(0.25)


def _healthy(opener, url: str) -> bool:
    try:
        with opener.open(url.rstrip("/") + "/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _no_answer(urls: list[str], waiting: list[str], timeout: float, external: bool) -> str:
    """The failure of wait_for_servers: external servers by URL (they write no log here), a
    server of fsdpfn run's with its log (run_dir/rollout.log, rollout1.log, ...)."""
    if external:
        return (f"rollout.url: every external server must answer /health within "
                f"rollout.health_timeout_s = {timeout:g} s (fsdpfn run starts none; they "
                f"must be up), got no answer from {', '.join(repr(u) for u in waiting)}")
    from fsdpfn.app.recipes.placement import server_log_name

    return (f"rollout server {waiting[0]}: no answer on /health within {timeout:g} s "
            f"(rollout.health_timeout_s); see run_dir/{server_log_name(urls.index(waiting[0]))}")


# ---------------------------------------------------------------- the loop


def _save(cfg, ctx, saves: Checkpoints, actor, critic, step: int, cursor: int, *,
          final: bool) -> dict:
    """Start the checkpoint of ``step`` (saves.save); its metrics."""
    name = f"step_{step:06d}"
    items = []
    if critic is not None:  # the critic first: an actor checkpoint implies its critic's
        items.append((critic, ctx.run_dir / "critic_checkpoints" / name, {"step": step}))
    items.append((actor, ctx.run_dir / "checkpoints" / name,
                  {"step": step, "recipe": cfg.recipe, "data_cursor": cursor}))
    return saves.save(items, final=final)


def run(cfg, ctx: RunContext) -> int:
    """Train; returns the last RL step done (a stop saves a checkpoint of it)."""
    if not ctx.rollout_urls:  # ranks started by hand: said before the warm-up's steps
        raise ff.ConfigError("rollout.url: the RL recipes need a rollout server; run them with "
                             "`fsdpfn run` (which starts one) or set rollout.url")
    mesh = ff.build_mesh(cfg.parallel, device_type=ctx.device)
    tok = load_tokenizer(cfg.model)
    latest = ff.latest_intact_checkpoint(ctx.run_dir / "checkpoints") if ctx.resume else None
    start, cursor = read_progress(latest, cfg.prompts_per_step)
    warm_dir = ctx.run_dir / WARMUP_MODEL
    steps = warmup_steps(cfg)
    warm_done = (warm_dir / "config.json").is_file() and has_weights(warm_dir) \
        and (ctx.resume or steps == 0)
    metrics = Metrics(ctx.run_dir / "metrics.jsonl",
                      keep_until=({cfg.recipe: start, "warmup": 10**9 if warm_done else 0}
                                  if ctx.resume else None),
                      tensorboard=ctx.run_dir / "tensorboard" if cfg.log.tensorboard else None,
                      wandb=cfg.log.wandb)
    if cfg.rollout.url is not None and ctx.rollout_urls:  # external servers: found answering
        # before the warm-up spends its steps (the servers fsdpfn run starts load meanwhile)
        broadcast_from_main(lambda: wait_for_servers(ctx.rollout_urls,
                                                     cfg.rollout.health_timeout_s,
                                                     external=True))
    # 1. supervised warm-up on the embedded task (its result is reused on --resume)
    if steps > 0 and not warm_done:
        if not warmup(cfg, ctx, mesh, tok, metrics):
            return 0
    # 2. actor, reference (and critic), restored from the latest checkpoint on --resume
    source_dir = warm_dir if steps > 0 else initial_model_dir(cfg.model, ctx.run_dir)
    actor, ref, critic = _states(cfg, ctx, mesh, source_dir, latest, start)
    # 3. the rollout server serves the actor's weights from now on
    target = _connect(cfg, ctx, actor)
    if actor.config.timing:  # MFU's peak rate, while the server idles (not under generation ahead)
        peak_tflops(actor)
    # 4. RL steps; rank 0 scores with the reward's worker processes
    pool = build_reward_pool(cfg.reward, default=reward_spec(cfg)) if is_main() else None
    producer = None
    try:
        if pool is not None:
            pool.start()
        data = (load_source(cfg, tok, ctx.run_dir, "train"),
                load_source(cfg, tok, ctx.run_dir, "eval"))
        if is_main():  # generation (ahead of training with rollout.max_staleness)
            producer = build_rollout(cfg, ctx, tok, data[0], pool, cursor=cursor,
                                     version=actor.version, steps=max(0, cfg.steps - start))
        return _train(cfg, ctx, mesh, tok, metrics, actor, ref, critic, target, pool,
                      (*data, producer), start, cursor)
    finally:
        if producer is not None:
            producer.close()
        if pool is not None:
            pool.close()
        metrics.close()


def _states(cfg, ctx: RunContext, mesh, source: Path, latest, start: int):
    actor = _state(cfg, ctx, mesh, source, optimizer=cfg.optimizer)
    ref = None  # with lora: the actor with its adapters disabled (forward_logp adapters=False)
    if cfg.engine.lora is None:
        ref = _state(cfg, ctx, mesh, source, optimizer=None, role="ref_engine")
    critic = None
    if cfg.recipe == "ppo":
        critic = _state(cfg, ctx, mesh, source, optimizer=cfg.critic_optimizer,
                        role="critic_engine")
    if latest is not None:
        actor, _ = ff.load_checkpoint(actor, latest)
        if critic is not None:
            critic, _ = ff.load_checkpoint(critic, ctx.run_dir / "critic_checkpoints" /
                                           latest.name)
        log(f"resumed from {latest} at step {start} (weights version {actor.version})")
    return actor, ref, critic


def _connect(cfg, ctx: RunContext, actor) -> RolloutTarget:
    """One target over every server: each push reaches all of them through one update group
    (their versions and checksums checked against what was sent)."""
    urls = ctx.rollout_urls
    if cfg.rollout.url is None:  # external servers (rollout.url) were awaited before the warm-up
        broadcast_from_main(lambda: wait_for_servers(urls, cfg.rollout.health_timeout_s))
    url = ", ".join(urls)
    target = RolloutTarget(urls, config=push_config(cfg, ctx.transport, ctx.run_dir))
    receipt = push_weights(actor, target)
    log(f"pushed weights version {receipt.version} to {url} by {ctx.transport} "
        f"({receipt.n_tensors} tensors, {receipt.n_bytes / 1e6:.1f} MB, "
        f"{receipt.seconds:.2f} s)")
    return target


def push_config(cfg, transport: str, run_dir) -> ff.PushConfig:
    """The run's PushConfig: ``rollout.push`` and what the recipe owns (the transport placed,
    run_dir/push for disk, generation paused around a push only in the synchronous loop)."""
    return ff.PushConfig(
        transport=transport,
        # generation ahead of training: requests in flight continue on the new weights
        pause_generation=cfg.rollout.max_staleness == 0,
        disk_root=Path(run_dir) / "push" if transport == "disk" else None,
        **attrs.asdict(cfg.rollout.push))


def _train(cfg, ctx: RunContext, mesh, tok, metrics, actor, ref, critic, target, pool, data,
           start: int, cursor: int) -> int:
    source, held_out, producer = data
    held_out = held_out or (source if isinstance(source, AdditionSource) else None)
    bar = Progress(cfg.recipe, cfg.steps, start=start, every=cfg.log.every,
                   enabled=cfg.log.progress)
    step, stop = start, False
    saves = Checkpoints(cfg.checkpoint)
    freeze_long_lived()  # the engines, the server's target, the data: alive until the end
    t_run = time.perf_counter()
    for step in range(start + 1, cfg.steps + 1):
        evaluate = held_out is not None and bool(cfg.eval.every) and (  # as supervised._loop
            step == 1 or step % cfg.eval.every == 0 or step == cfg.steps)
        actor, critic, row = _rl_step(cfg, ctx, mesh, tok, actor, ref, critic, target, pool,
                                      (producer, held_out if evaluate else None), step, cursor)
        cursor += cfg.prompts_per_step
        row["data_cursor"] = cursor
        stop = ctx.stop.agreed()
        if producer is not None and not stop:  # rank 0: the step's weights are served (or
            producer.advance(row["version"])   # kept): generation may run one step further
        if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.steps \
                or stop:
            row.update(_save(cfg, ctx, saves, actor, critic, step, cursor,
                             final=step == cfg.steps or stop))
        else:
            row.update(saves.poll())
        with_checkpoint(row)
        row["elapsed"] = time.perf_counter() - t_run  # the step's checkpoint included
        metrics.write(row)
        bar.update(step, reward=row["reward_mean"], loss=row["loss"],
                   **({"greedy": row["greedy_accuracy"]} if evaluate else {}),
                   len=row["response_len_mean"], tok_s=row["tokens_per_s"], v=row["version"])
        if stop:
            break
    bar.close()
    if stop:
        log(f"stopped by {ctx.stop.signal_name or 'a signal'} after step {step}; its "
            f"checkpoint is saved; continue with --resume")
    target.close()
    return step


def _rl_step(cfg, ctx: RunContext, mesh, tok, actor, ref, critic, target, pool, data,
             step: int, cursor: int):
    """One RL step on every rank; returns (actor, critic, metrics row)."""
    producer, held_out = data
    t0 = time.perf_counter()
    rollout = broadcast_from_main(lambda: producer.step(step, cursor))
    greedy = (broadcast_from_main(lambda: greedy_reward(cfg, ctx, tok, held_out, pool,
                                                        cfg.eval.n_prompts,
                                                        balancer=producer.balancer))
              if held_out is not None else None)
    clock = Phases(ctx.device, key="{}_seconds")  # stage times of the step, in its metrics row
    clock.times["rollout_seconds"] = clock.start - t0  # generate + reward (+ eval), on rank 0
    if rollout["batch"] is None:  # no episode left a trainable row: nothing to train on
        log(f"step {step}: no trainable row ({rollout['stats']}); the weights stay")
        return actor, critic, _empty_row(cfg.recipe, step, rollout, actor, clock.times,
                                         greedy)
    full = TensorDict(rollout["batch"], batch_size=[len(rollout["batch"][K.REWARDS])])
    groups = len(set(full[K.GROUP_ID].tolist())) if K.GROUP_ID in full.keys() else len(full)
    if groups < mesh.dp:  # episodes: a step's rows vary, and a group stays on one rank
        log(f"step {step}: {groups} data row(s) left trainable rows, fewer than the "
            f"{mesh.dp} data-parallel ranks; the step is skipped, the weights stay")
        return actor, critic, _empty_row(cfg.recipe, step, rollout, actor, clock.times,
                                         greedy)
    batch = ff.shard_batch(full, mesh)  # (b, T): whole groups (group_id) on each rank
    batch = _logprob_passes(cfg, actor, ref, batch, clock)
    if critic is not None:
        batch = ff.compute_values(critic, batch)
        clock.mark("values")
    if not rollout["advantages_done"]:  # episodes carry theirs (groups of unequal row counts)
        batch = ff.compute_advantages(batch, cfg.advantage, mesh=mesh)  # dp-global statistics
    ppo = _ppo_config(cfg, batch)
    if len(full) < ppo.n_minibatches:  # episodes: fewer rows this step than minibatches
        log(f"step {step}: {len(full)} rows for ppo.n_minibatches={ppo.n_minibatches}: this "
            f"step takes {len(full)} minibatches of one row")
        ppo = attrs.evolve(ppo, n_minibatches=len(full))
    actor, stats = ff.ppo_step(actor, batch, ppo)
    cstats = None
    if critic is not None:
        critic, cstats = ff.critic_step(critic, batch, cfg.critic)
    gap = (_behav_gap(batch, mesh) if K.OLD_LOGP in batch.keys()
           else float(stats["behav_gap_mean"]) if "behav_gap_mean" in stats.keys() else None)
    clock.mark("train")
    receipt = push_weights(actor, target)
    clock.mark("push")
    times = clock.times
    seconds = time.perf_counter() - t0
    row = _metrics_row(cfg.recipe, step, full, rollout, stats, cstats, receipt, gap, seconds,
                       times)
    if greedy is not None:
        row["greedy_accuracy"] = greedy  # of the weights this step sampled with
    if rollout["advantages_done"]:  # episodes: the minibatches vary with the step's rows
        row["n_minibatches"] = ppo.n_minibatches
    return actor, critic, row


def needed_passes(cfg) -> tuple[bool, bool]:
    """(reference pass, old log-prob pass): the reference only for a KL term (in the loss or
    in the reward); old_logp only where the training forward cannot stand in for it exactly
    (several minibatches without old_logp_from 'behav', or a KL-in-reward that reads it)."""
    ref = cfg.ppo.kl_coef > 0 or cfg.advantage.kl_coef > 0
    forward_stands_in = cfg.ppo.old_logp_from == "behav" or cfg.ppo.n_minibatches == 1
    return ref, not forward_stands_in or cfg.advantage.kl_coef > 0


def _ppo_config(cfg, batch) -> ff.PPOConfig:
    """cfg.ppo, told to take old_logp from the training forward when the recipe skipped that
    pass (one minibatch: exact, the ratio is 1 by construction)."""
    if K.OLD_LOGP in batch.keys() or cfg.ppo.old_logp_from != "batch":
        return cfg.ppo
    return attrs.evolve(cfg.ppo, old_logp_from="forward")


def _logprob_passes(cfg, actor, ref, batch, clock):
    """The reference and old log-prob passes the update needs (needed_passes), timed."""
    need_ref, need_old = needed_passes(cfg)
    clock.times.update(ref_logp_pass=int(need_ref), old_logp_pass=int(need_old))
    T = cfg.ppo.temperature
    if need_ref:
        batch = (ff.forward_logp(ref, batch, out_key=K.REF_LOGP, temperature=T)
                 if ref is not None else
                 ff.forward_logp(actor, batch, out_key=K.REF_LOGP, temperature=T,
                                 adapters=False))
    clock.mark("ref_logp")
    if need_old:
        batch = ff.forward_logp(actor, batch, out_key=K.OLD_LOGP, temperature=T)
    clock.mark("old_logp")
    return batch


def _empty_row(phase, step, rollout, actor, times, greedy=None) -> dict:
    """The metrics row of a step that trained nothing (its held-out evaluation, if it made
    one, included: the weights it sampled with were evaluated all the same)."""
    return {"phase": phase, "step": step, "version": actor.version,
            "served_version": rollout["served_version"], **rollout["stats"], **times,
            "seconds": sum(v for k, v in times.items() if k.endswith("_seconds")),
            "reward_mean": float("nan"), "loss": float("nan"), "tokens_per_s": 0.0,
            "response_len_mean": rollout["stats"].get("response_len_mean", 0.0),
            **({} if greedy is None else {"greedy_accuracy": greedy})}


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
           "grad_norm": float(stats["grad_norm"]), "loss_tokens": int(stats["tokens"]),
           **rollout["stats"],
           "tokens": tokens, "tokens_per_s": tokens / seconds, "version": receipt.version,
           "served_version": rollout["served_version"], "behav_gap": gap,
           "seconds": seconds, **times}
    # generation ahead of training: its own span, not the trainer's (near zero) wait for it
    span = row.get("generation_span_seconds") or row["generate_seconds"]
    row["generated_tokens_per_s"] = row["generated_tokens"] / max(span, 1e-9)
    for name, value in step_stats(stats).items():  # every other stat (corrections, ...)
        row.setdefault(name, value)
    if cstats is not None:  # every stat of critic_step, prefixed (value_mean as it was)
        row.update(critic_loss=float(cstats["loss"]), value_mean=float(cstats["value_mean"]))
        for name, value in step_stats(cstats).items():
            row.setdefault("critic_" + name, value)
    return row


def _behav_gap(batch, mesh) -> float:
    """Mean |old_logp − behav_logp| over loss tokens (all ranks): how far the server's sampling
    distribution is from the trainer's (0 up to float noise when the push is in sync)."""
    mask = batch[K.LOSS_MASK]
    diff = (batch[K.OLD_LOGP] - batch[K.BEHAV_LOGP]).abs()
    totals = torch.tensor([float(torch.where(mask, diff, torch.zeros((), device=diff.device))
                                 .sum()), float(mask.sum())], dtype=torch.float64)
    totals = all_reduce_sum(totals, mesh.group("dp") if mesh.dp > 1 else None)
    return float(totals[0] / max(float(totals[1]), 1.0))
