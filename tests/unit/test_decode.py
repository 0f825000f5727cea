"""fsdpfn.rollout.decode on CPU (no CUDA graphs: the same step runs eagerly).

References: HF ``generate`` of the same engine (greedy tokens), a float64 teacher-forced HF forward
of each whole row (log-probs), and float64 top-k / top-p sets for the sampler.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn.rollout import RolloutEngine, SamplingParams, UpdateError
from fsdpfn.rollout.decode import Decoder, sample
from fsdpfn.rollout.decode_rows import bucket as _bucket
from fsdpfn.testing import save_tiny_model, tiny_llama_config, tiny_qwen2_config, tiny_qwen3_config

# float32 on both sides, different summation orders (see tests/unit/test_rollout.py)
LOGP_ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m") / "tiny", tiny_qwen2_config(), seed=0)


def _engine(path, decode="loop", rows=8, max_len=96):
    return RolloutEngine(str(path), dtype="float32", device="cpu", max_pause_s=30,
                         decode=decode, decode_rows=rows, decode_max_len=max_len)


def _ref_logp(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([prompt + output])
        logp = torch.log_softmax(model(input_ids=ids).logits.double()[0] / temperature, -1)
    return logp[len(prompt) - 1:-1].gather(-1, ids[0, len(prompt):, None])[:, 0]


def _assert_logps(engine, prompts, result, temperature):
    for o in result["outputs"]:
        ref = _ref_logp(engine.model, prompts[o["prompt_index"]], o["output_ids"],
                        temperature or 1.0)
        got = torch.tensor(o["output_logprobs"], dtype=torch.float64)
        torch.testing.assert_close(got, ref, atol=LOGP_ATOL, rtol=0)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("config", [tiny_qwen2_config, tiny_llama_config, tiny_qwen3_config])
def test_greedy_tokens_equal_hf_generate_and_logps_equal_forward(tmp_path, config):
    path = save_tiny_model(tmp_path / "m", config(), seed=1)
    loop, hf = _engine(path), _engine(path, decode="hf")
    sp = SamplingParams(temperature=0.0, max_new_tokens=20, n=2)
    got, want = loop.generate(PROMPTS, sp), hf.generate(PROMPTS, sp)
    assert [o["output_ids"] for o in got["outputs"]] == \
        [o["output_ids"] for o in want["outputs"]]
    assert [o["prompt_index"] for o in got["outputs"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    _assert_logps(loop, PROMPTS, got, 0.0)
    assert loop.info()["decode"].startswith("loop") and hf.info()["decode"] == "hf"


def _loop_equals_hf_generate(model_dir, **option):
    """The loop with ``option`` gives HF generate's greedy tokens and the forward's log-probs,
    rows of several lengths sharing steps."""
    loop = RolloutEngine(str(model_dir), dtype="float32", device="cpu", max_pause_s=30,
                         decode="loop", decode_rows=8, decode_max_len=96, cuda_graphs=False,
                         **option)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, n=2)
    got, want = loop.generate(PROMPTS, sp), _engine(model_dir, decode="hf").generate(PROMPTS, sp)
    assert [o["output_ids"] for o in got["outputs"]] == \
        [o["output_ids"] for o in want["outputs"]]
    _assert_logps(loop, PROMPTS, got, 0.0)


@pytest.mark.timeout(300)
def test_flex_attention_decode_equals_hf_generate(model_dir):
    """decode_attention="flex": FlexAttention, compiled with dynamic shapes, causal limit as a
    score_mod; an unknown attention or rotary kernel, or one that cannot run here, is refused
    by name (UpdateError)."""
    _loop_equals_hf_generate(model_dir, decode_attention="flex")
    for option, match in ((dict(decode_attention="paged"), "decode_attention: must be one of"),
                          (dict(decode_attention="flash"), "decode_attention: 'flash' needs CUDA"),
                          (dict(decode_attention="triton"),
                           "decode_attention: 'triton' needs CUDA"),
                          (dict(decode_rope_kv="fused"), "decode_rope_kv: must be one of"),
                          (dict(decode_rope_kv="triton"),
                           "decode_rope_kv: rope_kv='triton' needs CUDA")):
        with pytest.raises(UpdateError, match=match):
            RolloutEngine(str(model_dir), dtype="float32", device="cpu", decode="loop",
                          decode_rows=8, decode_max_len=96, **option)


@pytest.mark.timeout(120)
def test_matmul_attention_decode_equals_hf_generate(model_dir):
    """decode_attention="matmul": scores and probabilities as two batched matmuls over the slot
    cache (GQA groups as rows of one kv head), the mask added in fp32."""
    _loop_equals_hf_generate(model_dir, decode_attention="matmul")


@pytest.mark.timeout(400)
def test_compiled_decode_step_equals_hf_generate(model_dir):
    """decode_compile=True: the decode step through torch.compile with dynamic shapes (one
    compile for every bucket)."""
    _loop_equals_hf_generate(model_dir, decode_compile=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 0.9, 0), (1.3, 1.0, 5),
                                                     (1.0, 1.0, 0)])
def test_sampled_logps_equal_forward_at_temperature(model_dir, temperature, top_p, top_k):
    engine = _engine(model_dir)
    res = engine.generate(PROMPTS, SamplingParams(temperature=temperature, top_p=top_p,
                                                  top_k=top_k, max_new_tokens=15, n=3))
    assert len(res["outputs"]) == 12 and res["weight_version"] == 0
    assert all(len(o["output_ids"]) == 15 == len(o["weight_versions"]) for o in res["outputs"])
    _assert_logps(engine, PROMPTS, res, temperature)


@pytest.mark.timeout(120)
def test_rows_join_and_leave_slots_with_stop_tokens(model_dir):
    """15 rows through 8 slots: rows that stop free their slot and queued rows take it; every
    row still equals HF generate (greedy), stop token last."""
    loop, hf = _engine(model_dir, rows=8), _engine(model_dir, decode="hf")
    prompts = [[i + 1, i + 2] for i in range(5)]
    free = hf.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))["outputs"]
    stop = free[0]["output_ids"][3]
    sp = SamplingParams(temperature=0, max_new_tokens=12, n=3, stop_token_ids=[stop])
    got = loop.generate(prompts, sp)["outputs"]
    want = hf.generate(prompts, sp)["outputs"]
    for g, w in zip(got, want):
        assert (g["output_ids"], g["finish_reason"]) == (w["output_ids"], w["finish_reason"])
        assert len(g["output_logprobs"]) == len(g["output_ids"])
    assert got[0]["finish_reason"] == "stop" and got[0]["output_ids"][-1] == stop
    assert loop._decoder.table == [None] * 8  # noqa: SLF001 - every slot given back


@pytest.mark.timeout(120)
def test_concurrent_requests_share_decode_steps(model_dir):
    """Two clients' requests queued together are admitted together: the steps run once for
    both (max_new_tokens - 1 decode steps, the first token comes from the prefill)."""
    engine = _engine(model_dir, rows=16)
    decoder = engine._decoder  # noqa: SLF001
    results = [None, None]
    sps = [SamplingParams(temperature=0, max_new_tokens=10, n=2),
           SamplingParams(temperature=0.9, max_new_tokens=10, n=3, top_p=0.8)]

    def client(i):
        results[i] = engine.generate([PROMPTS[i], PROMPTS[i + 2]], sps[i])
    with engine._model_lock:  # noqa: SLF001 - hold the scheduler until both are queued
        threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(decoder.pending) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
    for t in threads:
        t.join(60)
    assert decoder.steps == 9
    stats = engine.info()["decode_stats"]  # what benchmarks/rollout.py splits the wall by
    assert stats["steps"] == 9 and stats["seconds"] > 0 and stats["prefill_seconds"] > 0
    assert stats["shared_steps"] == 0  # shared prompts are read once with the Triton attention
    assert len(results[0]["outputs"]) == 4 and len(results[1]["outputs"]) == 6
    for i in range(2):
        _assert_logps(engine, [PROMPTS[i], PROMPTS[i + 2]], results[i],
                      sps[i].temperature)


@pytest.mark.timeout(120)
def test_equal_prompts_of_requests_admitted_together_are_prefilled_once(model_dir):
    """A workflow's episodes of one data row send the same prompt as requests of their own.
    Queued together, they are admitted together: each distinct prompt is prefilled once and its
    slots form one sharing group, across requests; prompts of equal length but other ids stay
    apart. Every row's log-probs still equal the float64 forward, greedy rows HF generate."""
    engine, hf = _engine(model_dir, rows=16), _engine(model_dir, decode="hf")
    decoder = engine._decoder  # noqa: SLF001
    same, other = [5, 6, 7], [5, 6, 8]  # equal length, one id apart
    asks = [([same, PROMPTS[1]], SamplingParams(temperature=0, max_new_tokens=6, n=2)),
            ([same], SamplingParams(temperature=0.8, max_new_tokens=6, n=3, seed=3)),
            ([list(same), other], SamplingParams(temperature=1.0, max_new_tokens=6, n=1))]
    results, groups = [None] * len(asks), []
    real = decoder.net.set_shared

    def spy(pairs):
        groups.append([sorted(slots) for _, slots in pairs])
        return real(pairs)
    decoder.net.set_shared = spy

    def client(i):
        results[i] = engine.generate(*asks[i])
    with engine._model_lock:  # noqa: SLF001 - hold the scheduler until all are queued
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(asks))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(decoder.pending) < len(asks) and time.monotonic() < deadline:
            time.sleep(0.005)
    for t in threads:
        t.join(60)
    assert engine.info()["decode_stats"]["prefill_prompts"] == 3  # same, PROMPTS[1], other
    # slots in admission order: request 0 (same x2, PROMPTS[1] x2), 1 (same x3), 2 (same, other)
    assert groups[0] == [[0, 1, 4, 5, 6, 7], [2, 3], [8]]
    for (prompts, sp), result in zip(asks, results):
        _assert_logps(engine, prompts, result, sp.temperature)
    want = hf.generate(*asks[0])["outputs"]
    assert [o["output_ids"] for o in results[0]["outputs"]] == [w["output_ids"] for w in want]


