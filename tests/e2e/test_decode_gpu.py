"""GPU: the rollout server's decode loop (slot KV cache, CUDA graphs) against fsdpfn's own
forward_logp and HF generate, in bf16, on one GPU.

    python -m pytest -q -s tests/e2e/test_decode_gpu.py

The model is Qwen2-1.5B's shape cut to 6 layers, random weights with a wide init (peaked
distributions: a wrong log-prob shows). The engine runs in this process on cuda with CUDA graphs;
the reference is a one-rank fsdpfn state (FSDP2, packed attention) on the same GPU.
"""

from __future__ import annotations

import pytest
import torch

# Both sides compute in bf16 with other kernels (the loop's slot attention, the trainer's packed
# attention): per-token log-probs differ by bf16 rounding, ~1e-2 (see test_weights_gpu.py).
BF16_MAX = 0.15
BF16_MEAN = 0.02

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: the decode loop's CUDA graphs and "
                                          "bf16 kernels are what is tested")]

SHAPE = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=6,
             num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
             tie_word_embeddings=True, initializer_range=0.08)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2Config

    from fsdpfn.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("m") / "qwen2", Qwen2Config(**SHAPE), seed=0)


@pytest.fixture(scope="module")
def engines(model_dir):
    from fsdpfn.rollout import RolloutEngine

    loop = RolloutEngine(str(model_dir), dtype="bfloat16", device="cuda", decode="loop",
                         decode_rows=64, decode_max_len=512, fused_kernels=False,
                         decode_attention="sdpa")
    hf = RolloutEngine(str(model_dir), dtype="bfloat16", device="cuda", decode="hf",
                       fused_kernels=False)
    return loop, hf


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHAPE["vocab_size"], (n, length), generator=g).tolist()


def _batch(prompts, outputs):
    from tensordict import TensorDict

    rows = [prompts[o["prompt_index"]] + o["output_ids"] for o in outputs]
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.bool)
    loss = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (r, o) in enumerate(zip(rows, outputs)):
        ids[i, :len(r)] = torch.tensor(r)
        attn[i, :len(r)] = True
        loss[i, len(r) - len(o["output_ids"]):len(r)] = True
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                      batch_size=[len(rows)]).to("cuda"), loss


@pytest.mark.timeout(900)
def test_loop_logprobs_equal_forward_logp_in_bf16(engines, model_dir):
    import fsdpfn as ff
    from fsdpfn.rollout import SamplingParams

    loop, hf = engines
    prompts = _prompts(6, 40) + _prompts(2, 7, seed=1)
    sp = dict(temperature=0.8, top_p=0.95, max_new_tokens=96, n=4)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cuda")
    state = ff.shard_model(ff.EngineConfig(model_path=str(model_dir), optimizer=None), mesh)
    gaps = {}
    # "loop, fused draw": no top-p, so the loop's rows draw with draw_kernel.py
    for name, engine, params in (("loop", loop, sp), ("hf generate", hf, sp),
                                 ("loop, fused draw", loop, {**sp, "top_p": 1.0})):
        outputs = engine.generate(prompts, SamplingParams(**params))["outputs"]
        batch, loss = _batch(prompts, outputs)
        ref = ff.forward_logp(state, batch, temperature=0.8)["logp"].cpu()[loss]
        got = torch.tensor([lp for o in outputs for lp in o["output_logprobs"]])
        diff = (got - ref).abs()
        gaps[name] = (float(diff.max()), float(diff.mean()))
        print(f"\nlog-prob |{name} - forward_logp|: max {diff.max():.4f} mean "
              f"{diff.mean():.5f} over {diff.numel()} tokens (logp mean {ref.mean():.2f})")
        if name.startswith("loop"):  # both draws apply the temperature
            wrong_t = ff.forward_logp(state, batch, temperature=1.0)["logp"].cpu()[loss]
            assert (got - wrong_t).abs().mean() > 5 * BF16_MEAN, \
                "the check cannot tell temperatures"
    assert loop.info()["decode_stats"]["graphs"] > 0, "no CUDA graph was captured (see the log)"
    # bf16 tolerance: as close to the trainer as HF's own generate is (or within fixed bounds)
    hf_max, hf_mean = gaps["hf generate"]
    for loop_max, loop_mean in (gaps["loop"], gaps["loop, fused draw"]):
        assert loop_mean < max(BF16_MEAN, 1.5 * hf_mean), gaps
        assert loop_max < max(BF16_MAX, 1.5 * hf_max), gaps


