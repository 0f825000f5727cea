"""fsdpfn: functional, stateless RL and fine-tuning of LLMs on PyTorch FSDP2.

    import fsdpfn as ff
    mesh  = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=1))
    actor = ff.shard_model(ff.EngineConfig(model_path="ckpt/"), mesh)
    batch = ff.forward_logp(actor, batch, out_key="old_logp")
    batch = ff.compute_advantages(batch, ff.AdvantageConfig(estimator="grpo", group_size=8))
    actor, stats = ff.ppo_step(actor, batch, ff.PPOConfig())

Names are imported on first use (PEP 562): ``import fsdpfn`` alone does not import torch, so the
``fsdpfn`` command reports a config error before torch would have finished loading.
"""

from __future__ import annotations

from fsdpfn.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the module that defines it (the explicit re-exports of this package)
_SOURCES = {
    # configs
    **dict.fromkeys(("ParallelStrategy", "EngineConfig", "OptimizerConfig", "FSDPConfig",
                     "MicroBatchSpec", "LoRAConfig", "PPOConfig", "CriticConfig",
                     "AdvantageConfig", "SFTConfig", "RWConfig", "DPOConfig"), "fsdpfn.config"),
    # errors
    **dict.fromkeys(("ConfigError", "BatchError", "StaleStateError", "WeightSyncError",
                     "CheckpointError", "MicroBatchOOMError"), "fsdpfn.errors"),
    # engine
    "Mesh": "fsdpfn.engine.mesh", "build_mesh": "fsdpfn.engine.mesh",
    "EngineState": "fsdpfn.engine.state",
    "shard_model": "fsdpfn.engine.shard",
    **dict.fromkeys(("forward_logp", "compute_values", "compute_scores"),
                    "fsdpfn.engine.forward"),
    "last_timings": "fsdpfn.engine.timing", "profile": "fsdpfn.engine.profiling",
    "grad_step": "fsdpfn.engine.step", "evaluate": "fsdpfn.engine.step", "StepContext": "fsdpfn.engine.step",
    "Objective": "fsdpfn.engine.objective",
    **dict.fromkeys(("shard_batch", "gather_batch", "rollout_batch"), "fsdpfn.batch"),
    **dict.fromkeys(("save_checkpoint", "load_checkpoint", "export_hf", "latest_checkpoint",
                     "latest_intact_checkpoint", "check_checkpoint"), "fsdpfn.checkpoint"),
    **dict.fromkeys(("push_weights", "PushReceipt", "DiskTarget", "RolloutTarget"),
                    "fsdpfn.weights"),
    **dict.fromkeys(("PushConfig", "AdapterTarget"), "fsdpfn.weights"),
    "RolloutStream": "fsdpfn.rollout.stream",
    # algorithms
    **dict.fromkeys(("compute_advantages", "ppo_step", "critic_step", "sft_step", "rw_step",
                     "dpo_step"), "fsdpfn.algos"),
}
_MODULES = ("ops", "keys")

__all__ = [*_SOURCES, *_MODULES]


__getattr__, __dir__ = lazy_exports(__name__, _SOURCES, __all__, submodules=_MODULES)
