"""LoRA through peft on FSDP2, on CPU ranks (gloo).

What is shown, each against a simple reference:

* a LoRA sft_step learns; only adapters are trainable, in the optimizer and its state, and the
  frozen base is kept in the compute dtype (bfloat16: no float32 copy of it);
* dp=2 equals dp=1 after one step, and tp=2 equals tp=1 (column, row and replicated-kv layers);
* forward_logp(adapters=False) equals a state of the base model alone;
* an adapter-only checkpoint round trip resumes exactly (the checkpoint holds adapters alone);
* peft's PeftModel loads the adapter export and gives the trainer's log-probs; the merged export
  equals W + alpha/r · B @ A computed in float64 from the base and the exported adapters;
* a merged push (DiskTarget) writes the merged export's tensors under the base names;
* adapters pushed to the built-in server (SGLang's /load_lora_adapter) reproduce the trainer's
  log-probs, a second push replaces the first, and unloading serves the base again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn.engine import lora
from fsdpfn.testing import run_spmd, save_tiny_model, tiny_qwen2_config

pytestmark = pytest.mark.dist

LORA = ff.LoRAConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", tiny_qwen2_config(),
                               seed=0))


def _batch(seed: int = 0, B: int = 4, T: int = 12) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(6, T + 1, (B,), generator=g)
    ids = torch.randint(0, 128, (B, T), generator=g)
    attn = torch.arange(T)[None] < lens[:, None]
    loss = attn.clone()
    loss[:, :2] = False
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                      batch_size=[B])


def _state(model_dir, *, dp=-1, tp=1, dtype="float32", lora_cfg=LORA, optimizer=True):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=dp, tp=tp), device_type="cpu")
    opt = ff.OptimizerConfig(lr=1e-2) if optimizer else None
    source = ({"model_path": model_dir} if isinstance(model_dir, str)
              else {"model_config": model_dir})
    return ff.shard_model(ff.EngineConfig(dtype=dtype, optimizer=opt, lora=lora_cfg, **source),
                          mesh)


def _adapters(state) -> dict:
    """Every adapter matrix whole (float64, on every rank)."""
    return {k: v.double() for k, v in lora.gather_adapters(state.model, device="cpu",
                                                           keep=True).items()}


def _rows(batch, mesh_dp_rank: int, dp: int) -> TensorDict:
    B = batch.batch_size[0]
    return batch[mesh_dp_rank * B // dp:(mesh_dp_rank + 1) * B // dp]


# ---------------------------------------------------------------- rank functions


def _learns_bf16(model_dir):
    state = _state(model_dir, dtype="bfloat16")
    named = list(state.model.named_parameters())
    base = [(n, p) for n, p in named if not lora.is_adapter(n)]
    adapters = [(n, p) for n, p in named if lora.is_adapter(n)]
    in_opt = {id(p) for g in state.optimizer.param_groups for p in g["params"]}
    facts = {
        "base_frozen_bf16": all(not p.requires_grad and p.dtype == torch.bfloat16
                                for _, p in base),
        "adapters_fp32": all(p.requires_grad and p.dtype == torch.float32 for _, p in adapters),
        "optimizer_is_adapters": in_opt == {id(p) for _, p in adapters} and len(adapters) == 28,
    }
    batch = _batch(0)
    losses = []
    for _ in range(8):
        state, stats = ff.sft_step(state, batch, ff.SFTConfig())
        losses.append(float(stats["loss"]))
    facts["state_is_adapters"] = {id(p) for p in state.optimizer.state} == \
        {id(p) for _, p in adapters}
    facts["grad_norm_finite"] = bool(torch.isfinite(stats["grad_norm"]))
    return facts, losses


def _one_step(model_dir, dp, tp, config=None):
    state = _state(config if config is not None else model_dir, dp=dp, tp=tp)
    batch = _batch(1, B=4)
    local = _rows(batch, state.mesh.rank("dp"), state.mesh.dp)
    state, stats = ff.sft_step(state, local, ff.SFTConfig())
    logp = ff.forward_logp(state, local)["logp"]
    out = torch.zeros(4, logp.shape[1])
    B = local.batch_size[0]
    out[state.mesh.rank("dp") * B:(state.mesh.rank("dp") + 1) * B] = logp
    dist.all_reduce(out)
    out /= state.mesh.tp
    return _adapters(state), out, float(stats["loss"]), float(stats["grad_norm"])


def _base_vs_disabled(model_dir):
    state = _state(model_dir)
    for seed in range(2):
        state, _ = ff.sft_step(state, _batch(seed), ff.SFTConfig())
    base = _state(model_dir, lora_cfg=None, optimizer=False)
    batch = _batch(3)
    off = ff.forward_logp(state, batch, adapters=False)["logp"]
    on = ff.forward_logp(state, batch)["logp"]
    ref = ff.forward_logp(base, batch)["logp"]
    return float((off - ref).abs().max()), float((on - ref).abs().max())


def _checkpoint_round_trip(model_dir, root):
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    state = _state(model_dir)
    for seed in range(2):
        state, _ = ff.sft_step(state, _batch(seed), ff.SFTConfig())
    ff.save_checkpoint(state, root / "ckpt", extra={"step": 2})
    straight = []
    for seed in (2, 3):
        state, stats = ff.sft_step(state, _batch(seed), ff.SFTConfig())
        straight.append(float(stats["loss"]))
    fresh = _state(model_dir)
    fresh, extra = ff.load_checkpoint(fresh, root / "ckpt")
    resumed = []
    for seed in (2, 3):
        fresh, stats = ff.sft_step(fresh, _batch(seed), ff.SFTConfig())
        resumed.append(float(stats["loss"]))
    keys = sorted(dcp.FileSystemReader(str(root / "ckpt")).read_metadata().state_dict_metadata)
    same = all(torch.equal(a, b) for a, b in zip(_adapters(state).values(),
                                                 _adapters(fresh).values()))
    return straight, resumed, extra, keys, same, fresh.step


def _exports(model_dir, root):
    root = Path(root)
    state = _state(model_dir)
    for seed in range(3):
        state, _ = ff.sft_step(state, _batch(seed), ff.SFTConfig())
    ff.export_hf(state, root / "adapter", dtype="float32")
    ff.export_hf(state, root / "merged", dtype="float32", merged=True)
    ff.push_weights(state, ff.DiskTarget(root / "push", dtype="float32"))
    logp = ff.forward_logp(state, _batch(5))["logp"]
    return logp, state.version


# ---------------------------------------------------------------- tests


def test_lora_sft_learns_with_only_adapters_trainable_and_a_bf16_base(model_dir, spmd1):
    facts, losses = run_spmd(_learns_bf16, 1, args=(model_dir,), timeout=300, pool=spmd1)[0]
    assert all(facts.values()), facts
    assert losses[-1] < losses[0] - 0.3, losses


def test_dp2_equals_dp1_after_one_step(model_dir, spmd1, spmd2):
    # two calls inside pytest's 300 s: each bounded below half of it, so a hang reports its
    # ranks' stacks (SpmdTimeout) before pytest's own timeout kills the test
    one = run_spmd(_one_step, 1, args=(model_dir, 1, 1), timeout=140, pool=spmd1)[0]
    two = run_spmd(_one_step, 2, args=(model_dir, 2, 1), timeout=140, pool=spmd2)
    for got in two:
        assert got[0].keys() == one[0].keys()
        for key in one[0]:
            torch.testing.assert_close(got[0][key], one[0][key], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[1], one[1], atol=1e-5, rtol=1e-5)
        assert abs(got[2] - one[2]) < 1e-5 and abs(got[3] - one[3]) < 1e-4


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["colwise-kv", "replicated-kv"])
def test_tp2_equals_tp1(kv_heads, spmd1, spmd2):
    config = tiny_qwen2_config(num_key_value_heads=kv_heads).to_dict()
    one = run_spmd(_one_step, 1, args=(None, 1, 1, config), timeout=140, pool=spmd1)[0]
    two = run_spmd(_one_step, 2, args=(None, 1, 2, config), timeout=140, pool=spmd2)
    for got in two:
        for key in one[0]:
            torch.testing.assert_close(got[0][key], one[0][key], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[1], one[1], atol=1e-5, rtol=1e-5)
        assert abs(got[3] - one[3]) < 1e-4


def test_adapters_false_equals_the_base_model(model_dir, spmd1):
    off, on = run_spmd(_base_vs_disabled, 1, args=(model_dir,), timeout=300, pool=spmd1)[0]
    assert off < 1e-6, off
    assert on > 1e-3, on  # the adapters did learn something: the check is not vacuous


def test_adapter_only_checkpoint_round_trip(model_dir, tmp_path, spmd1):
    straight, resumed, extra, keys, same, step = run_spmd(
        _checkpoint_round_trip, 1, args=(model_dir, str(tmp_path)), timeout=300, pool=spmd1)[0]
    assert resumed == straight and same and step == 4 and extra == {"step": 2}
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(lora.is_adapter(k) for k in model_keys), model_keys[:4]
    optim_keys = [k for k in keys if k.startswith("optim.state.")]
    assert optim_keys and all(lora.is_adapter(k) for k in optim_keys), optim_keys[:4]


def _checkpoint_of_other_adapters(model_dir, root):
    """A checkpoint of alpha=8 adapters loaded into a state whose adapters scale by 32, or
    cover other layers: the error, for each."""
    state = _state(model_dir)
    ff.save_checkpoint(state, Path(root) / "ckpt")
    errors = []
    for cfg in (ff.LoRAConfig(rank=4, alpha=32.0), ff.LoRAConfig(rank=4, alpha=8.0,
                                                                 target_modules=["q_proj"])):
        try:
            ff.load_checkpoint(_state(model_dir, lora_cfg=cfg), Path(root) / "ckpt")
            errors.append(None)
        except ff.CheckpointError as exc:
            errors.append(str(exc))
    return errors


def test_a_checkpoint_of_other_adapters_is_refused_by_name(model_dir, tmp_path, spmd1):
    alpha, targets = run_spmd(_checkpoint_of_other_adapters, 1,
                              args=(model_dir, str(tmp_path)), timeout=300, pool=spmd1)[0]
    assert alpha is not None and "architecture.lora_alpha: must match" in alpha, alpha
    assert "8.0" in alpha and "32.0" in alpha and "EngineConfig.lora" in alpha
    assert targets is not None and "architecture.lora_targets: must match" in targets, targets


def _hf_logp(model, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"].long()).logits.double()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
    out[:, 1:] = lp
    return out * batch["attention_mask"]


def test_exports_peft_loads_adapters_and_merged_equals_base_plus_delta(model_dir, tmp_path,
                                                                       spmd1):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    logp, version = run_spmd(_exports, 1, args=(model_dir, str(tmp_path)), timeout=300,
                             pool=spmd1)[0]
    batch = _batch(5)
    # peft loads the adapter export onto the base and reproduces the trainer's log-probs
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert Path(config["base_model_name_or_path"]) == Path(model_dir).resolve()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(_hf_logp(peft_model, batch), logp.double(), atol=2e-4, rtol=0)
    # merged = W + alpha/r · B @ A in float64, from the base's file and the exported adapters
    base_sd = load_file(str(Path(model_dir) / "model.safetensors"))
    adapters = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert sorted(merged) == sorted(base_sd)
    n_targets = 0
    for name, w in base_sd.items():
        a = adapters.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        want = w.double()
        if a is not None:
            b = adapters[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
            want = want + 2.0 * (b.double() @ a.double())
            n_targets += 1
        torch.testing.assert_close(merged[name].double(), want, atol=1e-6, rtol=1e-6)
    assert n_targets == 14
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    torch.testing.assert_close(_hf_logp(hf.eval(), batch), logp.double(), atol=2e-4, rtol=0)
    # a merged push carries the same tensors under the base names
    pushed = {}
    for file in (tmp_path / "push" / f"v{version}").glob("*.safetensors"):
        pushed.update(load_file(str(file)))
    assert sorted(pushed) == sorted(merged)
    for name in merged:
        torch.testing.assert_close(pushed[name], merged[name], atol=1e-6, rtol=1e-6)


def _push_adapters(model_dir, root, url):
    from fsdpfn.weights.adapter import AdapterTarget
    from fsdpfn.wire.http import call

    target = AdapterTarget(url, root=root, lora_name="policy")
    state = _state(model_dir)
    probe = _batch(7, B=1, T=10)
    ids = probe["input_ids"][0][probe["attention_mask"][0]].tolist()
    results = []
    for seed in range(2):  # the second push replaces the first adapter
        state, _ = ff.sft_step(state, _batch(seed), ff.SFTConfig())
        receipt = ff.push_weights(state, target)
        served = call(url, "/forward", {"input_ids": [ids]}, timeout=60)
        mine = ff.forward_logp(state, probe)["logp"][0, :len(ids)]
        results.append((receipt.version, served["weight_version"], served["token_logprobs"][0],
                        mine.tolist()))
    info = call(url, "/unload_lora_adapter", {"lora_name": "policy"}, timeout=60)
    served = call(url, "/forward", {"input_ids": [ids]}, timeout=60)
    base = ff.forward_logp(state, probe, adapters=False)["logp"][0, :len(ids)]
    return results, info, served["token_logprobs"][0], base.tolist()


def test_pushed_adapters_on_the_built_in_server_reproduce_the_trainers_logprobs(model_dir,
                                                                                 tmp_path, spmd1):
    from fsdpfn.rollout import launch_server

    server = launch_server(model_dir, log_dir=tmp_path, health_timeout=120)
    try:
        results, info, served_base, base = run_spmd(
            _push_adapters, 1, args=(model_dir, str(tmp_path / "adapters"), server.url),
            timeout=300, pool=spmd1)[0]
    finally:
        server.close()
    for version, served_version, served, mine in results:
        assert served_version == version
        torch.testing.assert_close(torch.tensor(served), torch.tensor(mine), atol=2e-4, rtol=0)
    assert results[0][3] != results[1][3]  # the second push served the second adapter
    assert info["loaded_adapters"] == {} and info["success"] is True
    torch.testing.assert_close(torch.tensor(served_base), torch.tensor(base), atol=2e-4, rtol=0)


def _refused_pushes(model_dir, other_dir, root, url):
    """A good adapter push, then one the server refuses (adapters of another model's shapes),
    then a merged push followed by an adapter push: what the server serves after each."""
    from fsdpfn.weights.adapter import AdapterTarget
    from fsdpfn.wire.http import call

    probe = _batch(7, B=1, T=10)
    ids = probe["input_ids"][0][probe["attention_mask"][0]].tolist()

    def served():
        out = call(url, "/forward", {"input_ids": [ids]}, timeout=60)
        return out["weight_version"], out["token_logprobs"][0]

    state = _state(model_dir)
    state, _ = ff.sft_step(state, _batch(0), ff.SFTConfig())
    ff.push_weights(state, AdapterTarget(url, root=Path(root) / "a", lora_name="policy"))
    good = served()
    other = _state(other_dir)
    other, _ = ff.sft_step(other, _batch(1), ff.SFTConfig())
    errors = []
    try:
        ff.push_weights(other, AdapterTarget(url, root=Path(root) / "b", lora_name="policy"))
    except ff.WeightSyncError as exc:
        errors.append(str(exc))
    after_refusal = served()
    ff.push_weights(state, ff.RolloutTarget(url))  # merged weights, whole
    merged = served()
    state = ff.sft_step(state, _batch(2), ff.SFTConfig())[0]
    try:
        ff.push_weights(state, AdapterTarget(url, root=Path(root) / "a", lora_name="policy"))
    except ff.WeightSyncError as exc:
        errors.append(str(exc))
    return good, after_refusal, merged, served(), errors


def test_a_refused_adapter_push_leaves_the_server_serving_what_it_served(model_dir, tmp_path,
                                                                         spmd1):
    """A refusal other than SGLang's "already exists" is raised as it is: the server keeps the
    adapter it served (no unload, no version the trainer never made). An adapter pushed onto
    the merged weights of a LoRA trainer's whole push is refused (it would count twice)."""
    from fsdpfn.rollout import launch_server

    other_dir = str(save_tiny_model(tmp_path / "other", tiny_qwen2_config(intermediate_size=96),
                                    seed=1))
    server = launch_server(model_dir, log_dir=tmp_path, health_timeout=120)
    try:
        good, after_refusal, merged, last, errors = run_spmd(
            _refused_pushes, 1, args=(model_dir, other_dir, str(tmp_path), server.url),
            timeout=300, pool=spmd1)[0]
    finally:
        server.close()
    assert len(errors) == 2, errors
    assert "B @ A must have the weight's shape" in errors[0], errors[0]
    assert after_refusal == good
    assert merged[0] == good[0]  # the same state version, pushed whole
    torch.testing.assert_close(torch.tensor(merged[1]), torch.tensor(good[1]), atol=2e-4, rtol=0)
    assert "count them twice" in errors[1], errors[1]
    assert last == merged