@pytest.mark.timeout(900)
def test_loop_recaptures_after_a_weight_swap(engines):
    """An update re-points the parameters: the next generation captures new graphs (in a fresh
    pool) and gives the same greedy tokens as before on equal weights."""
    from fsdpfn.rollout import SamplingParams

    loop, _ = engines
    prompts = _prompts(4, 30, seed=3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32, n=2)
    before = [o["output_ids"] for o in loop.generate(prompts, greedy)["outputs"]]
    with loop._model_lock:  # an update's swap: every parameter re-pointed at a copy
        loop._swap_in({n: p.detach().clone() for n, p in loop.params.items()}, {})
    after = [o["output_ids"] for o in loop.generate(prompts, greedy)["outputs"]]
    assert after == before
    assert loop.info()["decode_stats"]["graphs"] > 0


@pytest.mark.timeout(900)
def test_loop_greedy_tokens_equal_hf_generate(engines):
    """Greedy rows equal HF generate's up to bf16 near-ties: every loop token is the argmax of a
    teacher-forced HF forward of its row, or within two bf16 spacings of it. (Whole rows are
    not compared: this random model, initializer range 0.08, has near-ties at most positions,
    and one tie broken the other way changes the rest of a row; on the H200 0 of 16 rows
    matched HF generate's token for token while every token passed the check below.)"""
    from fsdpfn.rollout import SamplingParams

    loop, hf = engines
    prompts = _prompts(16, 64, seed=2)
    sp = SamplingParams(temperature=0.0, max_new_tokens=64)
    got = loop.generate(prompts, sp)["outputs"]
    want = hf.generate(prompts, sp)["outputs"]
    same = sum(g["output_ids"] == w["output_ids"] for g, w in zip(got, want))
    print(f"\ngreedy rows equal to HF generate: {same}/{len(got)}")
    for p, o in zip(prompts, got):
        with torch.no_grad():
            logits = hf.model(input_ids=torch.tensor([p + o["output_ids"]],
                                                     device="cuda")).logits[0].float()
        step = logits[len(p) - 1:-1]
        best = step.max(-1).values
        chosen = step.gather(-1, torch.tensor(o["output_ids"], device="cuda")[:, None])[:, 0]
        # within two bf16 spacings of the best logit (2**-7 relative: 0.19 at a logit of 12)
        tol = (2 * 2.0 ** -7 * best.abs()).clamp(min=0.05)
        assert bool(((best - chosen) <= tol).all()), (best - chosen).max()


def _logp_gaps(engine, state, prompts) -> tuple[float, float]:
    """(max, mean) |served log-prob - forward_logp| over 4 seeded samples a prompt at
    temperature 0.8, 64 new tokens. Seeded: two engines draw from the same noise, so their gaps
    are taken over (nearly) the same tokens; unseeded, the maximum over two different samples
    decided a comparison (an opt-in option failed the 1.5x bound on its max alone, 0.42 against
    0.25, on the H200)."""
    import fsdpfn as ff
    from fsdpfn.rollout import SamplingParams

    outputs = engine.generate(prompts, SamplingParams(temperature=0.8, max_new_tokens=64, n=4,
                                                      seed=11))["outputs"]
    batch, loss = _batch(prompts, outputs)
    ref = ff.forward_logp(state, batch, temperature=0.8)["logp"].cpu()[loss]
    got = torch.tensor([lp for o in outputs for lp in o["output_logprobs"]])
    diff = (got - ref).abs()
    return float(diff.max()), float(diff.mean())


@pytest.mark.timeout(900)
@pytest.mark.parametrize("option", [
    None,  # the server's defaults (on CUDA: the Triton attention, Liger's norm and SwiGLU)
    {"decode_attention": "flash"}, {"fused_kernels": True, "decode_attention": "flash"},
    {"fused_kernels": True}, {"decode_attention": "triton"},
    {"fused_kernels": True, "decode_attention": "triton"},
    {"decode_attention": "flex"}, {"decode_attention": "matmul"},
    {"fused_kernels": True, "decode_attention": "flex"},
    {"fused_kernels": True, "decode_attention": "matmul"},
    # measured on the H200 (2026-11-30): mean gap 0.116 against the plain loop's 0.055
    # (inductor fuses the rotary in fp32, unlike the trainer's formula); the option stays opt-in,
    # and its bound below is 3x the loop's instead of 1.5x
    {"decode_compile": True}])
