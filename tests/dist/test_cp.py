"""Context parallelism (Ulysses) on CPU ranks (gloo, float32): forward_logp, compute_values and
ppo_step at cp > 1 (alone, with tp, with dp) equal cp=1 (and the log-probs a float64
per-sequence reference; ppo_step's loss against float64 is tests/unit/test_ppo_critic_reference);
packs whose length cp does not divide, sequences shorter than cp, fewer kv heads than cp; the
cp-aware micro-batch budget; checkpoints crossing cp; push_weights and export_hf from a cp run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.batch import pack, plan_microbatches
from fsdpfn.engine.cp import padded_len, replicate_kv, split_pack
from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.testing import (assert_close_all_ranks, save_tiny_model, tiny_llama_config,
                            tiny_qwen2_config)

V = 128
# rows of 1..13 tokens: 1 is shorter than cp, most lengths and pack sizes are not multiples of cp
LENGTHS = (13, 1, 7, 2, 11, 5, 3, 9)
T = max(LENGTHS)
LOGP_TOL = 1e-5  # float32 vs float64 on the tiny model: ~1e-6 (see test_engine.py)
DELTA_RTOL, DELTA_ATOL = 1e-4, 1e-6  # cp=2 vs cp=1 parameter deltas, both float32
OPT = dict(lr=1.0, eps=1.0, weight_decay=0.1, max_grad_norm=0.5, betas=(0.9, 0.999))
PPO = ff.PPOConfig(clip_low=0.2, clip_high=0.28)
HYP = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))


def batch_of(lengths, *, width: int | None = None, seed: int = 0) -> TensorDict:
    """Rows of the given real lengths, right padded; loss on every token after the first."""
    width = width or max(lengths)
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    attn = torch.arange(width)[None] < lens[:, None]
    ids = torch.where(attn, torch.randint(0, V, (len(lengths), width), generator=g), 0)
    loss = attn.clone()
    loss[:, 0] = False
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss},
                      batch_size=[len(lengths)])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    return {"qwen2": str(save_tiny_model(root / "qwen2", tiny_qwen2_config(), seed=5)),
            "llama": str(save_tiny_model(root / "llama", tiny_llama_config(), seed=6)),
            # one kv head: fewer than cp, replicated before the all-to-all
            "kv1": str(save_tiny_model(root / "kv1", tiny_qwen2_config(num_key_value_heads=1),
                                       seed=7))}


def reference_logp(model_dir: str, batch) -> torch.Tensor:
    """float64, one process, unsharded, one sequence at a time: logp[B, T] (0 at t=0, padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    out = torch.zeros(batch[K.INPUT_IDS].shape, dtype=torch.float64)
    with torch.no_grad():
        for b, n in enumerate(batch[K.ATTENTION_MASK].sum(1).tolist()):
            ids = batch[K.INPUT_IDS][b, :n]
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], -1)
            out[b, 1:n] = logp.gather(-1, ids[1:, None])[:, 0]
    return out


# ---------------------------------------------------------------- one process: planning, splits


@settings(max_examples=60, **HYP)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=12), cp=st.integers(1, 4),
       per_rank=st.integers(10, 40))
def test_plan_budget_is_per_cp_rank(lens, cp, per_rank):
    if max(lens) > per_rank * cp:
        with pytest.raises(BatchError, match="per context-parallel rank" if cp > 1 else "raise"):
            plan_microbatches(lens, max_tokens_per_mb=per_rank, cp=cp)
        return
    plan = plan_microbatches(lens, max_tokens_per_mb=per_rank, cp=cp)
    assert sorted(r for rows in plan for r in rows) == list(range(len(lens)))
    for rows in plan:  # each cp rank holds ceil(N / cp) tokens: within its budget
        assert padded_len(sum(lens[r] for r in rows), cp) // cp <= per_rank
    # a budget per rank: cp ranks together take a cp times larger micro-batch
    if max(lens) <= per_rank:
        assert len(plan) <= len(plan_microbatches(lens, max_tokens_per_mb=per_rank))


