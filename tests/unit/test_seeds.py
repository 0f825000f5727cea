"""Seeded sampling on both generation paths of the rollout server (CPU): each prompt of a
request draws from its own seed (fsdpfn.rollout.sampling.prompt_seed), so a prompt's tokens
depend on the request's seed, the prompt's index, the sample's index and the logits, and never
on the other prompts batched with it; the request of prompts k, k+1, ... seeded
prompt_seed(seed, k) draws what they draw in the whole request (how a batch is split over
servers). HF generate's seeded draw is checked against the model's own distribution."""

from __future__ import annotations

import pytest
import torch

from fsdpfn.rollout.sampling import SamplingParams, prompt_seed
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("seeds") / "tiny", tiny_qwen2_config(),
                               seed=0))


@pytest.fixture(scope="module", params=["loop", "hf"])
def engine(request, model_dir):
    from fsdpfn.rollout.engine import RolloutEngine

    return RolloutEngine(model_dir, decode=request.param, decode_rows=32)


def _tokens(engine, prompts, seed, **kw):
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed, **kw)
    return [o["output_ids"] for o in engine.generate(prompts, sp)["outputs"]]


PROMPTS = [[1, 2, 3], [1, 2, 3], [7, 8], [9, 10, 11, 12], [5]]


def test_each_prompt_draws_its_own_tokens_whatever_else_is_batched(engine):
    whole = _tokens(engine, PROMPTS, seed=42, n=2)
    assert whole == _tokens(engine, PROMPTS, seed=42, n=2)  # reproducible
    # identical prompts of one request do not share their draws
    assert whole[0:2] != whole[2:4]
    # another prompt in slot 2 leaves every other prompt's tokens as they were
    changed = _tokens(engine, PROMPTS[:2] + [[40, 41, 42]] + PROMPTS[3:], seed=42, n=2)
    assert changed[:4] == whole[:4] and changed[6:] == whole[6:] and changed[4:6] != whole[4:6]


@pytest.mark.parametrize("k", [1, 3])
def test_a_request_of_the_tail_seeded_by_prompt_seed_draws_what_the_whole_request_does(engine,
                                                                                       k):
    whole = _tokens(engine, PROMPTS, seed=7, n=2)
    tail = _tokens(engine, PROMPTS[k:], seed=prompt_seed(7, k), n=2)
    assert tail == whole[2 * k:]


def test_hf_seeded_draws_follow_the_models_distribution(model_dir):
    """3,000 seeded first tokens at temperature 0.5 and top-k 8: their frequencies match the
    float64 distribution of the model's logits, top-8 renormalised (total variation)."""
    from transformers import AutoModelForCausalLM

    from fsdpfn.rollout.engine import RolloutEngine

    engine = RolloutEngine(model_dir, decode="hf")
    prompt = [3, 14, 15, 92]
    rows = 3000
    sp = SamplingParams(max_new_tokens=1, temperature=0.5, top_k=8, seed=123, n=1)
    out = engine.generate([prompt] * rows, sp)["outputs"]
    counts = torch.bincount(torch.tensor([o["output_ids"][0] for o in out]), minlength=128)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1] / 0.5
    top = logits.topk(8)
    want = torch.zeros(128, dtype=torch.float64)
    want[top.indices] = torch.softmax(top.values, -1)
    assert counts[want == 0].sum() == 0  # nothing outside the top 8
    tv = 0.5 * float((counts.double() / rows - want).abs().sum())
    assert tv < 0.05, tv