def test_loop_options_match_forward_logp_in_bf16(engines, model_dir, option):
    """The server with its defaults, or with Liger's fused RMSNorm and SwiGLU kernels and/or
    flash attention over each row's length, FlexAttention or the two-matmul attention in the
    decode step, or its step through torch.compile: its
    log-probs are as close to forward_logp as the plain loop's (or within fixed bounds), and it
    captures CUDA graphs."""
    import fsdpfn as ff
    from fsdpfn.rollout import RolloutEngine

    defaults = option is None
    option = option or {}
    if option.get("fused_kernels"):
        pytest.importorskip("liger_kernel")
    engine = RolloutEngine(str(model_dir), dtype="bfloat16", device="cuda", decode="loop",
                           decode_rows=64, decode_max_len=512,
                           **({} if defaults else {"fused_kernels": False,
                                                   "decode_attention": "sdpa", **option}))
    if defaults:
        assert "triton attention" in engine.info()["decode"], engine.info()["decode"]
    if option.get("fused_kernels"):
        assert engine.fused == 3 * SHAPE["num_hidden_layers"] + 1  # 2 norms and the MLP a layer
    prompts = _prompts(6, 40)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cuda")
    state = ff.shard_model(ff.EngineConfig(model_path=str(model_dir), optimizer=None), mesh)
    gaps = {}
    for name, served in (("option", engine), ("loop", engines[0])):  # seeded: see _logp_gaps
        gaps[name] = _logp_gaps(served, state, prompts)
    print(f"\n{option}: log-prob gaps to forward_logp (max, mean): {gaps}")
    (o_max, o_mean), (l_max, l_mean) = gaps["option"], gaps["loop"]
    factor = 3.0 if option.get("decode_compile") else 1.5  # see the parameters above
    assert o_mean < max(BF16_MEAN, factor * l_mean) and o_max < max(BF16_MAX, factor * l_max), \
        gaps
    assert engine.info()["decode_stats"]["graphs"] > 0, "no CUDA graph was captured (see the log)"


def test_fused_draw_on_cuda():
    """The decode loop's draw (draw_kernel.py) compiled for the GPU: log-probs equal a
    float64 log_softmax(logits / T) at the drawn token, greedy rows take the first argmax, and
    draws over many keys follow softmax(logits / T) (chi-square at 6 categories in different
    chunks, critical value 20.5 for p = 0.001), at the vocabulary size of the Qwen2 family;
    seeded rows too, whose tokens depend on their seed and step alone."""
    from fsdpfn.rollout import draw_kernel

    if not draw_kernel.available(torch.device("cuda")):
        pytest.skip("triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 151936, generator=g, device="cuda") * 3).to(torch.bfloat16)
    logits[4, 10] = logits[4, 90000] = logits[4].max() + 1
    temperature = torch.rand(64, generator=g, device="cuda") + 0.3
    temperature[[0, 4]] = 0.0
    token, logp = draw_kernel.draw(logits, temperature, torch.tensor([7], device="cuda"))
    scaled = logits.double() / torch.where(temperature <= 0, 1.0, temperature).double()[:, None]
    want = scaled.log_softmax(-1).gather(1, token[:, None])[:, 0]
    torch.testing.assert_close(logp.double(), want, atol=1e-5, rtol=0)
    assert token[0] == logits[0].float().argmax() and token[4] == 10, token[:5]
    # six columns of mass in different chunks of 4,096 (the last one partial), the rest -inf
    hot = torch.tensor([5, 4100, 40000, 90001, 151000, 151935])
    row = torch.full((151936,), float("-inf"))
    row[hot] = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 1.5])
    small = row.to("cuda", torch.bfloat16)[None].repeat(2000, 1)
    p = torch.softmax(row[hot].double() / 0.8, -1)
    counts = torch.zeros(151936, dtype=torch.float64)
    for key in range(10):  # 20,000 draws: 2,000 rows (distinct uniforms) x 10 keys
        t, _ = draw_kernel.draw(small, torch.full((2000,), 0.8, device="cuda"),
                                torch.tensor([key], device="cuda"))
        counts += torch.bincount(t.cpu(), minlength=151936).double()
    n = counts.sum()
    assert counts[hot].sum() == n, "a column of zero probability was drawn"
    counts = counts[hot]
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 20.5, (chi2, counts / n, p)
    # seeded rows (the RL recipes seed every request): the same chi-square over (seed, step)
    # pairs, and a row's token does not depend on its slot, the other rows or the unseeded key
    seeds = torch.arange(2000, device="cuda") * 1000003 % 2**31
    counts = torch.zeros(151936, dtype=torch.float64)
    for step in range(10):
        steps = torch.full((2000,), step, device="cuda")
        t, lp = draw_kernel.draw(small, torch.full((2000,), 0.8, device="cuda"),
                                 torch.tensor([step], device="cuda"), seeds=seeds, steps=steps)
        counts += torch.bincount(t.cpu(), minlength=151936).double()
        order = torch.randperm(2000, device="cuda")
        again, lp2 = draw_kernel.draw(small, torch.full((2000,), 0.8, device="cuda"),
                                      torch.tensor([step + 50], device="cuda"),
                                      seeds=seeds[order], steps=steps[order])
        assert torch.equal(again, t[order]) and torch.equal(lp2, lp[order])
    n = counts.sum()
    assert counts[hot].sum() == n, "a column of zero probability was drawn"
    counts = counts[hot]
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 20.5, (chi2, counts / n, p)


