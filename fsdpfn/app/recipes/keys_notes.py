"""The hand-written text of docs/recipes.md: what the config classes do not say themselves.

fsdpfn.app.recipes.keys_doc renders the page from the classes; it reads from here the
description of each key whose class neither comments nor names it in its docstring (``NOTES``),
the titles of sections a plain ``key: Class`` would not explain (``SECTION_TITLES``), the
recipes that have a section through a shared class but refuse it (``REFUSED_IN``) and the rules a
recipe adds to its sections' own (``RULES``: each refused before launch, in one line).
"""

from __future__ import annotations

__all__ = ["NOTES", "SECTION_TITLES", "REFUSED_IN", "RULES"]

# what a recipe requires across its sections (fsdpfn.app.recipes.config refuses the rest)
_RL = ["`ppo.temperature` equals `rollout.temperature` (old_logp and behav_logp describe one "
       "distribution)",
       "with `data.train_files`, `warmup.steps` is 0 or null (the warm-up trains on the "
       "embedded task)"]
RULES = {
    "grpo": ["`advantage.estimator` is critic-free: grpo, drgrpo, rloo or reinforce++ (gae "
             "needs recipe ppo)",
             "`advantage.group_size` >= 2 (answers per problem, compared within their group)",
             "`ppo.n_minibatches` <= the rows of a step, `prompts_per_step` x "
             "`advantage.group_size`", *_RL],
    "ppo": ["`advantage.estimator` is gae (the critic's values)",
            "`advantage.group_size` is 1 (one answer per prompt; a step's rows are "
            "`prompts_per_step`)",
            "`ppo.n_minibatches` and `critic.n_minibatches` <= `prompts_per_step`", *_RL],
    "rw": ["`engine.lora` is null (the reward model trains in full)"],
}