@pytest.mark.timeout(120)
def test_weight_swap_lands_between_steps_and_each_token_names_its_version(model_dir, tmp_path):
    """An update from disk while a request decodes: it takes the model lock between two chunks;
    the tokens before carry version 0, those after version 1, and each log-prob is that of the
    weights that produced it. The decoder drops its graphs (the parameters moved)."""
    from safetensors.torch import save_file

    engine = _engine(model_dir, rows=8, max_len=200)
    decoder = engine._decoder  # noqa: SLF001
    decoder.sync_every = 2
    old = {n: p.detach().clone() for n, p in engine.params.items()}
    g = torch.Generator().manual_seed(4)
    new = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in old.items()}
    (tmp_path / "v").mkdir()
    save_file(new, str(tmp_path / "v" / "model.safetensors"))
    decoder.graphs[("stale",)] = object()
    result = {}
    thread = threading.Thread(target=lambda: result.update(engine.generate(
        [[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=150))))
    thread.start()
    while decoder.steps < 4:
        time.sleep(0.001)
    assert engine.receiver.update_from_disk({"model_path": str(tmp_path / "v"),
                                             "weight_version": 1})["weight_version"] == 1
    thread.join(60)
    out = result["outputs"][0]
    versions = out["weight_versions"]
    assert result["weight_version"] == 0 and versions[0] == 0 and versions[-1] == 1
    assert versions == sorted(versions) and len(versions) == 150
    ref_new = _ref_logp(engine.model, [1, 2, 3], out["output_ids"], 1.0)
    engine._swap_in(old, {})  # noqa: SLF001 - score under the old weights
    ref_old = _ref_logp(engine.model, [1, 2, 3], out["output_ids"], 1.0)
    ref = torch.where(torch.tensor(versions) == 0, ref_old, ref_new)
    torch.testing.assert_close(torch.tensor(out["output_logprobs"], dtype=torch.float64), ref,
                               atol=LOGP_ATOL, rtol=0)
    assert ("stale",) not in decoder.graphs


@pytest.mark.timeout(60)
def test_pause_drains_the_loop_and_limits_are_named(model_dir):
    engine = _engine(model_dir, max_len=32)
    engine.pause()
    done = threading.Event()
    threading.Thread(target=lambda: (engine.generate([[1, 2]], SamplingParams(
        max_new_tokens=4)), done.set()), daemon=True).start()
    assert not done.wait(0.5), "generation ran while paused"
    engine.resume()
    assert done.wait(30)
    with pytest.raises(UpdateError, match=r"max_new_tokens: prompt length plus .* 32 .* got "
                                          r"3 \+ 30"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=30))
    with pytest.raises(UpdateError, match="stop_token_ids: must hold at most 32 ids, got 33"):
        engine.generate([[1]], SamplingParams(stop_token_ids=list(range(33))))