def test_seeded_loop_reproduces_its_tokens(engines):
    """A seeded request through the CUDA decode loop (graphs, the Triton draw) gives the same
    tokens and log-probs when sent again, and a different seed gives different tokens."""
    from fsdpfn.rollout import SamplingParams

    prompts = _prompts(8, 30, seed=5)
    sp = dict(temperature=1.0, max_new_tokens=48, n=4)
    first = engines[0].generate(prompts, SamplingParams(**sp, seed=3))["outputs"]
    again = engines[0].generate(prompts, SamplingParams(**sp, seed=3))["outputs"]
    other = engines[0].generate(prompts, SamplingParams(**sp, seed=4))["outputs"]
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
    assert [o["output_logprobs"] for o in again] == [o["output_logprobs"] for o in first]
    assert [o["output_ids"] for o in other] != [o["output_ids"] for o in first]


@pytest.mark.timeout(900)
def test_abort_in_the_graphed_loop_ends_its_rows_and_spares_the_others(engines):
    """/abort_request's engine call while the CUDA loop replays its graphs: the aborted rows end
    with the tokens they have (log-probs within bf16 of the HF engine's forward of the same
    weights), the others run to max_new_tokens, every slot is given back, and the loop serves
    on (a seeded request reproduces itself after)."""
    import threading
    import time

    from fsdpfn.rollout import SamplingParams

    loop, hf = engines
    decoder = loop._decoder  # noqa: SLF001
    prompts = _prompts(3, 30, seed=7)
    out: dict = {}

    def run(key, ps, sp, rid):
        out[key] = loop.generate(ps, sp, rid=rid)
    threads = [threading.Thread(target=run, args=("a", prompts[:2], SamplingParams(
                   temperature=1.0, max_new_tokens=400, n=2), "a")),
               threading.Thread(target=run, args=("b", prompts[2:], SamplingParams(
                   temperature=1.0, max_new_tokens=200, n=2, seed=1), "b"))]
    start = decoder.steps
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while decoder.steps < start + 40:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert loop.abort("a") == 4
    for t in threads:
        t.join(120)
    aborted, kept = out["a"]["outputs"], out["b"]["outputs"]
    assert all(o["finish_reason"] == "abort" and 0 < len(o["output_ids"]) < 400 for o in aborted)
    assert all(o["finish_reason"] == "length" and len(o["output_ids"]) == 200 for o in kept)
    rows = [prompts[o["prompt_index"]] + o["output_ids"] for o in aborted]
    served = hf.forward(rows)["token_logprobs"]
    gaps = torch.cat([(torch.tensor(o["output_logprobs"]) - torch.tensor(
        s[-len(o["output_ids"]):])).abs() for o, s in zip(aborted, served)])
    # bf16 on both sides, other kernels (a misaligned or wrong row is nats off)
    assert float(gaps.mean()) < 2 * BF16_MEAN and float(gaps.max()) < 2 * BF16_MAX, gaps
    assert decoder.table == [None] * decoder.slots and not loop.busy()
    seeded = SamplingParams(temperature=1.0, max_new_tokens=32, n=2, seed=2)
    first = loop.generate(prompts, seeded)["outputs"]
    assert [o["output_ids"] for o in loop.generate(prompts, seeded)["outputs"]] == \
        [o["output_ids"] for o in first]


