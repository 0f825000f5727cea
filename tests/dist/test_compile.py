"""EngineConfig.compile (every decoder block's forward through torch.compile) computes what the
model's own eager forward computes, on two CPU ranks (gloo, float32) under dp and cp, with and
without activation checkpointing: forward_logp, one sft_step's loss and its update, against HF's
float32 eager model run here. A state built with compile=True really runs compiled blocks, and
activation checkpointing still wraps them. tp > 1 is refused on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing.models import hf_reference_logp, save_family_model, tiny_family_configs

LENGTHS = (37, 21, 30, 12)
OPT = dict(lr=1.0, eps=1.0, betas=(0.0, 0.0), weight_decay=0.0, max_grad_norm=None)


def batch_of(seed: int = 0):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    attn = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    ids = torch.where(attn, torch.randint(0, 131, (len(LENGTHS), T), generator=g), 0)
    loss = attn.clone()
    loss[:, :3] = False
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss},
                      batch_size=[len(LENGTHS)])


def reference(model_dir: str, batch):
    """HF's eager float32 forward: logp [B, T], mean NLL, the update of one sign-like step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    logp, _ = hf_reference_logp(model, batch[K.INPUT_IDS], batch[K.ATTENTION_MASK])
    mask = batch[K.LOSS_MASK]
    nll = -(logp * mask).sum() / mask.sum()
    nll.backward()
    deltas = {n: -p.grad / (p.grad.abs() + 1.0) for n, p in model.named_parameters()}
    return logp.detach(), float(nll.detach()), deltas


def _full(state):
    sd = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    return {k[len("lm."):]: v.clone() for k, v in sd.items()}


def compiled_run(model_dir, tp, cp, checkpointing, batch):
    """forward_logp twice (two packed lengths: the second compiles the dynamic length), then one
    sft_step: (logp, loss, deltas, (blocks compiled, layers), checkpointed block calls) on
    rank 0."""
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=tp, cp=cp), device_type="cpu")
    cfg = ff.EngineConfig(model_path=model_dir, dtype="float32", compile=True,
                          gradient_checkpointing=checkpointing,
                          optimizer=ff.OptimizerConfig(**OPT))
    state = ff.shard_model(cfg, mesh)
    compiled = sum(hasattr(getattr(m.__dict__.get("forward"), "compiled", None),
                           "_torchdynamo_orig_callable")
                   for m in state.model.modules())
    layers = state.hf_config.num_hidden_layers
    checkpointed = []  # activation checkpointing still runs around the compiled blocks
    for m in state.model.modules():
        if "_gradient_checkpointing_func" in m.__dict__:
            func = m._gradient_checkpointing_func
            m._gradient_checkpointing_func = lambda *a, f=func, **k: (checkpointed.append(1),
                                                                     f(*a, **k))[1]
    local = ff.shard_batch(batch, mesh)
    ff.forward_logp(state, ff.shard_batch(batch[:2], mesh))
    logp = ff.gather_batch(ff.forward_logp(state, local), mesh)[K.LOGP]
    before = _full(state)
    state, stats = ff.sft_step(state, local)
    after = _full(state)
    if dist.get_rank() != 0:
        return None
    return (logp, float(stats["loss"]), {k: after[k] - before[k] for k in after},
            (compiled, layers), len(checkpointed))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    families = tiny_family_configs()
    return {name: str(save_family_model(root / name, families[name], seed=4))
            for name in ("qwen3", "gemma2")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,tp,cp,checkpointing", [
    ("qwen3", 1, 1, False), ("qwen3", 1, 2, True),
    ("gemma2", 1, 1, True)])
def test_compiled_blocks_equal_the_models_own_forward(family, tp, cp, checkpointing, dirs,
                                                      spmd2):
    batch = batch_of()
    ref_logp, ref_nll, ref_deltas = reference(dirs[family], batch)
    logp, loss, deltas, compiled, checkpointed = spmd2.run(
        compiled_run, args=(dirs[family], tp, cp, checkpointing, batch), timeout=500)[0]
    assert compiled[0] == compiled[1], f"{compiled[0]} blocks compiled of {compiled[1]}"
    # one sft_step: every block checkpointed once per micro-batch, none without checkpointing
    assert (checkpointed >= compiled[1]) if checkpointing else checkpointed == 0, checkpointed
    gap = float((logp - ref_logp).abs().max())
    assert gap <= 1e-5, f"{family} tp={tp} cp={cp}: logp gap {gap:.3g}"
    assert abs(loss - ref_nll) <= 1e-5
    for name, want in ref_deltas.items():
        torch.testing.assert_close(deltas[name], want, rtol=1e-4, atol=5e-6,
                                   msg=lambda m, name=name: f"{family} {name}: {m}")


def build_tp(model_dir):
    from fsdpfn.errors import ConfigError

    mesh = ff.build_mesh(ff.ParallelStrategy(tp=2), device_type="cpu")
    try:
        ff.shard_model(ff.EngineConfig(model_path=model_dir, compile=True, optimizer=None), mesh)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(300)
def test_compile_with_tensor_parallelism_is_refused_on_every_rank(dirs, spmd2):
    messages = spmd2.run(build_tp, args=(dirs["qwen3"],), timeout=200)
    assert all(m is not None and m.startswith("compile:") and "tp=2" in m
               for m in messages), messages