@pytest.mark.timeout(60)
def test_the_loops_refusal_of_top_logprobs_names_each_endpoints_own_field(model_dir):
    from fsdpfn.rollout import openai_api, sglang_api

    engine = _engine(model_dir, max_len=32)
    for call, body, field in (
            (openai_api.completions, {"prompt": [1, 2], "max_tokens": 2, "logprobs": 2},
             "logprobs"),
            (sglang_api.generate, {"input_ids": [1, 2], "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 2},
                                   "top_logprobs_num": 2}, "top_logprobs_num")):
        with pytest.raises(UpdateError, match=rf"^{field}: not supported by the decode loop "
                                              r"\(must be 0; start the server with --decode hf\), "
                                              r"got 2$"):
            call(engine, body)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rolled_rotary_equals_hf_formula_bit_for_bit(dtype):
    """The decode step's rotary (roll and a sign-folded sin table) equals HF's rotate_half
    formula exactly, in bf16 as in fp32, so the server's q and k round as the trainer's do."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    from fsdpfn.rollout.slot_model import _rotate_rolled

    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 6, 16, generator=g).to(dtype)
    k = torch.randn(5, 2, 16, generator=g).to(dtype)
    angle = torch.rand(5, 8, generator=g) * 100  # a position per row
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    signed = torch.cat([-sin[..., :8], sin[..., 8:]], -1)
    assert torch.equal(_rotate_rolled(q, cos[:, None], signed[:, None]), want_q)
    assert torch.equal(_rotate_rolled(k, cos[:, None], signed[:, None]), want_k)


def _varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale, used):
    """Variable-length attention as flash's forward defines it, in float64: sequence b's
    queries q[cu_q[b]:cu_q[b+1]] attend keys k[cu_k[b]:cu_k[b] + used[b]] (non-causal)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].double().transpose(0, 1)  # [heads, n, D]
        start, n = int(cu_k[b]), int(used[b])
        ks = k[start:start + n].double().transpose(0, 1)
        vs = v[start:start + n].double().transpose(0, 1)
        p = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        out[cu_q[b]:cu_q[b + 1]] = (p @ vs).transpose(0, 1)
    return out.to(q.dtype)


