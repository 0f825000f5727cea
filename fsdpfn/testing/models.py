"""Tiny model configs built locally (nothing downloaded), and a helper that saves one to disk."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["tiny_qwen2_config", "tiny_llama_config", "tiny_qwen3_config", "save_tiny_model",
           "sharded_logits"]


def _common(overrides: dict) -> dict:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False, rms_norm_eps=1e-6)
    base.update(overrides)
    return base


def tiny_qwen2_config(**overrides):
    """A 2-layer Qwen2 (GQA 4:2 heads, q/k/v biases, vocab 128), about 60k parameters."""
    from transformers import Qwen2Config

    return Qwen2Config(**_common(overrides))


def tiny_llama_config(**overrides):
    """A 2-layer Llama (GQA 4:2 heads, no biases, vocab 128)."""
    from transformers import LlamaConfig

    return LlamaConfig(**_common(overrides))


def tiny_qwen3_config(**overrides):
    """A 2-layer Qwen3 (q/k norms, head_dim 16)."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common({"head_dim": 16, **overrides}))


def save_tiny_model(path: str | Path, config, *, seed: int = 0, critic: bool = False) -> Path:
    """Build ``config`` with random init under ``seed`` and save it as a HF safetensors directory."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    torch.manual_seed(seed)
    if critic:
        config.num_labels = 1
        model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


@torch.no_grad()
def sharded_logits(state, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, T, V] of a sharded actor state, for tests (every rank calls it).

    Runs each row through the FSDP root as one packed sequence and gathers vocabulary-split
    logits; the [B, T, V] tensor is what fsdpfn's own paths avoid, so keep the inputs small.
    """
    device = state.mesh.device
    rows = []
    for ids in input_ids.to(device):
        T = ids.shape[0]
        cu = torch.tensor([0, T], dtype=torch.int32)
        logits = state.model(ids, torch.arange(T, device=device), cu, T, full_logits=True)
        rows.append(logits.float().cpu())
    return torch.stack(rows)
