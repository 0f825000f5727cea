"""The fused modules both ends run: the trainer's model (fsdpfn.engine.shard) and the served one
(fsdpfn.rollout) swap the same HF modules for Liger-Kernel's, so the server's log-probs are the
trainer's for the same weights. Here so that the rollout server needs nothing of the trainer.
"""

from __future__ import annotations

from torch import nn

__all__ = ["LIGER_NORMS", "LIGER_MLPS", "apply_fused_kernels"]

# RMSNorm classes whose forward Liger's LigerRMSNorm computes, with its (offset, casting_mode):
# Llama's casts to the input dtype before the weight; OLMo-2's and Gemma's multiply in float32
# ("gemma" mode); Gemma's scales by (1 + weight). Any other norm class keeps HF's module.
LIGER_NORMS = {"LlamaRMSNorm": (0.0, "llama"), "Qwen2RMSNorm": (0.0, "llama"),
               "Qwen3RMSNorm": (0.0, "llama"), "MistralRMSNorm": (0.0, "llama"),
               "Phi3RMSNorm": (0.0, "llama"), "Olmo2RMSNorm": (0.0, "gemma"),
               "GemmaRMSNorm": (1.0, "gemma"), "Gemma2RMSNorm": (1.0, "gemma"),
               "Gemma3RMSNorm": (1.0, "gemma")}
# MLP classes that are down(silu(gate(x)) * up(x)) with separate bias-free linears
LIGER_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "Olmo2MLP")


def _fused_module(child: nn.Module, hf_config, *, mlp: bool):
    """Liger's module computing what ``child`` computes, or None (keep HF's)."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    kind = type(child).__name__
    if kind in LIGER_NORMS and getattr(child, "weight", None) is not None \
            and child.weight.ndim == 1:
        offset, casting = LIGER_NORMS[kind]
        eps = getattr(child, "variance_epsilon", getattr(child, "eps", None))
        return LigerRMSNorm(child.weight.shape[0], eps=eps, offset=offset, casting_mode=casting,
                            in_place=False)
    if mlp and kind in LIGER_MLPS and getattr(hf_config, "hidden_act", "") in ("silu", "swish") \
            and all(hasattr(child, p) for p in ("gate_proj", "up_proj", "down_proj")) \
            and child.gate_proj.bias is None:
        return LigerSwiGLUMLP(hf_config, intermediate_size=child.gate_proj.out_features)
    return None


def apply_fused_kernels(model: nn.Module, hf_config, device_type: str, *,
                        mlp: bool = True, keep_weights: bool = False) -> int:
    """Swap this model's RMSNorm and SwiGLU MLP modules for Liger-Kernel's fused Triton ones
    (same parameter names, so checkpoints and the TP plan are unchanged), only where the module
    class is one Liger computes exactly (LIGER_NORMS, LIGER_MLPS). Instance-level: no class of
    transformers is patched. CUDA only; a no-op when liger_kernel is not installed.
    ``mlp=False`` keeps HF's MLP modules (LoRA adapters on their linears need them called);
    ``keep_weights``: the swapped modules take the loaded weights (a model already loaded).
    Returns the number of modules swapped."""
    if device_type != "cuda":
        return 0
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return 0
    import torch

    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            first = next(child.parameters(), None)
            if first is None:
                continue
            # built where the module's weights live: on a meta skeleton nothing is allocated
            # or initialised (a 7B model's MLPs drawn on the host took 50 s of its build)
            with torch.device(first.device):
                fused = _fused_module(child, hf_config, mlp=mlp)
            if fused is None:
                continue
            fused.to(device=first.device, dtype=first.dtype)
            if keep_weights:
                fused.load_state_dict(child.state_dict())
            setattr(module, name, fused)
            swapped += 1
    return swapped
