"""Tensor parallelism over any vocabulary, on CPU ranks (gloo).

The op: vocab_parallel_logprobs on 2 ranks against the unsharded float64 computation.
Each rank holds rows [vocab_start, vocab_start + V_local) of the lm_head (uneven splits, and an
empty shard when V < world size); hidden, targets and the upstream grads are identical on every
rank. Values, the all-reduced hidden grad and each rank's weight-shard grad must equal the float64
full-logits reference. Ranks return their errors instead of raising, so the verdict is taken on the
parent and no rank is left waiting in a collective.

Tolerance: float32 vs float64 on logits |z| <~ 3 sqrt(H) / temperature; as in the unit tests,
1e-5 scaled by that magnitude (a few float32 ulp of the largest logit, summed over <= H terms).

The engine: a model whose vocabulary tp does not divide (97 tokens; any size under hypothesis) and
with fewer kv heads than tp, at tp=2, dp=2 x tp=2 and tp=4, equals tp=1 (log-probs, entropies,
gradients, trained parameters); its checkpoints load across tp, and its exports and pushes hold
the real [V, H] embedding and lm_head.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import Shard

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.errors import ConfigError
from fsdpfn.ops import chunked_logprobs, vocab_parallel_logprobs
from fsdpfn.ops.logprobs import vocab_shard_range
from fsdpfn.testing import (random_batch, run_spmd, save_tiny_model, tiny_llama_config,
                            tiny_qwen2_config, tiny_qwen3_config)

WORLD = 2
pytestmark = pytest.mark.dist


def _reference(hidden, weight, targets, temperature, g_logp, g_ent):
    """float64 logp, entropy and grads of sum(g_logp logp + g_ent H) through the full logits."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    z = (h @ w.t()) / temperature
    log_p = z - torch.logsumexp(z, dim=-1, keepdim=True)
    logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    obj = (logp * g_logp.double()).sum() + (0.0 if g_ent is None else (ent * g_ent.double()).sum())
    if hidden.shape[0]:
        obj.backward()
        return logp.detach(), ent.detach(), h.grad, w.grad
    return logp.detach(), ent.detach(), torch.zeros_like(h), torch.zeros_like(w)


def _max_err(actual, expected) -> float:
    return float((actual.double() - expected.double()).abs().max()) if actual.numel() else 0.0


