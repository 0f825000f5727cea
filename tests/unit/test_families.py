"""Every verified model family computes what its own Hugging Face forward computes.

One process, float32, CPU. For each family and variant of fsdpfn.testing.tiny_family_configs
(sliding windows, softcaps, query_pre_attn_scalar, rope scalings, fused projections, norm
offsets, odd vocabulary 131), with rows longer than every window packed together:
- forward_logp equals the log-softmax of the model's own eager float32 forward to 1e-5;
- one sft_step's loss equals the model's own mean NLL, and its update equals the update the same
  optimizer makes from the model's own gradients;
- with LoRA adapters (moved by one step), forward_logp equals the model's own forward with the
  adapters merged into its weights.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing.models import (REFERENCE_STEP, hf_reference_logp, save_family_model,
                                   tiny_family_configs)

FAMILIES = tiny_family_configs()
LENGTHS = (64, 41, 53, 47)  # every row longer than the window (12)
LOGP_TOL = 1e-5
# AdamW with betas (0, 0), eps 1, lr 1, no decay, no clipping: the first update is exactly
# -g / (|g| + 1), a smooth function of the gradient g, so updates compare gradients entry by entry
OPT = REFERENCE_STEP  # the step hf_reference_update computes


def family_batch(vocab: int = 131, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    attn = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    ids = torch.where(attn, torch.randint(0, vocab, (len(LENGTHS), T), generator=g), 0)
    loss = attn.clone()
    loss[:, :3] = False
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss},
                      batch_size=[len(LENGTHS)])


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: str(save_family_model(root / name, spec, seed=3))
            for name, spec in FAMILIES.items()}


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="eager")


def engine_state(model_dir: str, *, optimizer: bool):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    cfg = ff.EngineConfig(model_path=model_dir, dtype="float32",
                          optimizer=ff.OptimizerConfig(**OPT) if optimizer else None)
    return ff.shard_model(cfg, mesh)


def full_params(state) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    return {k[len("lm."):]: v.clone() for k, v in sd.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_forward_logp_equals_the_models_own_forward(family, family_dirs):
    batch = family_batch()
    with torch.no_grad():
        ref, _ = hf_reference_logp(hf_model(family_dirs[family]), batch[K.INPUT_IDS],
                                   batch[K.ATTENTION_MASK])
    state = engine_state(family_dirs[family], optimizer=False)
    got = ff.forward_logp(state, batch)[K.LOGP]
    gap = float((got - ref).abs().max())
    assert gap <= LOGP_TOL, f"{family}: forward_logp differs from HF by {gap:.3g}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_step_loss_and_update_equal_the_models_own(family, family_dirs):
    batch = family_batch(seed=1)
    model = hf_model(family_dirs[family])
    ref, _ = hf_reference_logp(model, batch[K.INPUT_IDS], batch[K.ATTENTION_MASK])
    mask = batch[K.LOSS_MASK]
    nll = -(ref * mask).sum() / mask.sum()
    nll.backward()
    expected = {name: -p.grad / (p.grad.abs() + 1.0) for name, p in model.named_parameters()}
    state = engine_state(family_dirs[family], optimizer=True)
    before = full_params(state)
    state, stats = ff.sft_step(state, batch)
    after = full_params(state)
    assert abs(float(stats["loss"]) - float(nll)) <= 1e-5, (family, float(stats["loss"]),
                                                           float(nll))
    for name, delta in expected.items():
        torch.testing.assert_close(after[name] - before[name], delta, rtol=1e-4, atol=2e-6,
                                   msg=lambda m, name=name: f"{family} {name}: {m}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_forward_equals_the_models_own_forward_of_the_merged_export(family, family_dirs,
                                                                          tmp_path):
    """One sft_step moves the adapters (B starts at 0); the adapted packed forward then equals
    the model's own eager forward with every adapter folded into its weight (export_hf
    merged), on every linear the family has (fused ones too)."""
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    cfg = ff.EngineConfig(model_path=family_dirs[family], dtype="float32",
                          lora=ff.LoRAConfig(rank=4, alpha=8.0),
                          optimizer=ff.OptimizerConfig(lr=1e-2))
    state, _ = ff.sft_step(ff.shard_model(cfg, mesh), family_batch(seed=1))
    ff.export_hf(state, tmp_path / "merged", dtype="float32", merged=True)
    batch = family_batch(seed=2)
    with torch.no_grad():
        ref, _ = hf_reference_logp(hf_model(str(tmp_path / "merged")), batch[K.INPUT_IDS],
                                   batch[K.ATTENTION_MASK])
        base, _ = hf_reference_logp(hf_model(family_dirs[family]), batch[K.INPUT_IDS],
                                    batch[K.ATTENTION_MASK])
    got = ff.forward_logp(state, batch)[K.LOGP]
    assert float((ref - base).abs().max()) > 1e-3  # the adapters did move the model
    gap = float((got - ref).abs().max())
    assert gap <= LOGP_TOL, f"{family}: LoRA forward differs from the merged model by {gap:.3g}"
