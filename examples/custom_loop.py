"""custom_loop.py: a training loop composed by hand from fsdpfn's public functions, with your
own loss function passed to grad_step.

What it does: on 1-digit addition (the embedded task: a character tokenizer and a tiny Qwen2
built in code, nothing downloaded) it
  1. writes the initial model and starts the built-in rollout server (rank 0),
  2. warms the model up with sft_step, exports it with export_hf (the reference model),
  3. runs REINFORCE with a leave-one-out baseline and a k3 KL penalty, written below as a
     ``loss_fn(outputs, minibatch, ctx) -> (loss_sum, stats)`` for ``ff.grad_step``:
     rollout on the server (rows tagged with a group_id per problem) -> shard_batch (whole
     groups per rank) -> forward_logp (ref, old) -> compute_advantages (RLOO, groups checked)
     -> grad_step -> push_weights -> save_checkpoint.

Run it (CPU, about 30 s):

    python examples/custom_loop.py                          # one rank
    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 \
        examples/custom_loop.py --steps 20                  # two ranks (gloo)

It prints one line per step (reward, loss, kl, weights version) and leaves
runs/custom_loop/ (model, checkpoints). Compare with fsdpfn/app/recipes/rl.py, the same loop
with ppo_step instead of a custom loss.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.app.recipes.task import (AdditionTask, CharTokenizer, TinyModel, save_initial_model,
                                     sft_batch)
from fsdpfn.rollout import generate, launch_server
from fsdpfn.weights import RolloutTarget, push_weights


# ---------------------------------------------------------------- the custom loss


def reinforce_kl_loss(kl_coef: float):
    """REINFORCE (importance-weighted by π/π_old, so several minibatches stay on-policy enough)
    plus kl_coef · KL_k3(π ‖ π_ref), summed over response tokens.

    grad_step divides loss_sum (and every stat) by the number of loss tokens of the whole
    minibatch over all ranks, so the gradient does not depend on how rows are split."""

    def loss_fn(outputs, mb, ctx):
        mask = mb[K.LOSS_MASK]                                   # (b, T) response tokens
        logp = outputs[K.LOGP]                                   # (b, T) log π, with grad
        ratio = torch.exp(logp - mb[K.OLD_LOGP])                 # 1 at the first minibatch
        pg = -mb[K.ADVANTAGES] * ratio                           # (b, T)
        kl = ff.ops.kl(logp, mb[K.REF_LOGP], "k3")               # (b, T)
        zero = torch.zeros((), device=logp.device)
        loss_sum = torch.where(mask, pg + kl_coef * kl, zero).sum()
        return loss_sum, {"kl": torch.where(mask, kl, zero).sum().detach(),
                          "pg_loss": torch.where(mask, pg, zero).sum().detach()}

    return loss_fn


# ---------------------------------------------------------------- helpers


def from_rank0(fn):
    """fn() on rank 0, its result on every rank."""
    box = [fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rollout(url, task, tok, n_prompts, group_size, seed) -> dict:
    """Rank 0: sample group_size answers per problem; the public batch with rewards, the
    server's behav_logp and group_id (the problem each row answers), as a plain dict."""
    problems = task.sample(n_prompts, seed=seed)
    prompts = [task.prompt_ids(tok, a, b) for a, b in problems]
    answer = generate(url, prompts, n=group_size, max_new_tokens=task.max_answer_tokens,
                      temperature=1.0, stop_token_ids=[tok.eos_id], seed=seed)
    outputs = answer["outputs"]
    rewards = [task.reward(*problems[i // group_size], tok.decode(o["output_ids"]))
               for i, o in enumerate(outputs)]
    batch = ff.rollout_batch(prompts, outputs, group_size, rewards)
    batch.set(K.GROUP_ID, torch.arange(n_prompts).repeat_interleave(group_size))
    return batch.to_dict()


# ---------------------------------------------------------------- the loop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=15, help="RL steps")
    p.add_argument("--warmup-steps", type=int, default=80, help="sft_step warm-up steps")
    p.add_argument("--prompts", type=int, default=32, help="problems per RL step")
    p.add_argument("--group-size", type=int, default=8, help="answers per problem")
    p.add_argument("--lr", type=float, default=1e-4, help="RL learning rate")
    p.add_argument("--kl-coef", type=float, default=0.02)
    p.add_argument("--run-dir", default="runs/custom_loop")
    args = p.parse_args()
    torch.manual_seed(0)

    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")  # 1 rank or torchrun's
    rank0 = dist.get_rank() == 0
    run_dir = Path(args.run_dir)
    task, tok, G = AdditionTask(digits=1), CharTokenizer(), args.group_size

    # 1. the initial model (random init) and the rollout server serving it
    server = None
    if rank0:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        save_initial_model(run_dir / "model0", TinyModel(), tok)
        server = launch_server(run_dir / "model0", log_dir=run_dir)
    url = from_rank0(lambda: server.url)
    try:
        # 2. supervised warm-up, exported as the reference (and RL's starting point)
        sft = ff.shard_model(ff.EngineConfig(model_path=str(run_dir / "model0"), dtype="float32",
                                             optimizer=ff.OptimizerConfig(lr=3e-3)), mesh)
        for i in range(args.warmup_steps):
            batch = ff.shard_batch(sft_batch(task, tok, 64, seed=i), mesh)
            sft, stats = ff.sft_step(sft, batch, ff.SFTConfig())
        ff.export_hf(sft, run_dir / "sft", dtype="float32")
        del sft
        if rank0:
            print(f"warm-up: {args.warmup_steps} sft steps, loss {float(stats['loss']):.3f}")

        actor = ff.shard_model(ff.EngineConfig(model_path=str(run_dir / "sft"), dtype="float32",
                                               optimizer=ff.OptimizerConfig(lr=args.lr)), mesh)
        ref = ff.shard_model(ff.EngineConfig(model_path=str(run_dir / "sft"), dtype="float32",
                                             optimizer=None), mesh)
        target = RolloutTarget(url)                     # broadcast over gloo, rank 0 sends
        push_weights(actor, target)

        # 3. RL with the custom loss
        # the loss and what it reads, as one value; minibatches keep each group whole
        objective = ff.Objective(reinforce_kl_loss(args.kl_coef), group_size=G,
                                 require=(K.LOSS_MASK, K.OLD_LOGP, K.REF_LOGP, K.ADVANTAGES))
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            data = from_rank0(lambda: rollout(url, task, tok, args.prompts, G, seed=10**6 + step))
            batch = TensorDict(data, batch_size=[args.prompts * G])
            batch = ff.shard_batch(batch, mesh)          # group_id: whole groups per rank
            batch = ff.forward_logp(ref, batch, out_key=K.REF_LOGP)
            batch = ff.forward_logp(actor, batch, out_key=K.OLD_LOGP)
            # RLOO: each answer's reward minus the mean of the other answers to its problem;
            # a group split over ranks would be a BatchError here, not a wrong advantage
            batch = ff.compute_advantages(batch, ff.AdvantageConfig(estimator="rloo",
                                                                    group_size=G), mesh=mesh)
            actor, stats = ff.grad_step(actor, batch, objective, optimizer_steps=2)
            receipt = push_weights(actor, target)
            if rank0:
                print(f"step {step:3d}  reward {float(data[K.REWARDS].mean()):.3f}"
                      f"  loss {float(stats['loss']):+.4f}  kl {float(stats['kl']):.4f}"
                      f"  version {receipt.version}  {time.perf_counter() - t0:.2f}s",
                      flush=True)
        ff.save_checkpoint(actor, run_dir / "checkpoints" / f"step_{args.steps}",
                           extra={"step": args.steps})
        target.close()
    finally:
        if server is not None:
            server.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