def _vocab_parallel_case(n, hdim, vocab, chunk_size, temperature, with_entropy, seed):
    """Runs on every rank; returns this rank's errors and outputs for the parent to judge."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)  # the same draws on every rank: hidden is replicated
    hidden = torch.randn(n, hdim)
    weight = torch.randn(vocab, hdim)
    targets = torch.randint(0, vocab, (n,))
    g_logp, g_ent = torch.randn(n), (torch.randn(n) if with_entropy else None)
    sizes = [len(part) for part in torch.arange(vocab).tensor_split(world)]  # uneven, maybe empty
    start = sum(sizes[:rank])
    shard = weight[start:start + sizes[rank]].clone().requires_grad_()
    h = hidden.clone().requires_grad_()

    logp, ent = vocab_parallel_logprobs(h, shard, targets, group=dist.group.WORLD, vocab_start=start,
                                        chunk_size=chunk_size, temperature=temperature,
                                        with_entropy=with_entropy)
    obj = (logp * g_logp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    obj.backward()

    ref_lp, ref_h, ref_gh, ref_gw = _reference(hidden, weight, targets, temperature, g_logp, g_ent)
    # the single-device chunked op on the full weight: the sharded one must agree with it too
    full_lp, _ = chunked_logprobs(hidden, weight, targets, chunk_size=chunk_size, temperature=temperature)
    return {
        "entropy_is_none": ent is None,
        "logp": _max_err(logp, ref_lp),
        "entropy": _max_err(ent, ref_h) if with_entropy else 0.0,
        "grad_hidden": _max_err(h.grad, ref_gh),
        "grad_shard": _max_err(shard.grad, ref_gw[start:start + sizes[rank]]),
        "vs_chunked": _max_err(logp, full_lp),
        "logp_values": logp.detach(),
        "grad_hidden_values": h.grad.detach(),
    }


@pytest.fixture(scope="module")
def pool(spmd2):
    return spmd2  # the session's ranks (WORLD = 2)


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(n=st.integers(0, 19), hdim=st.integers(1, 8), vocab=st.integers(1, 21), chunk_size=st.integers(1, 12),
       temperature=st.sampled_from([1.0, 0.7]), with_entropy=st.booleans(), seed=st.integers(0, 2**16))
def test_vocab_parallel_matches_unsharded_reference(pool, n, hdim, vocab, chunk_size, temperature,
                                                    with_entropy, seed):
    results = run_spmd(_vocab_parallel_case, WORLD, pool=pool, timeout=60.0,
                       args=(n, hdim, vocab, chunk_size, temperature, with_entropy, seed))
    tol = 1e-5 * max(1.0, 3.0 * math.sqrt(hdim) / temperature)
    for rank, res in enumerate(results):
        assert res["entropy_is_none"] == (not with_entropy)
        for key in ("logp", "entropy", "grad_hidden", "grad_shard", "vs_chunked"):
            assert res[key] <= tol, f"rank {rank}: {key} off by {res[key]:.3g} (tolerance {tol:.3g})"
    # every rank ends with the same values and the same (all-reduced) hidden grad
    for res in results[1:]:
        torch.testing.assert_close(res["logp_values"], results[0]["logp_values"], rtol=0, atol=0)
        torch.testing.assert_close(res["grad_hidden_values"], results[0]["grad_hidden_values"], rtol=0, atol=0)


def test_vocab_parallel_requires_a_group():
    with pytest.raises(ConfigError, match="group.*None"):
        vocab_parallel_logprobs(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long),
                                group=None, vocab_start=0)
    with pytest.raises(ConfigError, match=r"vocab_start.*-1"):
        vocab_parallel_logprobs(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(2, dtype=torch.long),
                                group=object(), vocab_start=-1)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(vocab=st.integers(0, 5000), n=st.integers(1, 16), data=st.data())
def test_vocab_shard_range_is_dtensor_shard_split(vocab, n, data):
    """The rows a tp rank holds are DTensor Shard(0)'s (torch.chunk's split): contiguous, in
    rank order, covering [0, V) once, ceil(V / n) each but the tail."""
    ranges = [vocab_shard_range(vocab, n, i) for i in range(n)]
    assert ranges[0][0] == 0 and ranges[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    i = data.draw(st.integers(0, n - 1))
    size, offset = Shard.local_shard_size_and_offset(vocab, n, i)
    start, stop = ranges[i]
    assert stop - start == size and (size == 0 or start == offset)


# ================================================================ the engine on any vocabulary
#
# tp=2, dp=2 x tp=2 and tp=4 on a 97-token vocabulary (prime: every tp rank but the last holds
# ceil(97 / tp) rows) with kv heads fewer than tp (replicated k/v projections), against tp=1 in
# one process and against float64 per-sequence log-probs. float32 throughout: sharding changes
# only the order of float32 sums (~1e-7 relative per reordering), so values agree to ~1e-6;
# a misplaced vocabulary row or kv head moves them by O(1e-1).

V_PRIME = 97
TIGHT = 1e-5  # log-probs and entropies (|logp| <~ 6); float64 vs float32 is ~1e-6 here
PARAM_TOL = 1e-6  # parameters after AdamW steps of size <= lr = 1e-2 (measured ~1e-8)
# AdamW with eps=1 makes the first update g / (|g| + 1): parameter deltas compare the gradients
# entry by entry; lr=1e-2 keeps the second step's forward close to the first's.
OPT = dict(lr=1e-2, eps=1.0, weight_decay=0.1, max_grad_norm=0.5)


def _engine_models(root: Path) -> dict[str, str]:
    return {"qwen2_v97_kv1": str(save_tiny_model(
                root / "qwen2", tiny_qwen2_config(vocab_size=V_PRIME, num_key_value_heads=1),
                seed=7)),
            "llama_v97_kv2_tied": str(save_tiny_model(
                root / "llama", tiny_llama_config(vocab_size=V_PRIME, tie_word_embeddings=True),
                seed=8))}


@pytest.fixture(scope="module")
def engine_models(tmp_path_factory):
    return _engine_models(tmp_path_factory.mktemp("vocab97"))


def _batch(vocab: int, seed: int = 0):
    return random_batch(8, 12, vocab_size=vocab, seed=seed, prompt_len=3)


def _full(state) -> dict[str, torch.Tensor]:
    """The HF-named full state dict (every rank takes part; rank 0 gets the tensors)."""
    sd = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    return {k.removeprefix("lm."): v.clone() for k, v in sd.items()}


def _engine_state(source: dict, tp: int):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=tp), device_type="cpu")
    return ff.shard_model(ff.EngineConfig(dtype="float32", optimizer=ff.OptimizerConfig(**OPT),
                                          **source), mesh), mesh


def engine_run(source: dict, tp: int, batch, steps: int = 2):
    """forward_logp (with entropy), then ``steps`` sft_steps: rank 0 returns the log-probs,
    entropies, gradient norms, the first step's parameter deltas and the final parameters."""
    state, mesh = _engine_state(source, tp)
    local = ff.shard_batch(batch, mesh)
    out = ff.gather_batch(ff.forward_logp(state, local, with_entropy=True), mesh)
    before, norms, delta = _full(state), [], None
    for _ in range(steps):
        state, stats = ff.sft_step(state, local, ff.SFTConfig())
        norms.append(float(stats["grad_norm"]))
        after = _full(state)
        if delta is None:
            delta = {k: after[k] - before[k] for k in after}
    if dist.get_rank() != 0:
        return None
    return {"logp": out[K.LOGP], "entropy": out[K.ENTROPY], "norms": norms, "delta": delta,
            "params": after}