def _attention_case(seed: int, R: int, S: int, kv: int, heads: int, L: int, D: int):
    """(generator, q [R, heads, D], k and v caches [S, kv, L, D]) in bf16 on CUDA for the
    Triton attention's tests; skipped where the kernel cannot run."""
    from fsdpfn.rollout import attention_kernel

    if attention_kernel.refusal(torch.device("cuda"), D):
        pytest.skip(attention_kernel.refusal(torch.device("cuda"), D))
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(R, heads, D, generator=g, device="cuda").to(torch.bfloat16)
    k, v = torch.randn(2, S, kv, L, D, generator=g, device="cuda").to(torch.bfloat16)
    return g, q, k, v


def _float64_attention(q, k, v, past):
    """softmax(q k^T / sqrt(D)) v in float64, one query per row, query head h on kv head
    h // G, positions where ``past`` [R, 1, L] is set left out: [R, heads, D]."""
    group = q.shape[1] // k.shape[1]
    kr, vr = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = (q.double()[:, :, None] @ kr.transpose(-1, -2))[:, :, 0] * q.shape[-1] ** -0.5
    return (scores.masked_fill(past, float("-inf")).softmax(-1)[:, :, None] @ vr)[:, :, 0]


@pytest.mark.parametrize("splits", [None, 1, 5])
def test_triton_decode_attention_on_cuda(splits):
    """attention_kernel.decode compiled for the GPU, bf16, the 1.5B shape's heads (12 query
    heads on 2 kv heads, D = 128): equal to a float64 softmax(q k^T / sqrt(D)) v over each
    row's first used[r] positions within bf16 rounding, with positions past each row's length
    poisoned with NaN (never read)."""
    from fsdpfn.rollout import attention_kernel

    R, S, kv, heads, L, D = 96, 100, 2, 12, 1280, 128
    g, q, k, v = _attention_case(0, R, S, kv, heads, L, D)
    used = torch.randint(1, L + 1, (R,), generator=g, device="cuda")
    used[:3] = torch.tensor([1, L, 64], device="cuda")
    past = torch.arange(L, device="cuda")[None, None, :] >= used[:, None, None]
    k[:R].masked_fill_(past[..., None], float("nan"))
    v[:R].masked_fill_(past[..., None], float("nan"))
    got = attention_kernel.decode(q, k, v, used, L, D ** -0.5, splits=splits).view(R, heads, D)
    want = _float64_attention(q, k[:R].nan_to_num(), v[:R].nan_to_num(), past)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("splits", [None, 1, 5])
def test_triton_decode_attention_with_shared_prompts_on_cuda(splits):
    """attention_kernel.decode with ``shared=`` on the GPU, bf16, the 1.5B shape's heads: rows in
    groups of 8 and of 13 whose caches begin with the same 256 or 200 positions, a group of two
    far apart (rows 30 and 35), and rows in no group. Equal to a float64 softmax(q k^T / sqrt(D))
    v over each row's own cache within bf16 rounding, with the shared positions of every row but
    each group's first poisoned with NaN (read from the first row) and positions past each
    row's length poisoned too; and equal, bit for bit, to each row reading its own copy."""
    from fsdpfn.rollout import attention_kernel

    R, S, kv, heads, L, D = 40, 48, 2, 12, 1280, 128
    g, q, k, v = _attention_case(1, R, S, kv, heads, L, D)
    groups = [(256, list(range(0, 8))), (200, list(range(10, 23))), (256, [30, 35])]
    used = torch.randint(300, L + 1, (R,), generator=g, device="cuda")
    used[10], used[11] = 201, 200  # one token past its prompt; none
    for length, ids in groups:
        k[ids[1:], :, :length], v[ids[1:], :, :length] = k[ids[0], :, :length], \
            v[ids[0], :, :length]
    past = torch.arange(L, device="cuda")[None, None, :] >= used[:, None, None]
    want = _float64_attention(q, k[:R], v[:R], past)
    intact_k, intact_v = k.clone(), v.clone()
    for length, ids in groups:
        k[ids[1:], :, :length], v[ids[1:], :, :length] = float("nan"), float("nan")
    k[:R].masked_fill_(past[..., None], float("nan"))
    v[:R].masked_fill_(past[..., None], float("nan"))
    tables = attention_kernel.share_tables(groups, S, "cuda")
    got = attention_kernel.decode(q, k, v, used, L, D ** -0.5, splits=splits,
                                  shared=tables).view(R, heads, D)
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    # the same bits in the same order as each row reading its own (intact) copy: equal
    assert torch.equal(got, attention_kernel.decode(q, intact_k, intact_v, used, L, D ** -0.5,
                                                    splits=splits).view(R, heads, D))