# keys whose class neither comments nor names them in its docstring: (class name, key) -> text
NOTES = {
    ("*", "recipe"): "which recipe this file runs (fixed per recipe)",
    ("*", "run_dir"): "where metrics, checkpoints, logs and the resolved config.yaml go",
    ("*", "seed"): "seed of the data order, the model's random init, the sampling seeds and "
                   "each trainer rank's global RNGs (torch, random, numpy)",
    ("*", "steps"): "training steps of the run (RL: after the warm-up)",
    ("WarmupConfig", "steps"): "supervised warm-up steps on the embedded task (null: 600; with "
                               "data.train_files 0 or null: RL starts from model.path)",
    ("*", "prompts_per_step"): "prompts sampled per step; rows per step = prompts_per_step x "
                               "advantage.group_size",
    ("*", "batch_size"): "rows per training step",
    ("*", "pairs_per_step"): "chosen/rejected pairs per training step",
    ("*", "eval_every"): "held-out loss at step 1, every N steps and the last (0: off; null: "
                         "a fifth of the run) on data.eval_files' rows (train_files without "
                         "them: none, said in a line), or the embedded task's held-out "
                         "problems; a resumed run keeps that cadence",
    ("*", "export"): "export_hf of the result to run_dir/model at the end",
    ("*", "task"): "the embedded addition task (used when data.train_files is empty)",
    ("*", "ref_engine"): "the reference model's engine: only the engine: keys that differ "
                         "(a mapping, merged key by key into engine:)",
    ("*", "critic_engine"): "the critic's engine: only the engine: keys that differ (a mapping, "
                            "merged key by key into engine:); never lora",
    ("*", "critic_optimizer"): "the critic's optimizer (the keys of optimizer:)",
    ("ParallelStrategy", "dp"): "data-parallel size; -1: whatever is left of the world size",
    ("ParallelStrategy", "tp"): "tensor-parallel size (heads, MLP and vocabulary split)",
    ("ParallelStrategy", "cp"): "context-parallel size (Ulysses: each rank holds 1/cp of a "
                                "micro-batch's tokens)",
    ("ModelConfig", "hidden_size"): "embedded model only: hidden size",
    ("ModelConfig", "intermediate_size"): "embedded model only: MLP size",
    ("ModelConfig", "num_layers"): "embedded model only: decoder layers",
    ("ModelConfig", "num_heads"): "embedded model only: attention heads",
    ("ModelConfig", "num_kv_heads"): "embedded model only: key/value heads",
    ("ModelConfig", "seed"): "seed of the random init (embedded model or random_init)",
    ("DataConfig", "train_files"): "local .jsonl / .json / .parquet / .csv / .tsv files "
                                   "(CSV: text values, a header line); empty: the embedded task",
    ("DataConfig", "eval_files"): "held-out files (same columns)",
    ("DataConfig", "prompt_key"): "column of the prompt (a string, or chat messages)",
    ("DataConfig", "answer_key"): "column handed to the reward as answer (grpo, ppo: required "
                                  "by the built-in math reward and when set, else optional)",
    ("DataConfig", "messages_key"): "column of chat messages (sft: loss on assistant turns)",
    ("DataConfig", "response_key"): "sft: column of the response",
    ("DataConfig", "text_key"): "sft: column of plain text trained on whole (continued "
                                "pretraining; rows without a prompt or messages column)",
    ("DataConfig", "chosen_key"): "rw, dpo: column of the preferred response",
    ("DataConfig", "rejected_key"): "rw, dpo: column of the other response",
    ("DataConfig", "chat_template"): "render string prompts as one user turn with the "
                                     "tokenizer's chat template",
    ("DataConfig", "system_prompt"): "a system turn put before chat prompts that have none",
    ("DataConfig", "max_prompt_tokens"): "longer prompts are dropped (counted), never cut",
    ("DataConfig", "max_response_tokens"): "RL: max new tokens; sft/rw/dpo: longer responses "
                                           "are dropped (counted)",
    ("DataConfig", "shuffle"): "a permutation per epoch drawn under (seed, epoch)",
    ("DataConfig", "eval_size"): "sft, rw, dpo: use at most this many held-out rows (null: "
                                 "every row of eval_files; the embedded task: 256, rw 128); "
                                 "grpo/ppo evaluate eval.n_prompts",
    ("AdditionTask", "digits"): "operand digits",
    ("AdditionTask", "reverse"): "answer written least-significant digit first",
    ("AdditionTask", "zero_pad"): "operands written with all their digits (07+48=)",
    ("OptimizerConfig", "lr"): "peak learning rate",
    ("OptimizerConfig", "betas"): "AdamW's betas",
    ("OptimizerConfig", "eps"): "AdamW's epsilon",
    ("OptimizerConfig", "weight_decay"): "decoupled weight decay (matrices only)",
    ("OptimizerConfig", "schedule"): "learning-rate schedule after the warm-up",
    ("OptimizerConfig", "warmup_steps"): "linear warm-up steps",
    ("OptimizerConfig", "total_steps"): "length of the linear / cosine schedule",
    ("OptimizerConfig", "min_lr_ratio"): "floor of the decayed rate, as a fraction of lr",
    ("OptimizerConfig", "max_grad_norm"): "global gradient-norm clip (null: none)",
    ("EngineSection", "dtype"): "compute dtype; auto: float32 on CPU, bfloat16 on CUDA",
    ("FSDPConfig", "wrap_policy"): "decoder layer class names sharded as FSDP units (null: the "
                                   "model's _no_split_modules)",
    ("LoRAConfig", "rank"): "adapter rank",
    ("LoRAConfig", "alpha"): "adapter scaling numerator (delta = alpha / rank x B @ A)",
    ("PPOConfig", "behav_low"): "lower bound of the tis/mis correction (null: none for tis, "
                                "1/behav_high for mis)",
    ("PPOConfig", "behav_high"): "upper bound of the tis/mis correction (null: 2.0)",
    ("PPOConfig", "cispo_clip_low"): "CISPO: the weight's lower bound is 1 - this (null: none)",
    ("PPOConfig", "cispo_clip_high"): "CISPO: the weight's upper bound is 1 + this (null: the "
                                      "PPO upper clip)",
    ("FSDPConfig", "optim_step_prefetch_layers"): "per_layer_optim_step: units whose state is "
                                                  "loaded ahead of the one being stepped",
    ("WarmupConfig", "target_reward"): "stop the warm-up once the expected reward reaches this "
                                       "(null: run all its steps)",
    ("WarmupConfig", "check_every"): "steps between two checks of the expected reward",
    ("PPOConfig", "behav_cap"): "token TIS: truncate the behaviour weights at this cap (null: "
                                "off)",
    ("PPOConfig", "on_policy_tol"): "check_on_policy's bound on mean |logp - old_logp|",
    ("RolloutConfig", "transport"): "how weights reach the server: broadcast, ipc, disk, or "
                                    "auto (see the class text)",
    ("RolloutConfig", "workflow_timeout_s"): "bound on one workflow call",
    ("RolloutConfig", "max_episode_tokens"): "longer episode rows are dropped and counted "
                                             "(null: the model's max_position_embeddings); "
                                             "set, it is the servers' --decode-max-len where "
                                             "longer than the data's row",
    ("RewardConfig", "fn"): "package.module:function or path/to/file.py:function (null: the "
                            "task's built-in reward)",
    ("LaunchConfig", "threads_per_rank"): "CPU threads per trainer rank (OMP_NUM_THREADS)",
    ("LogConfig", "tensorboard"): "TensorBoard events in run_dir/tensorboard (needs "
                                  "tensorboard)",
    ("WandbConfig", "project"): "W&B project",
    ("WandbConfig", "name"): "W&B run name (null: the run_dir's name)",
    ("EngineSection", "grad_reduce_dtype"): "dtype of the gradient reduce-scatter",
    ("EngineSection", "optimizer_dtype"): "master weights and AdamW state; bfloat16: "
                                          "Kahan-compensated AdamW",
    ("EngineSection", "gradient_checkpointing"): "recompute each decoder layer in the backward "
                                                 "(activation memory for time)",
    ("EngineSection", "disable_dropout"): "turn the model's dropout off (RL log-probs must be "
                                          "deterministic)",
    ("EngineSection", "logprobs_chunk_size"): "tokens per chunk of the log-prob head (float32 "
                                              "logits of one chunk at a time)",
    ("MicroBatchSpec", "n_mbs"): "minimum number of micro-batches (at most one per row, or per "
                                 "group kept whole)",
    ("FSDPConfig", "reshard_after_forward"): "free gathered weights after each forward "
                                             "(False: keep them for the backward; more memory, "
                                             "fewer all-gathers)",
    ("FSDPConfig", "memory_efficient_load"): "fill the starting weights one tensor at a time",
    ("PPOConfig", "clip_low"): "lower clip: the ratio is clipped at 1 - clip_low",
    ("PPOConfig", "dual_clip"): "dual-clip bound for negative advantages (null: off)",
    ("PPOConfig", "agg"): "how token losses are aggregated",
    ("PPOConfig", "ratio_level"): "importance ratio per token or per sequence",
    ("PPOConfig", "n_minibatches"): "optimizer steps per batch (1: exactly on-policy, skips "
                                    "the old-logp pass)",
    ("PPOConfig", "shuffle"): "shuffle rows before splitting into minibatches",
    ("PPOConfig", "entropy_coef"): "entropy bonus coefficient",
    ("PPOConfig", "kl_kind"): "KL estimator of the loss's KL term",
    ("PPOConfig", "temperature"): "sampling temperature the log-probs are taken at (must equal "
                                  "rollout.temperature)",
    ("PPOConfig", "seed"): "seed of the minibatch shuffle",
    ("CriticConfig", "value_clip"): "value clipping around old_values (null: off)",
    ("CriticConfig", "agg"): "how token losses are aggregated",
    ("CriticConfig", "n_minibatches"): "optimizer steps per batch",
    ("CriticConfig", "shuffle"): "shuffle rows before splitting into minibatches",
    ("CriticConfig", "seed"): "seed of the minibatch shuffle",
    ("AdvantageConfig", "estimator"): "advantage estimator (grpo, ppo: see the class text)",
    ("AdvantageConfig", "group_size"): "answers per prompt (rows with one group_id)",
    ("AdvantageConfig", "gamma"): "discount (gae)",
    ("AdvantageConfig", "lam"): "GAE lambda",
    ("AdvantageConfig", "kl_kind"): "KL estimator of the reward's KL term",
    ("AdvantageConfig", "reward_scale"): "reward x scale + bias before the estimator",
    ("AdvantageConfig", "reward_bias"): "reward x scale + bias before the estimator",
    ("AdvantageConfig", "reward_clip"): "clip rewards to [-clip, clip] (null: off)",
    ("AdvantageConfig", "whiten"): "whiten advantages over the batch (dp-global): "
                                   "(A - mean) / sqrt(unbiased var + 1e-8) over loss tokens; "
                                   "reinforce++ whitens either way (its definition)",
    ("AdvantageConfig", "eps"): "added to standard deviations",
    ("SFTConfig", "agg"): "how token losses are aggregated",
    ("RWConfig", "margin"): "margin of the Bradley-Terry loss",
    ("DPOConfig", "beta"): "DPO's beta",
    ("DPOConfig", "kind"): "sigmoid (DPO) or ipo",
    ("RolloutConfig", "threads"): "CPU threads of the server (CPU serving)",
    ("RolloutConfig", "temperature"): "sampling temperature",
    ("RolloutConfig", "top_p"): "nucleus sampling",
    ("RolloutConfig", "timeout_s"): "per generation request",
    ("RewardConfig", "batched"): "one call per batch: score(prompts, completions, *, answers, "
                                 "samples)",
    ("RewardConfig", "workers"): "reward processes (0: in-process, no timeout)",
    ("RewardConfig", "timeout_s"): "per call",
    ("RewardConfig", "on_error"): "the reward of a sample whose call failed",
    ("RewardConfig", "kwargs"): "keyword arguments passed to the function",
    ("WarmupConfig", "batch_size"): "rows per warm-up step",
    ("WarmupConfig", "optimizer"): "the warm-up's optimizer (the keys of optimizer:)",
    ("EvalConfig", "every"): "greedy accuracy at step 1, every N steps and the last (0: off); a "
                             "resumed run keeps that cadence",
    ("EvalConfig", "n_prompts"): "held-out problems per evaluation",
    ("LaunchConfig", "master_port"): "the ranks' rendezvous port (null: a free one)",
    ("CheckpointConfig", "every"): "save every N steps (0: only at the end)",
    ("CheckpointConfig", "keep_last"): "newest checkpoints kept",
    ("LogConfig", "progress"): "progress bar on stderr",
    ("LogConfig", "every"): "a progress line every N steps when stderr is not a terminal",
    ("LogConfig", "plot"): "run_dir/metrics.png at the end",
}

# a section's title by its key, where "key: Class" would not say what it is
SECTION_TITLES = {"engine": "engine: the policy's EngineConfig"}
# sections a recipe has (through a shared class) but refuses: not listed among its recipes
REFUSED_IN = {"LoRAConfig": ("rw",)}