@settings(max_examples=60, **HYP)
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=6), cp=st.integers(1, 4))
def test_split_pack_pads_less_than_cp_tokens_into_a_sequence_of_their_own(lens, cp):
    packed = pack(batch_of(lens))
    n = packed.n_tokens
    targets = torch.arange(n) + 1000
    parts = [split_pack(packed.input_ids, packed.position_ids, packed.cu_seqlens,
                        packed.max_seqlen, targets, cp=cp, rank=r) for r in range(cp)]
    total = padded_len(n, cp)
    assert 0 <= total - n < cp and total % cp == 0
    assert {p.input_ids.shape[0] for p in parts} == {total // cp}
    ids = torch.cat([p.input_ids for p in parts])
    assert torch.equal(ids[:n], packed.input_ids)
    assert torch.equal(torch.cat([p.targets for p in parts])[:n], targets)
    assert torch.equal(torch.cat([p.position_ids for p in parts])[:n], packed.position_ids)
    cu = parts[0].cu_seqlens
    want = packed.cu_seqlens.tolist() + ([total] if total > n else [])
    assert cu.tolist() == want and parts[0].max_seqlen >= packed.max_seqlen


@pytest.mark.parametrize("n_q,n_kv,cp", [(4, 2, 2), (4, 1, 2), (4, 1, 4), (8, 2, 4), (6, 2, 3),
                                         (8, 4, 8)])
def test_replicate_kv_keeps_each_query_head_on_its_kv_head(n_q, n_kv, cp):
    k = torch.arange(n_kv, dtype=torch.float32).view(1, n_kv, 1, 1)
    k2, _ = replicate_kv(k, k.clone(), n_q, cp)
    n2 = k2.shape[1]
    assert n2 % cp == 0 and n_q % n2 == 0
    for i in range(n_q):  # query i reads kv i // (n_q / n_kv) before, i // (n_q / n2) after
        assert int(k2[0, i // (n_q // n2), 0, 0]) == i // (n_q // n_kv)
    for r in range(cp):  # and the rank-local mapping agrees with the global one
        q_local, kv_local = n_q // cp, n2 // cp
        for i in range(q_local):
            glob = int(k2[0, r * kv_local + i // (q_local // kv_local), 0, 0])
            assert glob == (r * q_local + i) // (n_q // n_kv)


# ---------------------------------------------------------------- runs on ranks


def _state(model_dir, *, dp=-1, cp=1, tp=1, budget=None, optimizer=False, critic=False,
           ac=False):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=dp, cp=cp, tp=tp), device_type="cpu")
    cfg = ff.EngineConfig(model_path=model_dir, dtype="float32", is_critic=critic,
                          gradient_checkpointing=ac,
                          mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=budget),
                          optimizer=ff.OptimizerConfig(**OPT) if optimizer else None)
    return ff.shard_model(cfg, mesh), mesh


def _full(state) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    return {k[len("lm."):]: v.clone() for k, v in sd.items()}


def logp_layouts(model_dir, layouts, batch):
    """forward_logp (with entropy) of the global batch for each layout (cp, tp, budget)."""
    out = {}
    for cp, tp, budget in layouts:
        state, mesh = _state(model_dir, cp=cp, tp=tp, budget=budget)
        res = ff.gather_batch(ff.forward_logp(state, ff.shard_batch(batch, mesh),
                                              with_entropy=True), mesh)
        out[(cp, tp, budget)] = (res[K.LOGP], res[K.ENTROPY])
    return out


def _check_logp(result, batch, ref):
    base_logp, base_ent = result[(1, 1, None)]
    torch.testing.assert_close(base_logp.double(), ref, rtol=0, atol=LOGP_TOL)
    for layout, (logp, entropy) in result.items():
        torch.testing.assert_close(logp.double(), ref, rtol=0, atol=LOGP_TOL, msg=str(layout))
        torch.testing.assert_close(logp, base_logp, rtol=0, atol=LOGP_TOL, msg=str(layout))
        torch.testing.assert_close(entropy, base_ent, rtol=0, atol=LOGP_TOL, msg=str(layout))
        assert torch.all(logp[~batch[K.ATTENTION_MASK]] == 0) and torch.all(logp[:, 0] == 0)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["qwen2", "llama", "kv1"])
def test_forward_logp_cp2_equals_cp1_and_reference(dirs, spmd2, name):
    batch = batch_of(LENGTHS, seed=1)
    # budgets per cp rank: 8 tokens each splits the 51-token batch into several micro-batches
    layouts = [(1, 1, None), (2, 1, None), (2, 1, 8)]
    result = spmd2.run(logp_layouts, args=(dirs[name], layouts, batch), timeout=300)
    for res in result:
        _check_logp(res, batch, reference_logp(dirs[name], batch))


def logp_4(model_dir, batch):
    """cp=2 x tp=2, cp=2 x dp=2 and cp=4 (a budget of 5 tokens per rank: ragged micro-batches)."""
    base = logp_layouts(model_dir, [(1, 1, None)], batch)
    out = {**base}
    for cp, tp, budget in [(2, 2, None), (2, 1, None), (4, 1, None), (4, 1, 5), (2, 2, 9)]:
        state, mesh = _state(model_dir, cp=cp, tp=tp, budget=budget)
        assert mesh.cp == cp and mesh.tp == tp and mesh.dp == 4 // (cp * tp)
        res = ff.gather_batch(ff.forward_logp(state, ff.shard_batch(batch, mesh),
                                              with_entropy=True), mesh)
        out[(cp, tp, budget)] = (res[K.LOGP], res[K.ENTROPY])
    return out


@pytest.mark.timeout(500)
def test_forward_logp_cp_with_tp_and_dp_equals_reference(dirs, spmd4):
    # qwen2: 4 query heads, 2 kv heads; cp=2 x tp=2 leaves one kv head per tp rank, fewer than cp;
    # cp=4 replicates the 2 kv heads to 4
    batch = batch_of(LENGTHS, seed=2)
    for res in spmd4.run(logp_4, args=(dirs["qwen2"], batch), timeout=450):
        _check_logp(res, batch, reference_logp(dirs["qwen2"], batch))


def values_layouts(model_dir, batch):
    out = {}
    for cp in (1, 2):
        state, mesh = _state(model_dir, cp=cp, critic=True)
        out[cp] = ff.gather_batch(ff.compute_values(state, ff.shard_batch(batch, mesh)),
                                  mesh)[K.VALUES]
    return out


@pytest.mark.timeout(300)
def test_compute_values_cp2_equals_cp1(dirs, spmd2):
    batch = batch_of(LENGTHS, seed=3)
    for res in spmd2.run(values_layouts, args=(dirs["qwen2"], batch), timeout=250):
        torch.testing.assert_close(res[2], res[1], rtol=0, atol=LOGP_TOL)
        assert torch.all(res[2][~batch[K.ATTENTION_MASK]] == 0)
        assert res[1].abs().max() > 0


# ---------------------------------------------------------------- the update


def ppo_layouts(model_dir, batch, layouts):
    """Parameter deltas and stats of one ppo_step per layout (cp, budget, ac); every rank's stats."""
    out = {}
    for cp, budget, ac in layouts:
        state, mesh = _state(model_dir, cp=cp, budget=budget, optimizer=True, ac=ac)
        before = _full(state)
        state, stats = ff.ppo_step(state, ff.shard_batch(batch, mesh), PPO)
        after = _full(state)
        out[(cp, budget, ac)] = ({k: after[k] - before[k] for k in after},
                                 {k: float(v) for k, v in stats.items()}, state.step)
    return out


def _ppo_batch(model_dir):
    batch = batch_of(LENGTHS, seed=4)
    g = torch.Generator().manual_seed(9)
    ref = reference_logp(model_dir, batch)
    attn, lm = batch[K.ATTENTION_MASK], batch[K.LOSS_MASK]
    batch[K.OLD_LOGP] = torch.where(attn, ref + 0.3 * torch.randn(ref.shape, generator=g,
                                                                    dtype=torch.float64), 0).float()
    batch[K.ADVANTAGES] = torch.where(lm, torch.randn(lm.shape, generator=g), 0)
    return batch


@pytest.mark.timeout(500)
def test_ppo_step_cp2_gives_the_parameters_of_cp1(dirs, spmd2):
    batch = _ppo_batch(dirs["qwen2"])
    layouts = [(1, None, False), (2, None, False), (2, 7, False), (2, None, True)]
    results = spmd2.run(ppo_layouts, args=(dirs["qwen2"], batch, layouts), timeout=450)
    base_delta, base_stats, _ = results[0][(1, None, False)]
    assert max(float(d.abs().max()) for d in base_delta.values()) > 1e-3  # a real update
    for rank, res in enumerate(results):
        for layout, (delta, stats, step) in res.items():
            assert step == 1
            # stats are identical on every rank and equal cp=1's (tokens counted once)
            assert stats == results[0][layout][1], (rank, layout)
            for key in ("loss", "tokens", "grad_norm"):
                assert abs(stats[key] - base_stats[key]) <= 1e-5 * max(1.0, abs(base_stats[key])), \
                    (layout, key, stats[key], base_stats[key])
            assert rank > 0 or delta.keys() == base_delta.keys()  # full weights: rank 0 only
            for name in delta:
                torch.testing.assert_close(delta[name], base_delta[name], rtol=DELTA_RTOL,
                                           atol=DELTA_ATOL, msg=f"{layout} {name}")


# ---------------------------------------------------------------- hypothesis over the pack


def logp_any_pack(model_dir):
    """cp=2: hypothesis draws the lengths of a pack; forward_logp equals the float64 reference.
    Every rank draws the same examples; the verdict is agreed over ranks (no rank hangs)."""
    state, mesh = _state(model_dir, cp=2)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    checked = []

    @settings(max_examples=15, **HYP)
    @given(lens=st.lists(st.integers(1, 17), min_size=1, max_size=6), seed=st.integers(0, 99))
    def check(lens, seed):
        batch = batch_of(lens, seed=seed)
        logp = ff.forward_logp(state, batch)[K.LOGP]
        ref = torch.zeros(logp.shape, dtype=torch.float64)
        with torch.no_grad():
            for b, n in enumerate(lens):
                ids = batch[K.INPUT_IDS][b, :n]
                lp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], -1)
                ref[b, 1:n] = lp.gather(-1, ids[1:, None])[:, 0]
        assert_close_all_ranks(logp.double(), ref, rtol=0, atol=LOGP_TOL, what=f"lens={lens}")
        checked.append(sum(lens))

    check()
    return len(checked), sorted({n % 2 for n in checked})