@pytest.mark.timeout(900)
def test_loop_with_shared_prompts_matches_forward_logp_in_bf16(model_dir):
    """The server's default loop reads each prompt's KV once for its samples (prompts of 200
    tokens, 4 samples each): its log-probs are as close to forward_logp as the same loop's
    without sharing (--no-decode-share-prefix), and the steps did run shared."""
    import fsdpfn as ff
    from fsdpfn.rollout import RolloutEngine

    prompts = _prompts(6, 200, seed=8)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cuda")
    state = ff.shard_model(ff.EngineConfig(model_path=str(model_dir), optimizer=None), mesh)
    gaps, stats = {}, {}
    for share in (True, False):
        engine = RolloutEngine(str(model_dir), dtype="bfloat16", device="cuda", decode="loop",
                               decode_rows=64, decode_max_len=512, decode_share_prefix=share)
        gaps[share], stats[share] = _logp_gaps(engine, state, prompts), \
            engine.info()["decode_stats"]
        del engine
    print(f"\nshared prompts: log-prob gaps to forward_logp (max, mean): {gaps}")
    assert stats[True]["shared_steps"] == stats[True]["steps"] > 0, stats
    assert stats[False]["shared_steps"] == 0, stats
    (s_max, s_mean), (p_max, p_mean) = gaps[True], gaps[False]
    assert s_mean < max(BF16_MEAN, 1.5 * p_mean) and s_max < max(BF16_MAX, 1.5 * p_max), gaps


@pytest.mark.timeout(900)
def test_loop_with_a_float8_cache_serves_its_log_probs_with_cuda_graphs(model_dir):
    """--kv-cache-dtype fp8_e4m3 through the server's default loop (bf16, the Triton attention,
    CUDA graphs): the cache is float8, the served log-probs are log-probs (finite, <= 0) within
    a sanity bound of the unrounded float64 model (a cache read wrongly is nats off; the exact
    check of the float8 model is test_slot_model_on_a_float8_cache_..., in float32, below), and
    with another attention or the compiled step the engine is refused by name."""
    from transformers import AutoModelForCausalLM

    from fsdpfn.rollout import RolloutEngine, SamplingParams, UpdateError
    from fsdpfn.testing.float8 import cache_reference_logits

    _skip_without_float8()
    for option, match in (({"decode_attention": "flash"}, "got 'flash' attention on cuda"),
                          ({"decode_compile": True}, "'fp8_e4m3' runs without decode_compile")):
        with pytest.raises(UpdateError, match=f"kv_cache_dtype: .*{match}"):
            RolloutEngine(str(model_dir), dtype="bfloat16", device="cuda", decode="loop",
                          decode_rows=8, decode_max_len=128, kv_cache_dtype="fp8_e4m3", **option)
    prompts = _prompts(6, 40, seed=3)
    sp = SamplingParams(temperature=0.8, max_new_tokens=64, n=2, seed=5)
    served = {}
    for cache in ("auto", "fp8_e4m3"):
        engine = RolloutEngine(str(model_dir), dtype="bfloat16", device="cuda", decode="loop",
                               decode_rows=64, decode_max_len=512, kv_cache_dtype=cache)
        assert engine.info()["kv_cache_dtype"] == cache
        assert engine._decoder.net.k[0].dtype == (  # noqa: SLF001
            torch.float8_e4m3fn if cache == "fp8_e4m3" else torch.bfloat16)
        outputs = engine.generate(prompts, sp)["outputs"]
        assert engine.info()["decode_stats"]["graphs"] > 0, "no CUDA graph was captured"
        del engine
        served[cache] = ([prompts[o["prompt_index"]] + o["output_ids"] for o in outputs],
                         torch.tensor([lp for o in outputs for lp in o["output_logprobs"]]))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda()
    gaps = {}
    for cache, (rows, got) in served.items():
        assert got.isfinite().all() and (got <= 1e-6).all(), cache
        logits = cache_reference_logits(model, rows, [40] * len(rows))
        ref = torch.cat([(x[39:-1] / 0.8).log_softmax(-1).gather(
            -1, torch.tensor(row[40:], device=x.device)[:, None])[:, 0].cpu()
            for x, row in zip(logits, rows)])
        gaps[cache] = (float((got - ref).abs().max()), float((got - ref).abs().mean()))
    print(f"\nlog-prob gaps (max, mean) of the served caches to the unrounded float64 model: "
          f"{gaps}")
    assert gaps["fp8_e4m3"][1] < 0.5, gaps


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_slot_model_on_a_float8_cache_gives_the_float8_models_logits_on_cuda(family):
    """The decode loop's network in float32 on CUDA over a float8 cache (the compiled Triton
    attention reading it, the prefill's and the steps' writes): each decode step's logits equal
    fsdpfn.testing.float8's float64 model whose queries past the prompt read k and v rounded to
    float32, then float8, within 1e-3 (float32's rounding: k lands on the same float8 value),
    and are more than 1e-2 from the unrounded model (the check tells the caches apart)."""
    from fsdpfn.rollout.slot_model import SlotModel
    from fsdpfn.testing.float8 import cache_logit_gaps

    _skip_without_float8()
    model = _family_model(family, hidden=512, heads=4, intermediate=1024).float()
    net = SlotModel(model, 8, 256, "triton", kv_cache_dtype="fp8_e4m3")
    assert net.k[0].dtype == torch.float8_e4m3fn and net.rope_kv == "torch"  # float32
    lengths = torch.randint(1, 65, (8,), generator=torch.Generator().manual_seed(4))
    gaps = cache_logit_gaps(net, model, lengths, steps=6, seed=4)
    print(f"\n{family}: largest logit gap to the float64 models: {gaps}")
    assert gaps["float8"] < 1e-3 and gaps["unrounded"] > 1e-2, gaps


