"""shard_model parity: sharded logits equal the unsharded model's, gathered weights equal the
originals exactly (also for a vocabulary tp does not divide and for fewer kv heads than tp),
memory_efficient_load equals a plain load, what tp must divide is checked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdpfn as ff
from fsdpfn.engine.shard import kv_heads_of_rank
from fsdpfn.engine.state import local_tensor
from fsdpfn.testing import (save_tiny_model, sharded_logits, tiny_llama_config,
                            tiny_qwen2_config)

# float32 throughout. Sharding changes only the order of float32 sums (a tp=2 row-parallel
# matmul adds two partial sums of 32 products each instead of one of 64); each reordering moves
# a result by a few ulps (~1e-7 relative), and two layers of 64-wide sums stay below 1e-5.
RTOL = ATOL = 1e-5


def _configs(tmp):
    out = {}
    for name, cfg in (("qwen2", tiny_qwen2_config()), ("llama", tiny_llama_config()),
                      ("qwen2_tied", tiny_qwen2_config(tie_word_embeddings=True)),
                      # a prime vocabulary (uneven rows per tp rank), one kv head (replicated)
                      ("qwen2_v97_kv1", tiny_qwen2_config(vocab_size=97, num_key_value_heads=1)),
                      ("llama_v97_tied", tiny_llama_config(vocab_size=97,
                                                           tie_word_embeddings=True))):
        out[name] = str(save_tiny_model(tmp / name, cfg, seed=3))
    return out


def parity(paths: dict, tp: int):
    from transformers import AutoModelForCausalLM

    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=tp), device_type="cpu")
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(0))
    results = {}
    for name, path in paths.items():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ref_logits = ref(input_ids=ids).logits
        state = ff.shard_model(ff.EngineConfig(model_path=path, dtype="float32"), mesh)
        logits = sharded_logits(state, ids)
        full = get_model_state_dict(state.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
        # cpu_offload gathers the full state dict onto rank 0 only
        exact = (torch.distributed.get_rank() != 0
                 or all(torch.equal(full[f"lm.{k}"], v) for k, v in ref.state_dict().items()))
        ref_logits = ref_logits.detach()
        results[name] = (float((logits - ref_logits).abs().max()),
                         torch.allclose(logits, ref_logits, rtol=RTOL, atol=ATOL), exact)
    return results


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return _configs(tmp_path_factory.mktemp("models"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,tp", [(2, 1), (2, 2), (4, 2), (4, 4)],
                         ids=["dp2", "tp2", "dp2xtp2", "tp4"])
def test_sharded_logits_and_weights_match(model_dirs, world, tp, spmd2, spmd4):
    pool = spmd2 if world == 2 else spmd4
    for rank_result in pool.run(parity, args=(model_dirs, tp), timeout=240):
        for name, (max_diff, close, exact) in rank_result.items():
            assert close, f"{name}: max |logit diff| {max_diff}"
            assert exact, f"{name}: gathered state dict differs from the checkpoint"


def local_shards(path: str, efficient: bool):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=2), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(
        model_path=path, dtype="float32", fsdp=ff.FSDPConfig(memory_efficient_load=efficient)),
        mesh)
    return {n: local_tensor(p).detach().clone() for n, p in state.model.named_parameters()}


@pytest.mark.timeout(460)
def test_memory_efficient_load_equals_plain_load(model_dirs, spmd4):
    path = model_dirs["qwen2_tied"]
    fast = spmd4.run(local_shards, args=(path, True), timeout=200)
    plain = spmd4.run(local_shards, args=(path, False), timeout=200)
    for a, b in zip(fast, plain):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


def bad_tp(model_config: dict):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1, tp=4), device_type="cpu")
    try:
        ff.shard_model(ff.EngineConfig(model_config=model_config), mesh)
    except ff.ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(260)
def test_tp_must_divide_query_heads_and_leave_every_rank_vocabulary_rows(spmd4):
    heads = tiny_qwen2_config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
    for message in spmd4.run(bad_tp, args=(heads.to_dict(),), timeout=100):
        assert message == ("ParallelStrategy.tp: must divide the model's num_attention_heads, "
                           "got tp=4 and num_attention_heads=6")
    # 5 tokens over tp=4: ceil(5/4) = 2 rows each leaves the last rank none
    for message in spmd4.run(bad_tp, args=(tiny_qwen2_config(vocab_size=5).to_dict(),),
                             timeout=100):
        assert message == ("ParallelStrategy.tp: every tensor-parallel rank must hold at least "
                           "one vocabulary row (ceil(vocab_size / tp) rows each), got tp=4 and "
                           "vocab_size=5, which leaves the last rank none")


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(n_kv=st.integers(1, 12), group=st.integers(1, 8), tp=st.integers(1, 16), data=st.data())
def test_kv_heads_of_rank_serve_each_query_head_its_own_kv_head(n_kv, group, tp, data):
    """Local query head i (global rank*q + i) attends with local kv head i // (q / len(heads))
    (fsdpfn's attention repeats kv heads by the shape ratio): it must be kv head
    (rank*q + i) // group, as in the unsharded model."""
    n_heads = n_kv * group
    assume(n_heads % tp == 0)
    rank = data.draw(st.integers(0, tp - 1))
    q = n_heads // tp
    heads = kv_heads_of_rank(n_heads, n_kv, tp, rank)
    assert q % len(heads) == 0
    assert all(heads[i // (q // len(heads))] == (rank * q + i) // group for i in range(q))
    if tp % n_kv == 0 and tp >= n_kv:  # one kv head per rank, the fewest possible
        assert len(heads) == 1


def unsupported_options():
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    base = dict(model_config=tiny_qwen2_config().to_dict(), dtype="float32")
    out = []
    for extra in (dict(lora=ff.LoRAConfig(), is_critic=True), dict(attn_impl="varlen")):
        try:
            ff.shard_model(ff.EngineConfig(**base, **extra), mesh)
            out.append(None)
        except ff.ConfigError as exc:
            out.append(str(exc))
    return out


@pytest.mark.timeout(120)
def test_unsupported_options_fail_loudly(spmd1):
    lora, varlen = spmd1.run(unsupported_options, timeout=100)[0]
    assert lora is not None and lora.startswith("lora: adapters on a critic are not supported")
    assert varlen == "attn_impl: 'varlen' needs CUDA, got device type 'cpu' (use 'auto' or 'sdpa')"


def bf16_master_learns():
    from fsdpfn.engine.optim import KahanAdamW
    from fsdpfn.testing import random_batch

    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(
        model_config=tiny_qwen2_config().to_dict(), dtype="bfloat16", optimizer_dtype="bfloat16",
        optimizer=ff.OptimizerConfig(lr=3e-3)), mesh)
    batch = random_batch(8, 12, seed=1)
    losses = []
    for _ in range(20):
        state, stats = ff.sft_step(state, batch, ff.SFTConfig())
        losses.append(float(stats["loss"]))
    dtypes = {local_tensor(p).dtype for p in state.model.parameters()}
    return losses, isinstance(state.optimizer, KahanAdamW), dtypes


@pytest.mark.timeout(200)
def test_bf16_master_weights_train_with_kahan_adamw(spmd2):
    for losses, kahan, dtypes in spmd2.run(bf16_master_learns, timeout=150):
        assert kahan and dtypes == {torch.bfloat16}
        assert losses[-1] < 0.7 * losses[0], losses