def _reference_logp_entropy(model, batch):
    """float64, one sequence at a time, unpadded: logp and entropy of the next-token softmax."""
    B, T = batch[K.INPUT_IDS].shape
    logp = torch.zeros(B, T, dtype=torch.float64)
    ent = torch.zeros(B, T, dtype=torch.float64)
    with torch.no_grad():
        for b in range(B):
            n = int(batch[K.ATTENTION_MASK][b].sum())
            ids = batch[K.INPUT_IDS][b, :n]
            log_p = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].double(), -1)
            logp[b, 1:n] = log_p.gather(-1, ids[1:, None])[:, 0]
            ent[b, 1:n] = -(log_p.exp() * log_p).sum(-1)
    return logp, ent


def _assert_same_run(sharded: dict, ref: dict, what: str) -> None:
    close = functools.partial(torch.testing.assert_close, rtol=0)
    close(sharded["logp"], ref["logp"], atol=TIGHT, msg=f"{what}: logp")
    close(sharded["entropy"], ref["entropy"], atol=TIGHT, msg=f"{what}: entropy")
    assert sharded["norms"] == pytest.approx(ref["norms"], rel=1e-5), what
    assert sharded["params"].keys() == ref["params"].keys()
    for name in ref["params"]:
        close(sharded["delta"][name], ref["delta"][name], atol=PARAM_TOL, msg=f"{what}: Δ{name}")
        close(sharded["params"][name], ref["params"][name], atol=PARAM_TOL, msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def tp1_runs(engine_models, spmd1):
    batch = _batch(V_PRIME)
    return batch, {name: spmd1.run(engine_run, args=({"model_path": path}, 1, batch),
                                   timeout=200)[0]
                   for name, path in engine_models.items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["qwen2_v97_kv1", "llama_v97_kv2_tied"])
@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2), (4, 4)], ids=["tp2", "dp2xtp2", "tp4"])
def test_prime_vocabulary_and_few_kv_heads_match_tp1(engine_models, tp1_runs, spmd2, spmd4,
                                                     model, world, tp):
    from transformers import AutoModelForCausalLM

    batch, refs = tp1_runs
    pool = spmd2 if world == 2 else spmd4
    sharded = pool.run(engine_run, args=({"model_path": engine_models[model]}, tp, batch),
                       timeout=500)[0]
    _assert_same_run(sharded, refs[model], f"{model} dp={world // tp} tp={tp}")
    hf = AutoModelForCausalLM.from_pretrained(engine_models[model], dtype=torch.float64)
    ref_logp, ref_ent = _reference_logp_entropy(hf, batch)
    torch.testing.assert_close(sharded["logp"].double(), ref_logp, rtol=0, atol=TIGHT)
    torch.testing.assert_close(sharded["entropy"].double(), ref_ent, rtol=0, atol=TIGHT)
    assert sharded["params"]["model.embed_tokens.weight"].shape[0] == V_PRIME


