"""sft_step on a LoRA state against peft's own model in float64, step by step.

The reference: ``peft.get_peft_model`` over the same HF checkpoint loaded in float64, the
adapters copied from what ``ff.export_hf`` writes before any step (peft's adapter format), the SFT
loss written here from the docs (docs/api.md ``sft_loss``, ``SFTConfig``, "Minibatches and stats":
−Σ loss_mask·log π(token) / Σ loss_mask by default, log π of input_ids[b, t] given
input_ids[b, :t]), backward, and ``torch.optim.AdamW`` with the OptimizerConfig's lr, betas, eps
and weight decay (every adapter matrix is a matrix, so all decay), a constant schedule without
warm-up (the rate is lr from step 0) and no clipping. After each step the adapters fsdpfn
exports must equal peft's; after the last, the merged export must be the untouched base plus
(alpha / rank)·B @ A.

Two steps: peft initialises B = 0, so the first step moves A by weight decay alone (its gradient
is 0); the second step, with B nonzero, checks A's gradient and Adam's moments. Adam's eps (1e-2) is
above most gradients (median ~1e-3) so the update depends on their magnitude, not only their sign.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config

RANK, ALPHA = 4, 8.0
LR, BETAS, EPS, WD = 2e-2, (0.8, 0.95), 1e-2, 0.1  # eps above most gradients
ALL_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_ref") / "base"
    save_tiny_model(path, tiny_qwen2_config(), seed=5)
    return path


def make_batch(seed: int, B: int = 4, T: int = 16) -> TensorDict:
    """Right-padded rows of random lengths, loss_mask after a prompt of random length."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(6, T + 1, (B,), generator=g)
    lens[0] = T
    attn = torch.arange(T)[None] < lens[:, None]
    ids = torch.where(attn, torch.randint(0, 128, (B, T), generator=g), 0)
    loss = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        p = int(torch.randint(1, int(lens[b]) - 1, (1,), generator=g))
        loss[b, p:int(lens[b])] = True
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                      batch_size=[B])


def reference_loss(model, batch, agg: str) -> torch.Tensor:
    """The documented SFT loss in float64 (fsdpfn.ops aggregate modes, written out here)."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"].long()).logits
    assert logits.dtype == torch.float64
    logp = torch.zeros(ids.shape, dtype=torch.float64)
    logp[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    m = mask.double()
    nll = -(logp * m)
    if agg == "token-mean":
        return nll.sum() / m.sum()
    rows = m.sum(-1) > 0  # the seq-mean modes average over rows with a loss token
    per_row = nll.sum(-1) if agg == "seq-mean-token-sum" else nll.sum(-1) / m.sum(-1).clamp(min=1)
    return per_row[rows].mean()


def read_adapters(path) -> dict[str, torch.Tensor]:
    return {k: v.double() for k, v in load_file(str(path / "adapter_model.safetensors")).items()}


def peft_name(key: str) -> str:
    """peft's file key (…q_proj.lora_A.weight) -> its in-model name (…lora_A.default.weight)."""
    return key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
        ".lora_B.weight", ".lora_B.default.weight")


def adapters_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


CASES = [
    # target_modules, SFTConfig.agg, micro-batches (the loss is normalised over the whole batch)
    pytest.param(("all-linear",), "token-mean", 1, id="all-linear-token-mean"),
    pytest.param(("q_proj", "v_proj", "down_proj"), "seq-mean-token-mean", 2,
                 id="subset-seq-mean-token-mean-2mbs"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("targets, agg, n_mbs", CASES)
def test_two_sft_steps_match_peft_float64(model_dir, tmp_path, targets, agg, n_mbs):
    import peft
    from transformers import AutoModelForCausalLM

    opt = ff.OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, schedule="constant",
                             warmup_steps=0, max_grad_norm=None)
    cfg = ff.EngineConfig(model_path=str(model_dir), dtype="float32",
                          lora=ff.LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=targets),
                          optimizer=opt, mb_spec=ff.MicroBatchSpec(n_mbs=n_mbs))
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    state = ff.shard_model(cfg, mesh)
    modules = ALL_LINEAR if targets == ("all-linear",) else sorted(targets)

    ff.export_hf(state, tmp_path / "step0")
    exported = read_adapters(tmp_path / "step0")
    written = json.loads((tmp_path / "step0" / "adapter_config.json").read_text())
    assert sorted(written["target_modules"]) == modules
    assert written["r"] == RANK and written["lora_alpha"] == ALPHA

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64,
                                                attn_implementation="eager")
    ref = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA,
                                                    target_modules=modules, lora_dropout=0.0))
    ref.eval()  # no dropout anywhere (lora_dropout=0 and the base's dropout off, as fsdpfn's)
    trainable = dict(ref.named_parameters())
    assert {peft_name(k) for k in exported} == {n for n, p in trainable.items() if p.requires_grad}
    assert len(exported) == 2 * len(modules) * 2  # A and B, per target, per layer (2 layers)
    with torch.no_grad():
        for key, value in exported.items():
            trainable[peft_name(key)].copy_(value)
    assert all(float(v.abs().max()) == 0 for k, v in exported.items() if "lora_B" in k)
    adam = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR,
                             betas=BETAS, eps=EPS, weight_decay=WD)
    before = {k: v.clone() for k, v in exported.items()}

    for step in (1, 2):
        batch = make_batch(10 + step)
        state, stats = ff.sft_step(state, batch, ff.SFTConfig(agg=agg))
        adam.zero_grad()
        loss = reference_loss(ref, batch, agg)
        loss.backward()
        loss = loss.item()
        grad_norm = math.sqrt(sum(float(p.grad.square().sum())
                                  for p in ref.parameters() if p.requires_grad))
        adam.step()
        assert math.isclose(float(stats["loss"]), loss, rel_tol=1e-5), (stats, loss)
        assert math.isclose(float(stats["grad_norm"]), grad_norm, rel_tol=1e-4), (stats,
                                                                                  grad_norm)
        assert math.isclose(float(stats["lr"]), LR, rel_tol=1e-7)

        ff.export_hf(state, tmp_path / f"step{step}")
        got = read_adapters(tmp_path / f"step{step}")
        want = adapters_of(ref)
        assert {peft_name(k) for k in got} == set(want)
        for key, value in got.items():
            w = want[peft_name(key)]
            assert not torch.equal(value, before[key]), f"{key} did not move at step {step}"
            # 1e-5 relative to the matrix's scale: float32 gradients of elements near 0 carry
            # an absolute error of ~1e-7 of the largest (measured: <= 2e-6 of the scale)
            torch.testing.assert_close(value, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()),
                                       msg=lambda m, key=key: f"step {step} {key}: {m}")
        before = got

    # the base did not change: merged export = the original weights + (alpha/rank)·B @ A
    ff.export_hf(state, tmp_path / "merged", merged=True, dtype="float32")
    merged = {k: v.double() for k, v in load_file(str(tmp_path / "merged" /
                                                      "model.safetensors")).items()}
    original = {k: v.double() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    assert set(merged) == set(original)
    adapters = {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight"): None
                for k in got if ".lora_A." in k}
    for name, w0 in original.items():
        module = name.removesuffix(".weight")
        if module in adapters:
            a = got[f"base_model.model.{module}.lora_A.weight"]
            b = got[f"base_model.model.{module}.lora_B.weight"]
            torch.testing.assert_close(merged[name], w0 + (ALPHA / RANK) * b @ a, rtol=0,
                                       atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert torch.equal(merged[name], w0), f"{name} changed"