def _family_model(family: str, hidden: int, heads: int, intermediate: int, device="cuda"):
    """A 3-layer bf16 model of ``family``: qwen2 (q/k/v biases) or llama (llama3 rope scaling,
    no biases), 2 kv heads, seed 0."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=4096, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=3, num_attention_heads=heads, num_key_value_heads=2,
                  max_position_embeddings=2048, initializer_range=0.08)
    config = Qwen2Config(**common) if family == "qwen2" else LlamaConfig(
        **common, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 256})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()


def _assert_steps_equal(plain, fused, R: int, L: int, device="cuda") -> None:
    """From the same random caches, four decode steps of R rows at scattered positions give
    the same logits on both SlotModels, and leave the same caches, bit for bit."""
    g = torch.Generator(device=device).manual_seed(1)
    for net in (plain, fused):  # the same garbage-free starting caches
        for cache in net.k + net.v:
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator(device=device)
                                    .manual_seed(2), device=device).to(cache.dtype))
    with torch.no_grad():
        for step in range(4):
            tok = torch.randint(0, 4096, (R,), generator=g, device=device)
            pos = torch.randint(0, L - 1, (R,), generator=g, device=device)
            a, b = plain.decode(tok, pos, L, raw=True), fused.decode(tok, pos, L, raw=True)
            assert torch.equal(a, b), (step, (a.float() - b.float()).abs().max())
    for x, y in zip(plain.k + plain.v, fused.k + fused.v):  # as bytes: float8 has no equal
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_fused_add_norm_equals_the_add_then_liger_norm_bit_for_bit(family):
    """SlotModel(add_norm=True), bf16 on CUDA, with Liger's RMSNorm swapped in (as the server
    runs): each residual add and the norm after it as Liger's one fused kernel gives the same
    logits and caches, bit for bit, as the add followed by Liger's norm, over decode steps at
    scattered positions; qwen2 has q/k/v biases, llama (with llama3 rope scaling) none."""
    from fsdpfn.rollout.slot_model import SlotModel
    from fsdpfn.wire.kernels import apply_fused_kernels

    pytest.importorskip("liger_kernel.ops.fused_add_rms_norm")
    model = _family_model(family, hidden=1536, heads=12, intermediate=2048)
    assert apply_fused_kernels(model, model.config, "cuda", keep_weights=True) > 0
    R, L = 48, 1024
    plain = SlotModel(model, R, L, "triton", add_norm=False)
    fused = SlotModel(model, R, L, "triton")
    assert plain.add_norm is None and fused.add_norm is not None  # the default takes it
    _assert_steps_equal(plain, fused, R, L)


@pytest.mark.parametrize("cache", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_rope_kv_kernel_equals_the_torch_epilogue_bit_for_bit(family, cache):
    """SlotModel(rope_kv="triton"), bf16 on CUDA: one kernel for the rotary, q's layout and the
    KV writes gives the same logits and the same caches, bit for bit, as the torch path (HF's
    rotary formula, index_put_), over decode steps at scattered positions; qwen2 has q/k/v
    biases, llama (with llama3 rope scaling) none. With a float8 cache, both round k and v to
    float8 e4m3 alike (to nearest even, saturating)."""
    from fsdpfn.rollout import rope_kernel
    from fsdpfn.rollout.slot_model import SlotModel

    if rope_kernel.refusal(torch.device("cuda"), torch.bfloat16, 128):
        pytest.skip(rope_kernel.refusal(torch.device("cuda"), torch.bfloat16, 128))
    model = _family_model(family, hidden=512, heads=4, intermediate=1024)
    R, L = 48, 1024
    _skip_without_float8(cache)
    plain = SlotModel(model, R, L, "triton", rope_kv="torch", kv_cache_dtype=cache)
    fused = SlotModel(model, R, L, "triton", kv_cache_dtype=cache)
    assert fused.rope_kv == "triton"  # "auto", the default, takes the kernel where it runs
    assert fused.k[0].dtype == (torch.float8_e4m3fn if cache != "auto" else torch.bfloat16)
    _assert_steps_equal(plain, fused, R, L)


def _skip_without_float8(cache: str = "fp8_e4m3") -> None:
    from fsdpfn.rollout.slot_model import kv_cache_refusal

    reason = kv_cache_refusal(cache, "triton", torch.device("cuda"))
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("splits", [None, 1, 5])
def test_triton_decode_attention_over_a_float8_cache_on_cuda(splits):
    """attention_kernel.decode over a float8_e4m3 cache (--kv-cache-dtype fp8_e4m3), bf16
    queries, the 1.5B shape's heads: equal to a float64 softmax(q k^T / sqrt(D)) v over the
    float8 values within bf16 rounding (each loaded block is widened exactly to bf16), with
    positions past each row's length poisoned with NaN; and reading shared prompts from the
    group's first row gives the same bits as each row reading its own copy."""
    from fsdpfn.rollout import attention_kernel

    _skip_without_float8()
    R, S, kv, heads, L, D = 64, 72, 2, 12, 1280, 128
    g, q, k, v = _attention_case(2, R, S, kv, heads, L, D)
    k8, v8 = (3 * k).to(torch.float8_e4m3fn), (3 * v).to(torch.float8_e4m3fn)  # k, v ~ N(0, 9)
    used = torch.randint(1, L + 1, (R,), generator=g, device="cuda")
    used[:3] = torch.tensor([1, L, 64], device="cuda")
    past = torch.arange(L, device="cuda")[None, None, :] >= used[:, None, None]
    want = _float64_attention(q, k8[:R].float(), v8[:R].float(), past)
    k8c, v8c = k8.clone(), v8.clone()  # unpoisoned, for the shared prompts below
    k8.view(torch.uint8)[:R].masked_fill_(past[..., None], 0x7F)  # float8 e4m3fn's NaN
    v8.view(torch.uint8)[:R].masked_fill_(past[..., None], 0x7F)
    got = attention_kernel.decode(q, k8, v8, used, L, D ** -0.5, splits=splits).view(R, heads, D)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    groups = [(256, list(range(0, 8))), (200, list(range(10, 23)))]
    used = torch.randint(300, L + 1, (R,), generator=g, device="cuda")
    kb, vb = k8c.view(torch.uint8), v8c.view(torch.uint8)
    for length, ids in groups:
        kb[ids[1:], :, :length], vb[ids[1:], :, :length] = kb[ids[0], :, :length], \
            vb[ids[0], :, :length]
    own = attention_kernel.decode(q, k8c, v8c, used, L, D ** -0.5, splits=splits)
    tables = attention_kernel.share_tables(groups, S, "cuda")
    assert not own.isnan().any() and torch.equal(own, attention_kernel.decode(
        q, k8c, v8c, used, L, D ** -0.5, splits=splits, shared=tables))