@pytest.mark.timeout(600)
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(vocab=st.integers(2, 400), kv=st.sampled_from([1, 2]), tied=st.booleans(),
       arch=st.sampled_from(["qwen2", "qwen3"]))
@example(vocab=2, kv=1, tied=True, arch="qwen2").via("the smallest vocabulary tp=2 can split")
@example(vocab=V_PRIME, kv=1, tied=False, arch="qwen3").via("per-head q/k norms, one kv head")
def test_tp2_on_any_vocabulary_matches_tp1(spmd1, spmd2, vocab, kv, tied, arch):
    build = tiny_qwen2_config if arch == "qwen2" else tiny_qwen3_config
    config = build(vocab_size=vocab, num_key_value_heads=kv, tie_word_embeddings=tied).to_dict()
    batch = _batch(vocab, seed=vocab)
    args = ({"model_config": config}, 1, batch, 1)
    ref = spmd1.run(engine_run, args=args, timeout=200)[0]
    sharded = spmd2.run(engine_run, args=(args[0], 2, batch, 1), timeout=200)[0]
    _assert_same_run(sharded, ref, f"{arch} vocab={vocab} kv={kv} tied={tied}")


# ---------------------------------------------------------------- checkpoints, export, push


def train_save_export_push(path: str, tp: int, root: str):
    """One sft_step at ``tp``, then a checkpoint, an HF export and a disk push of it."""
    state, mesh = _engine_state({"model_path": path}, tp)
    state, _ = ff.sft_step(state, ff.shard_batch(_batch(V_PRIME), mesh), ff.SFTConfig())
    ff.save_checkpoint(state, f"{root}/ckpt")
    ff.export_hf(state, f"{root}/hf", dtype="float32")
    ff.push_weights(state, ff.DiskTarget(f"{root}/push", dtype="float32", bucket_bytes=8192))
    full = _full(state)
    return full if dist.get_rank() == 0 else None


def load_and_save(path: str, tp: int, src: str, dst: str):
    """Load ``src`` at ``tp`` and save it again at ``dst``: rank 0 returns the full weights."""
    state, _ = _engine_state({"model_path": path}, tp)
    state, _ = ff.load_checkpoint(state, src)
    ff.save_checkpoint(state, dst)
    full = _full(state)
    return (full, state.step) if dist.get_rank() == 0 else None


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.timeout(860)
def test_checkpoints_exports_and_pushes_keep_the_real_vocabulary(engine_models, spmd1, spmd2,
                                                                 spmd4, tmp_path):
    from transformers import AutoModelForCausalLM

    path = engine_models["qwen2_v97_kv1"]
    trained = spmd2.run(train_save_export_push, args=(path, 2, str(tmp_path / "tp2")),
                        timeout=300)[0]
    # saved at tp=2 -> loaded at tp=1 -> saved at tp=1 -> loaded at dp=2 x tp=2
    at_tp1, step1 = spmd1.run(load_and_save, args=(path, 1, str(tmp_path / "tp2" / "ckpt"),
                                                   str(tmp_path / "tp1")), timeout=200)[0]
    at_2d, step2 = spmd4.run(load_and_save, args=(path, 2, str(tmp_path / "tp1"),
                                                  str(tmp_path / "2d")), timeout=300)[0]
    assert step1 == step2 == 1
    for name, value in trained.items():
        assert torch.equal(at_tp1[name], value), f"tp=2 -> tp=1: {name}"
        assert torch.equal(at_2d[name], value), f"tp=1 -> dp=2 x tp=2: {name}"
    # export and push: HF names and the model's real shapes, the trained values exactly
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "tp2" / "hf", dtype=torch.float32)
    pushed = _safetensors(tmp_path / "tp2" / "push" / "v1")
    exported = _safetensors(tmp_path / "tp2" / "hf")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert trained[name].shape == (V_PRIME, 64)
        assert exported[name].shape == pushed[name].shape == (V_PRIME, 64), name
    assert exported.keys() == pushed.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(exported[name], value) and torch.equal(pushed[name], value), name
        assert torch.equal(hf.state_dict()[name], value), name