@pytest.mark.parametrize("config", [tiny_qwen2_config, tiny_qwen3_config])
def test_flash_decode_layout_equals_masked_attention(config, monkeypatch):
    """The flash step's arguments (the cache read in place as slots x kv heads sequences, each
    kv head's G query heads as G query positions, seqused_k = pos + 1) give the masked SDPA
    step's logits, with flash's forward replaced by a float64 reference of its definition (the
    kernel itself runs on CUDA only: tests/e2e/test_decode_gpu.py)."""
    from transformers import AutoModelForCausalLM

    from fsdpfn.rollout import slot_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(), dtype=torch.float32).eval()
    R, L = 6, 40
    sdpa = slot_model.SlotModel(model, R, L, "sdpa")
    flash = slot_model.SlotModel(model, R, L, "sdpa")
    flash.attention = "flash"  # the CUDA path's arithmetic, on the CPU
    for i in range(len(sdpa.k)):
        kv = torch.randn(2, *sdpa.k[i].shape)
        for net in (sdpa, flash):
            net.k[i].copy_(kv[0]), net.v[i].copy_(kv[1])
    tok = torch.randint(0, model.config.vocab_size, (R,))
    pos = torch.tensor([0, 5, 17, 39, 23, 1])
    monkeypatch.setattr(slot_model, "_flash_forward", _varlen_reference)
    with torch.no_grad():
        want = sdpa.decode(tok, pos, L)
        got = flash.decode(tok, pos, L)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for i in range(len(sdpa.k)):  # the new token's KV written at pos, the same in both
        torch.testing.assert_close(flash.k[i], sdpa.k[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(flash.v[i], sdpa.v[i], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    tuple(int(x) for x in __import__("transformers").__version__.split(".")[:2]) < (5, 5),
    reason="transformers before 5.5 asks autocast about the meta device in its rotary")
def test_decode_step_never_reads_the_device_on_the_host():
    """The step runs on the meta device (no values): nothing in it depends on a tensor's value
    on the host, which is what a CUDA graph capture requires."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_qwen2_config(), dtype=torch.float32)
    decoder = Decoder(model, lock=threading.Lock(), version=lambda: 0, slots=16, max_len=64)
    with torch.no_grad():
        for truncate in (False, True):
            for seeded in (False, True):
                decoder._step(16, 64, truncate, seeded)  # noqa: SLF001


def test_buckets_round_up_within_the_cap():
    """The bucket of n rows: the smallest size of the form 2^k or 3 * 2^(k-1), at least 8,
    that holds n, capped at the cap (so a step captures a few graph sizes, none over half
    again the rows it runs)."""
    sizes = sorted({8} | {v for k in range(3, 16) for v in (2 ** k, 3 * 2 ** (k - 1))
                          if v >= 8})
    for cap in (16, 100, 1024):
        for n in range(1, 3000):
            want = min(next(v for v in sizes if v >= n), cap)
            assert _bucket(n, cap) == want, (n, cap)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.05, 1.0), st.integers(0, 12),
       st.floats(0.2, 3.0))
def test_sampled_tokens_lie_in_the_top_k_top_p_set(seed, top_p, top_k, temperature):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, 40, generator=g) * 3
    torch.manual_seed(seed)
    token, logp = sample(logits, torch.full((64,), temperature), torch.full((64,), top_p),
                         torch.full((64,), top_k), truncate=True)
    ref = torch.log_softmax(logits.double() / temperature, -1)
    torch.testing.assert_close(logp.double(), ref.gather(-1, token[:, None])[:, 0],
                               atol=1e-5, rtol=0)
    order = ref.argsort(-1, descending=True)
    rank = (order == token[:, None]).nonzero()[:, 1]  # rank of each sampled token
    if top_k:
        assert bool((rank < top_k).all())
    kept = ref.exp().gather(-1, order)
    if top_k:
        kept[:, top_k:] = 0
    mass_before = (kept / kept.sum(-1, keepdim=True)).cumsum(-1) - kept / kept.sum(
        -1, keepdim=True)
    assert bool((mass_before.gather(-1, rank[:, None]) < top_p + 1e-5).all())


_DRAW_CHECKS = r"""
import torch
from fsdpfn.rollout import draw_kernel

# log-probs equal a float64 log_softmax(logits / T) at the drawn token; greedy rows (T <= 0)
# take torch's argmax (the first column on ties, across chunks too) and report
# log_softmax(logits); bf16 logits are read in their dtype
g = torch.Generator().manual_seed(0)
logits = (torch.randn(6, 1000, generator=g) * 3).to(torch.bfloat16)
logits[4, 10] = logits[4, 900] = logits[4].max() + 1
temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 1.0])
token, logp = draw_kernel.draw(logits, temperature, torch.tensor([7]), block=256)
scaled = logits.double() / torch.where(temperature <= 0, 1.0, temperature).double()[:, None]
want = scaled.log_softmax(-1).gather(1, token[:, None])[:, 0]
torch.testing.assert_close(logp.double(), want, atol=2e-6, rtol=0)
assert token[0] == logits[0].float().argmax() and token[4] == 10, token

# draws over many keys follow softmax(logits / T), the columns spread over 5 chunks of 8 (the
# last one partial) with chunks of very different mass, -inf logits and a chunk of them:
# chi-square over the 28 columns of nonzero probability (critical value 55.5 for p = 0.001 at 27
# degrees of freedom);
# a column of zero probability is never drawn
logits = torch.linspace(-3, 3, 38)[torch.randperm(38, generator=g)][None].clone()
logits[0, [3, 20]] = float("-inf")
logits[0, 24:32] = float("-inf")  # a whole chunk without mass
p = torch.softmax(logits.double() / 0.8, -1)[0]
rows, keys = 64, 60
counts = torch.zeros(38, dtype=torch.float64)
for key in range(keys):
    token, _ = draw_kernel.draw(logits.expand(rows, 38).contiguous(), torch.full((rows,), 0.8),
                                torch.tensor([key]), block=8)
    counts += torch.bincount(token, minlength=38).double()
n = rows * keys
assert counts[3] == 0 and counts[20] == 0 and counts[24:32].sum() == 0, counts
live = p > 0
chi2 = float(((counts[live] - n * p[live]) ** 2 / (n * p[live])).sum())
assert chi2 < 55.5, (chi2, counts / n, p)