@pytest.mark.timeout(400)
def test_forward_logp_cp2_any_pack_lengths(dirs, spmd2):
    for n_examples, parities in spmd2.run(logp_any_pack, args=(dirs["llama"],), timeout=350):
        assert n_examples >= 10 and parities == [0, 1]  # odd packs (padding) were drawn too


# ---------------------------------------------------------------- checkpoints, push, export


def ckpt_across_cp(model_dir, root):
    """Train at cp=2, save; load at cp=1 (dp=2) and back at cp=2: same weights, same log-probs.
    Then push_weights and export_hf from the cp=2 state."""
    from fsdpfn.checkpoint import export_hf, load_checkpoint, save_checkpoint
    from fsdpfn.weights import DiskTarget, push_weights

    batch = batch_of(LENGTHS, seed=5)
    a, mesh_a = _state(model_dir, cp=2, optimizer=True)
    a, _ = ff.sft_step(a, batch, ff.SFTConfig())
    save_checkpoint(a, f"{root}/cp2", extra={"at": "cp2"})
    want, want_logp = _full(a), ff.forward_logp(a, batch)[K.LOGP]
    b, mesh_b = _state(model_dir, cp=1, optimizer=True)
    b, extra = load_checkpoint(b, f"{root}/cp2")
    got_b = _full(b)
    logp_b = ff.gather_batch(ff.forward_logp(b, ff.shard_batch(batch, mesh_b)), mesh_b)[K.LOGP]
    b, _ = ff.sft_step(b, ff.shard_batch(batch, mesh_b), ff.SFTConfig())
    save_checkpoint(b, f"{root}/cp1")
    a, _ = load_checkpoint(a, f"{root}/cp1")  # back at cp=2
    final, trained = _full(a), _full(b)  # collectives: every rank, once
    same = all(torch.equal(final[k], trained[k]) for k in want)
    receipt = push_weights(a, DiskTarget(f"{root}/push"))
    export_hf(a, f"{root}/export")
    dist.barrier()
    return (extra, all(torch.equal(want[k], got_b[k]) for k in want), same,
            (logp_b - want_logp).abs().max().item(), receipt.version, final)


