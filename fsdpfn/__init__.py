"""fsdpfn: functional, stateless RL and fine-tuning of LLMs on PyTorch FSDP2.

    import fsdpfn as ff
    mesh  = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=1))
    actor = ff.shard_model(ff.EngineConfig(model_path="ckpt/"), mesh)
    batch = ff.forward_logp(actor, batch, out_key="old_logp")
    batch = ff.compute_advantages(batch, ff.AdvantageConfig(estimator="grpo", group_size=8))
    actor, stats = ff.ppo_step(actor, batch, ff.PPOConfig())
"""

from fsdpfn import keys, ops
from fsdpfn.algos import (compute_advantages, critic_step, dpo_step, ppo_step, rw_step,
                          sft_step)
from fsdpfn.batch import gather_batch, shard_batch
from fsdpfn.checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from fsdpfn.config import (AdvantageConfig, CriticConfig, DPOConfig, EngineConfig, FSDPConfig,
                           LoRAConfig, MicroBatchSpec, OptimizerConfig, ParallelStrategy,
                           PPOConfig, RWConfig, SFTConfig)
from fsdpfn.errors import (BatchError, CheckpointError, ConfigError, MicroBatchOOMError,
                           StaleStateError, WeightSyncError)
from fsdpfn.forward import compute_values, forward_logp
from fsdpfn.mesh import Mesh, build_mesh
from fsdpfn.shard import shard_model
from fsdpfn.state import EngineState
from fsdpfn.step import StepContext, evaluate, grad_step
from fsdpfn.weights import DiskTarget, PushReceipt, RolloutTarget, push_weights

__version__ = "0.1.0"

__all__ = [
    # configs
    "ParallelStrategy", "EngineConfig", "OptimizerConfig", "FSDPConfig", "MicroBatchSpec",
    "LoRAConfig", "PPOConfig", "CriticConfig", "AdvantageConfig", "SFTConfig", "RWConfig",
    "DPOConfig",
    # errors
    "ConfigError", "BatchError", "StaleStateError", "WeightSyncError", "CheckpointError",
    "MicroBatchOOMError",
    # engine
    "Mesh", "build_mesh", "EngineState", "shard_model", "forward_logp", "compute_values",
    "grad_step", "evaluate", "StepContext", "shard_batch", "gather_batch",
    "save_checkpoint", "load_checkpoint", "export_hf", "latest_checkpoint",
    "push_weights", "PushReceipt", "DiskTarget", "RolloutTarget",
    # algorithms
    "compute_advantages", "ppo_step", "critic_step", "sft_step", "rw_step", "dpo_step",
    # modules
    "ops", "keys",
]