# seeded rows: the token depends only on (seed, step, logits), not on the row's slot, the other
# rows or the unseeded rows' key; over many (seed, step) pairs the draws follow the softmax
# (the same chi-square); log-probs as above
rows = 64
seeds = torch.arange(rows) * 1000003 % 2**31
seeds[5] = -1  # an unseeded row among them
base = logits.expand(rows, 38).contiguous()
counts = torch.zeros(38, dtype=torch.float64)
for step in range(30):
    steps = torch.full((rows,), step)
    token, logp = draw_kernel.draw(base, torch.full((rows,), 0.8), torch.tensor([step]),
                                   block=8, seeds=seeds, steps=steps)
    keep = seeds >= 0
    counts += torch.bincount(token[keep], minlength=38).double()
    if step < 2:
        order = torch.randperm(rows, generator=g)
        again, lp2 = draw_kernel.draw(base[order], torch.full((rows,), 0.8),
                                      torch.tensor([step + 99]), block=8, seeds=seeds[order],
                                      steps=steps[order])
        kept = keep[order]
        assert torch.equal(again[kept], token[order][kept]), (again, token[order])
        torch.testing.assert_close(lp2[kept], logp[order][kept])
        want = (logits.double() / 0.8).log_softmax(-1)[0, token]
        torch.testing.assert_close(logp.double(), want, atol=2e-6, rtol=0)
n = counts.sum()
assert counts[3] == 0 and counts[20] == 0 and counts[24:32].sum() == 0, counts
chi2 = float(((counts[live] - n * p[live]) ** 2 / (n * p[live])).sum())
assert chi2 < 55.5, (chi2, counts / n, p)
# a different step or seed gives a different uniform: not every row repeats its token
a, _ = draw_kernel.draw(base, torch.full((rows,), 0.8), torch.tensor([0]), block=8,
                        seeds=seeds, steps=torch.zeros(rows, dtype=torch.long))
b, _ = draw_kernel.draw(base, torch.full((rows,), 0.8), torch.tensor([0]), block=8,
                        seeds=seeds, steps=torch.ones(rows, dtype=torch.long))
assert not torch.equal(a, b)
print("checked")
"""


@pytest.mark.timeout(600)
def test_fused_draw_reports_log_softmax_greedy_argmax_and_follows_the_softmax():
    """draw_kernel.draw (the decode loop's draw on CUDA) under Triton's interpreter, in a fresh
    process (the interpreter is chosen when Triton is imported): see _DRAW_CHECKS. Skipped where
    Triton is not installed; the kernels themselves run in test_decode_gpu.py."""
    _interpreted(_DRAW_CHECKS)


def _interpreted(script: str) -> None:
    """Run ``script`` under Triton's interpreter in a fresh process (the interpreter is chosen
    when Triton is imported); it prints "checked" when every check passed. Skipped where Triton
    is not installed, or where its interpreter does not run under this numpy (>= 2.3)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=500)
    if "only 0-dimensional arrays can be converted" in done.stderr:
        pytest.skip("this Triton's interpreter does not run under this numpy")
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]