@pytest.mark.timeout(400)
def test_checkpoint_crosses_cp_and_push_and_export_from_cp(dirs, spmd2, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    results = spmd2.run(ckpt_across_cp, args=(dirs["qwen2"], str(tmp_path)), timeout=350)
    extra, same_b, same_back, logp_gap, version, final = results[0]
    assert extra == {"at": "cp2"} and same_b and same_back and logp_gap <= LOGP_TOL
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=0, atol=0, msg=name)
    pushed = {}
    for file in (tmp_path / "push" / f"v{version}").glob("*.safetensors"):
        pushed.update(load_file(str(file)))
    assert pushed and all(torch.equal(pushed[k], final[k]) for k in pushed)


# ---------------------------------------------------------------- errors


def mismatched_rows(model_dir):
    state, mesh = _state(model_dir, cp=2)
    batch = batch_of(LENGTHS, seed=dist.get_rank())  # cp ranks must pass the same rows
    try:
        ff.forward_logp(state, batch)
    except BatchError as exc:
        return str(exc)
    return None


def heads_not_divisible():
    mesh = ff.build_mesh(ff.ParallelStrategy(cp=2), device_type="cpu")
    cfg = ff.EngineConfig(model_config={**tiny_qwen2_config(
        hidden_size=48, num_attention_heads=3, num_key_value_heads=1).to_dict()},
        dtype="float32", optimizer=None)
    try:
        ff.shard_model(cfg, mesh)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(360)
def test_cp_errors_name_the_rule(dirs, spmd2):
    for message in spmd2.run(mismatched_rows, args=(dirs["qwen2"],), timeout=150):
        assert message is not None and "context-parallel" in message
    for message in spmd2.run(heads_not_divisible, timeout=150):
        assert message is not None and "ParallelStrategy.cp" in message and "cp=2" in message
