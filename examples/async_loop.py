"""async_loop.py: asynchronous GRPO in a custom loop: generation runs up to --max-staleness steps
ahead of training (fsdpfn.rollout.RolloutStream), the decoupled PPO loss corrects for it.

On 1-digit addition (the embedded task, nothing downloaded): a short sft_step warm-up, then each
step takes the stream's next groups (data order, their tokens' weight versions and behav_logp),
scores them, runs compute_advantages (GRPO) and ppo_step (one minibatch: the training forward is
the proximal policy, behav_logp weights the off-policy tokens), pushes, and lets the stream run
one step further. Run it (CPU, about a minute):  python examples/async_loop.py --max-staleness 2
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

import fsdpfn as ff
from fsdpfn.app.recipes.task import (AdditionTask, CharTokenizer, TinyModel, save_initial_model,
                                     sft_batch)
from fsdpfn.rollout import launch_server
from fsdpfn.rollout.stream import RolloutStream
from fsdpfn.weights import RolloutTarget, push_weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16, help="problems per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--run-dir", default="runs/async_loop")
    args = p.parse_args()
    torch.manual_seed(0)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cpu")  # one process
    run_dir, task, tok = Path(args.run_dir), AdditionTask(digits=1), CharTokenizer()
    G = args.group_size
    shutil.rmtree(run_dir, ignore_errors=True)
    save_initial_model(run_dir / "model0", TinyModel(), tok)

    # 1. warm-up: a few supervised steps, so rewards are not all zero
    actor = ff.shard_model(ff.EngineConfig(model_path=str(run_dir / "model0"), dtype="float32",
                                           optimizer=ff.OptimizerConfig(lr=3e-3)), mesh)
    for i in range(60):
        actor, _ = ff.sft_step(actor, sft_batch(task, tok, 64, seed=i), ff.SFTConfig())

    # 2. the server, the stream over the data order (problem i is drawn with seed i)
    problems = [task.sample(1, seed=10_000 + i)[0] for i in range(args.steps * args.prompts)]
    server = launch_server(run_dir / "model0", log_dir=run_dir)
    target = RolloutTarget(server.url, config=ff.PushConfig(pause_generation=False))
    version = push_weights(actor, target).version
    stream = RolloutStream(server.url, lambda i: task.prompt_ids(tok, *problems[i]),
                           group_size=G, groups_per_step=args.prompts,
                           max_staleness=args.max_staleness, version=version, seed=0,
                           steps=args.steps,
                           sampling={"max_new_tokens": task.max_answer_tokens,
                                     "stop_token_ids": [tok.eos_id]})
    # one minibatch: the training forward is the proximal policy (old_logp_from="forward", exact)
    config = ff.PPOConfig(clip_low=0.2, clip_high=0.28, behav_cap=5.0, old_logp_from="forward")
    try:
        for step in range(1, args.steps + 1):
            # 3. the step's groups; rewards; the public batch (behav_logp from the server)
            got = stream.next_batch(timeout=300)
            outputs = [o for g in got.groups for o in g.outputs]
            rewards = [task.reward(*problems[g.index], tok.decode(o["output_ids"]))
                       for g in got.groups for o in g.outputs]
            batch = ff.rollout_batch([g.prompt_ids for g in got.groups], outputs, G, rewards)
            batch = ff.compute_advantages(batch, ff.AdvantageConfig(estimator="grpo",
                                                                    group_size=G))
            # 4. the update (decoupled PPO), the push, one more step of generation allowed
            actor, stats = ff.ppo_step(actor, batch, config)
            stream.advance(push_weights(actor, target).version)
            s = got.stats
            print(f"step {step:3d}  reward {sum(rewards) / len(rewards):.3f}  "
                  f"loss {float(stats['loss']):+.4f}  staleness mean {s['staleness_mean']:.2f} "
                  f"max {s['staleness_max']}  off-policy tokens {s['off_policy_token_frac']:.2f}"
                  f"  trainer waited {s['trainer_wait_seconds']:.2f} s  v{actor.version}",
                  flush=True)
    finally:
        stream.close()
        target.close()
        server.close()


if __name__ == "__main__":
    main()