_ATTENTION_CHECKS = r"""
import torch
from fsdpfn.rollout import attention_kernel, slot_model
from fsdpfn.testing.models import tiny_qwen2_config

# the kernel against a float64 softmax(q k^T * scale) v over each row's first used[r] positions,
# query head h reading kv head h // G: GQA (G = 3, not a power of two) and MHA (G = 1), one
# split and several (blocks of 16 positions, the last one partial), rows of length 1 and L
def attend64(q, k, v, used):
    R, heads, D = q.shape
    kv = k.shape[1]
    want = torch.empty(R, heads, D, dtype=torch.float64)
    for r in range(R):
        for h in range(heads):
            kr = k[r, h * kv // heads, :used[r]].double()
            vr = v[r, h * kv // heads, :used[r]].double()
            want[r, h] = torch.softmax(q[r, h].double() @ kr.T * 0.3, -1) @ vr
    return want

g = torch.Generator().manual_seed(0)
S, L, D, R = 7, 40, 16, 5
used = torch.tensor([1, 40, 17, 33, 2])
for kv, heads in ((2, 6), (2, 2)):
    q = torch.randn(R, heads, D, generator=g)
    k, v = torch.randn(2, S, kv, L, D, generator=g)
    want = attend64(q, k, v, used)
    for splits in (None, 1, 3):
        got = attention_kernel.decode(q, k, v, used, L, 0.3, block_n=16, splits=splits)
        torch.testing.assert_close(got.view(R, heads, D).double(), want, atol=1e-5, rtol=1e-5)
    # a float8 cache (--kv-cache-dtype fp8_e4m3): the float8 values, each block widened exactly
    k8, v8 = (3 * k).to(torch.float8_e4m3fn), (3 * v).to(torch.float8_e4m3fn)
    got = attention_kernel.decode(q, k8, v8, used, L, 0.3, block_n=16, splits=3)
    torch.testing.assert_close(got.view(R, heads, D).double(), attend64(q, k8, v8, used),
                               atol=1e-5, rtol=1e-5)
    # positions at or past a row's length are never read: poison them
    k2, v2 = k.clone(), v.clone()
    for r in range(R):
        k2[r, :, used[r]:], v2[r, :, used[r]:] = float("nan"), float("nan")
    got = attention_kernel.decode(q, k2, v2, used, L, 0.3, block_n=16, splits=3)
    torch.testing.assert_close(got.view(R, heads, D).double(), want, atol=1e-5, rtol=1e-5)

# shared prompts: rows in groups whose caches hold the same bits in their first P positions read
# them from the group's first row; the other rows' copies are poisoned (never read). Groups of
# 2, 3 and 4 rows, a row in no group, a row with no position past its prompt (row 1), shared
# lengths off the block edges, one split and several
S2, R2, L2 = 12, 10, 48
for kv, heads in ((2, 6), (1, 4)):
    q = torch.randn(R2, heads, D, generator=g)
    k, v = torch.randn(2, S2, kv, L2, D, generator=g)
    groups = [(20, [0, 3, 5]), (9, [1, 2]), (16, [4, 6, 7, 8])]  # row 9: in no group
    used = torch.tensor([30, 9, 40, 21, 48, 25, 17, 33, 16, 12])
    for length, ids in groups:
        for r in ids[1:]:
            k[r, :, :length], v[r, :, :length] = k[ids[0], :, :length], v[ids[0], :, :length]
    want = attend64(q, k, v, used)
    k2, v2 = k.clone(), v.clone()
    tables = attention_kernel.share_tables(groups, S2, "cpu")
    for length, ids in groups:  # only each group's first row's prompt positions are read
        k2[ids[1:], :, :length], v2[ids[1:], :, :length] = float("nan"), float("nan")
    for r in range(R2):  # nor any position at or past a row's length
        k2[r, :, used[r]:], v2[r, :, used[r]:] = float("nan"), float("nan")
    assert tables[1].tolist()[:10] == [0, 1, 1, 0, 4, 0, 4, 4, 4, 9]
    for splits in (None, 1, 3):
        got = attention_kernel.decode(q, k2, v2, used, L2, 0.3, block_n=16, splits=splits,
                                      shared=tables)
        torch.testing.assert_close(got.view(R2, heads, D).double(), want, atol=1e-5, rtol=1e-5)
        # the same bits in the same order as each row reading its own copy: equal, not close
        own = attention_kernel.decode(q, k, v, used, L2, 0.3, block_n=16, splits=splits)
        assert torch.equal(got, own)

# the whole decode step with it equals the masked-SDPA step (logits and the KV written)
torch.manual_seed(0)
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_config(tiny_qwen2_config(), dtype=torch.float32).eval()
R, L = 6, 40
sdpa = slot_model.SlotModel(model, R, L, "sdpa")
tri = slot_model.SlotModel(model, R, L, "sdpa")
tri.attention = "triton"  # the CUDA path, under the interpreter
for i in range(len(sdpa.k)):
    kv = torch.randn(2, *sdpa.k[i].shape)
    for net in (sdpa, tri):
        net.k[i].copy_(kv[0]), net.v[i].copy_(kv[1])
tok = torch.randint(0, model.config.vocab_size, (R,))
pos = torch.tensor([0, 5, 17, 39, 23, 1])
with torch.no_grad():
    want, got = sdpa.decode(tok, pos, L), tri.decode(tok, pos, L)
torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
for i in range(len(sdpa.k)):
    torch.testing.assert_close(tri.k[i], sdpa.k[i]), torch.testing.assert_close(tri.v[i], sdpa.v[i])
print("checked")
"""


@pytest.mark.timeout(600)
def test_triton_decode_attention_equals_float64_attention_over_each_rows_length():
    """attention_kernel.decode (``attention="triton"``, CUDA) under Triton's interpreter, in a
    fresh process: see _ATTENTION_CHECKS. Skipped where Triton is not installed; the kernel
    itself runs in test_decode_gpu.py."""
    _interpreted(_ATTENTION_CHECKS)


_SHARED_LOOP_CHECKS = r"""
import torch
from fsdpfn.rollout import RolloutEngine, SamplingParams, attention_kernel
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config
import sys, tempfile

# the decode loop with shared prompts: the Triton attention (under the interpreter) reads each
# prompt's KV from its first sample's slot. Which slots it groups, and the log-probs against a
# float64 teacher-forced forward of each row
path = save_tiny_model(tempfile.mkdtemp() + "/tiny", tiny_qwen2_config(), seed=0)
engine = RolloutEngine(path, dtype="float32", device="cpu", decode="loop", decode_rows=8,
                       decode_max_len=64)
net = engine._decoder.net
net.attention, net.share_prefix = "triton", True
net.shared = attention_kernel.share_tables([], net.slots, "cpu")
calls = []
set_shared = net.set_shared
net.set_shared = lambda groups: calls.append((groups, set_shared(groups))) or calls[-1][1]
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (12, 9, 4)]
out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=6, n=2))["outputs"]
groups, shared = calls[0]
assert shared and sorted(groups) == [(4, [4, 5]), (9, [2, 3]), (12, [0, 1])], calls[0]
assert net.shared[0].tolist()[:6] == [12, 12, 9, 9, 4, 4] and net.shared[1].tolist()[:6] == [
    0, 0, 2, 2, 4, 4]
# a second request: its own groups (the slots the first one left), nothing of the first
out2 = engine.generate(prompts[:1], SamplingParams(temperature=1.0, max_new_tokens=3, n=3))
assert calls[-1][0] == [(12, [0, 1, 2])] and calls[-1][1], calls[-1]
model = engine.model
for o in out:
    p = prompts[o["prompt_index"]]
    with torch.no_grad():
        ids = torch.tensor([p + o["output_ids"]])
        logp = torch.log_softmax(model(input_ids=ids).logits.double()[0], -1)
    want = logp[len(p) - 1:-1].gather(-1, ids[0, len(p):, None])[:, 0]
    torch.testing.assert_close(torch.tensor(o["output_logprobs"], dtype=torch.float64), want,
                               atol=1e-5, rtol=0)
print("checked")
"""


@pytest.mark.timeout(600)
def test_decode_loop_reads_a_shared_prompt_once_and_keeps_its_logprobs():
    """The decode loop groups the slots that hold one prompt's KV (its samples) and the Triton
    attention reads that KV once per group, under Triton's interpreter in a fresh process: see
    _SHARED_LOOP_CHECKS. Skipped where Triton is not installed; the GPU run is in
    test_decode_gpu.py."""
    _interpreted(_SHARED_LOOP_CHECKS)


_ROPE_CHECKS = r"""
import torch
from fsdpfn.rollout import rope_kernel

# the kernel against HF's rotary in the half dtype (q*cos + rotate_half(q)*sin, each product and
# the sum rounded) and the cache writes at each row's slot and position, bit for bit, nothing else
# of the caches touched; head counts that fill one program, one exactly, and several with the
# last one partial. float16 only: the interpreter rounds to bfloat16 by truncation (the GPU test
# checks bfloat16)
g = torch.Generator().manual_seed(0)
def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), -1)
for nq, nk, D in ((6, 2, 64), (12, 2, 128), (28, 4, 128), (3, 1, 32)):
    R, S, L, dtype = 5, 7, 40, torch.float16
    qkv = torch.randn(R, (nq + 2 * nk) * D, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(L).float()[:, None] * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)
    sin_signed = torch.cat((-sin[:, :D // 2], sin[:, D // 2:]), -1)
    pos = torch.tensor([0, 39, 17, 5, 23])
    slot = torch.arange(R)
    kc, vc = torch.randn(2, S, nk, L, D, generator=g).to(dtype)
    k0, v0 = kc.clone(), vc.clone()
    q = rope_kernel.rope_kv(qkv, cos, sin_signed, pos, kc, vc, nq, nk)
    x = qkv.view(R, nq + 2 * nk, D)
    c, s = cos[pos][:, None], sin[pos][:, None]
    want = x[:, :nq + nk] * c + rotate_half(x[:, :nq + nk]) * s
    assert torch.equal(q, want[:, :nq]), (nq, nk, D)
    k0[slot, :, pos], v0[slot, :, pos] = want[:, nq:], x[:, nq + nk:]
    assert torch.equal(kc, k0) and torch.equal(vc, v0), (nq, nk, D)
print("checked")
"""


@pytest.mark.timeout(600)
def test_rope_kv_kernel_equals_hfs_rotary_and_writes_only_each_rows_position():
    """rope_kernel.rope_kv (the decode step's q/k/v epilogue on CUDA) under Triton's
    interpreter, in a fresh process: see _ROPE_CHECKS. Skipped where Triton is not installed;
    the kernel runs in bfloat16 on the GPU in test_decode_gpu.py."""
    _interpreted(_ROPE_CHECKS)


_FLOAT8_CHECKS = r"""
import torch
from transformers import AutoModelForCausalLM
from fsdpfn.rollout import slot_model
from fsdpfn.testing.float8 import cache_logit_gaps
from fsdpfn.testing.models import tiny_qwen2_config

# the decode loop's network on a float8 cache (prefill writes, the torch path's KV writes through
# the cache's bytes, the kernel's reads): each decode step's logits equal the float64 model
# whose queries past the prompt read k and v rounded to float32, then float8
torch.manual_seed(0)
config = tiny_qwen2_config(initializer_range=0.2)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
R, L = 3, 24
net = slot_model.SlotModel(model, R, L, "sdpa")
net.attention, net.kv_dtype = "triton", torch.float8_e4m3fn  # the CUDA path, interpreted
net.k = [torch.zeros(t.shape, dtype=torch.float8_e4m3fn) for t in net.k]
net.v = [torch.zeros(t.shape, dtype=torch.float8_e4m3fn) for t in net.v]
gaps = cache_logit_gaps(net, model, torch.tensor([6, 4, 5]), steps=4, seed=0)
assert gaps["float8"] < 1e-4 and gaps["unrounded"] > 1e-2, gaps
print("checked")
"""


@pytest.mark.timeout(600)
def test_a_float8_cache_gives_the_float8_models_logits_under_the_interpreter():
    """--kv-cache-dtype fp8_e4m3 on the CPU, under Triton's interpreter (the server refuses it
    there; the GPU runs the same path in test_decode_gpu.py): the decode loop's network on a
    float8 cache (prefill writes, indexed writes through the cache's bytes, the kernel's reads)
    gives each decode step's logits as a float64 model whose queries past the prompt read k and
    v rounded to float8, within 1e-4; the unrounded model is more than 1e-2 away. (The kernel
    over a float8 cache alone: _ATTENTION_CHECKS.)"""
    _interpreted(_FLOAT8_CHECKS)


def test_share_tables_point_each_group_at_its_first_row_and_refuse_a_row_twice():
    """share_tables: every row of a group of two or more reads the group's shared length from
    the group's first row (its leader); a group of one row, or a row in no group, reads its own
    cache (first 0, leader itself); a row in two groups or out of range is refused by name."""
    from fsdpfn.rollout import attention_kernel as ak

    first, leader = ak.share_tables([(200, list(range(11))), (37, [21, 20]), (9, [30])], 40,
                                    "cpu")
    assert first[:11].tolist() == [200] * 11 and leader[:11].tolist() == [0] * 11
    assert first[20:22].tolist() == [37, 37] and leader[20:22].tolist() == [21, 21]
    assert int(first[30]) == 0 and int(leader[30]) == 30  # a group of one row
    assert int(first[11]) == 0 and leader[11:20].tolist() == list(range(11, 20))
    assert first.dtype == leader.dtype == torch.int32
    with pytest.raises(ValueError, match="groups: a row is in one group at most"):
        ak.share_tables([(8, [0, 1]), (8, [1, 2])], 8, "cpu")
    with pytest.raises(ValueError, match=r"groups: rows must be in \[0, 8\)"):
        ak.share_tables([(8, [6, 8])], 8, "cpu")


def test_rope_kv_kernel_is_refused_where_it_cannot_run():
    """rope_kv='triton' (the fused q/k/v epilogue) needs CUDA and a half dtype: on CPU it is a
    ValueError naming the option, an unknown value is refused by name, and "auto", the default,
    falls back to the torch path."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fsdpfn.rollout.slot_model import SlotModel

    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="rope_kv: rope_kv='triton' needs CUDA"):
        SlotModel(model, 2, 16, "sdpa", rope_kv="triton")
    with pytest.raises(ValueError, match="rope_kv: must be one of"):
        SlotModel(model, 2, 16, "sdpa", rope_kv="fused")
    assert SlotModel(model, 2, 16, "sdpa").rope_kv == "torch"  # "auto", the default, falls back


@pytest.mark.timeout(120)
def test_a_float8_kv_cache_is_refused_where_the_triton_attention_cannot_read_it(model_dir):
    """kv_cache_dtype="fp8_e4m3" (--kv-cache-dtype) is read by the Triton attention alone, on a
    GPU with float8: on the CPU, with any attention, HF generate or an unknown value, the engine
    is refused with an UpdateError naming the field, the rule and the value; "auto" serves the
    cache in the model's dtype and says so."""
    for option, match in (
            (dict(decode="loop"), r"kv_cache_dtype: 'fp8_e4m3' needs the Triton decode attention "
                                  r"\(decode_attention 'triton', or 'auto' where it runs\) on a "
                                  r"GPU of compute capability 8.9 or later, got 'sdpa' attention "
                                  r"on cpu"),
            (dict(decode="loop", decode_attention="matmul"), "got 'matmul' attention on cpu"),
            (dict(decode="hf"), "kv_cache_dtype: 'fp8_e4m3' is the decode loop's cache, and "
                                "decode 'hf' serves with HF generate on cpu"),
            (dict(decode="auto"), "decode 'auto' serves with HF generate on cpu"),
            (dict(decode="loop", kv_cache_dtype="fp8"),
             r"kv_cache_dtype: must be one of \('auto', 'fp8_e4m3'\), got 'fp8'")):
        with pytest.raises(UpdateError, match=match):
            RolloutEngine(str(model_dir), dtype="float32", device="cpu", decode_rows=8,
                          decode_max_len=96, **{"kv_cache_dtype": "fp8_e4m3", **option})
    info = RolloutEngine(str(model_dir), dtype="float32", device="cpu", decode="loop",
                         decode_rows=8, decode_max_len=96).info()
    assert info["kv_cache_dtype"] == "auto" and "float32 KV cache" in info["decode"], info


def test_kv_bytes_per_slot_is_one_byte_a_value_in_float8():
    """The decode cache's size per slot (what the default rows and the launcher's estimate are
    computed from): 2 x layers x kv heads x head size x positions x the element's bytes."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fsdpfn.rollout.slot_model import SlotModel

    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2), dtype=torch.bfloat16)
    assert SlotModel.kv_bytes_per_slot(model, 100) == 2 * 3 * 2 * 8 * 100 * 2
    assert SlotModel.kv_bytes_per_slot(model, 100, "fp8_e4m3") == 2 * 3 * 2 * 8 * 100


@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
def test_float64_decode_steps_equal_the_float64_forward(attention):
    """A float64 model served by SlotModel (a reference build of the decode path) keeps float64
    throughout: four decode steps' logits (``raw``: the model's dtype) equal HF's float64
    forward of each whole row to 1e-9 (with scores taken in float32 the gap was 1.8e-8);
    prefill's, returned in float32 as always, to float32's rounding."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fsdpfn.rollout.slot_model import SlotModel

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2), dtype=torch.float64).eval()
    net = SlotModel(model, 3, 32, attention)
    ids = torch.randint(0, 96, (3, 9))
    lengths = torch.tensor([9, 5, 7])
    rows = [ids[i, :int(n)].tolist() for i, n in enumerate(lengths)]
    with torch.no_grad():
        logits = net.prefill(ids, lengths, torch.arange(3), torch.arange(3))
        for step in range(5):
            for i, row in enumerate(rows):
                want = model(input_ids=torch.tensor([row])).logits[0, -1]
                gap = float((logits[i].double() - want).abs().max())
                assert gap < (1e-9 if step else 1e-6), (step, i, gap)
            tok = logits.argmax(-1)
            for i, t in enumerate(tok.tolist()):
                rows[i].append(t)
            pos = torch.tensor([len(r) - 1 for r in rows])
            logits = net.decode(tok, pos, 32, raw=True)
            assert logits.dtype == torch.float64
