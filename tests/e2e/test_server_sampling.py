"""The server samples the request's distribution and nothing else, through HTTP, against the
plain HF model in float64 (the same weights).

- A model directory whose generation_config.json carries sampling defaults (Qwen2.5-Instruct's:
  repetition_penalty 1.05, temperature 0.7, top_p 0.8, top_k 20) had them applied by HF generate
  to every field a request left unset: a greedy request that asked for no penalty did not follow
  the argmax. The served model's defaults are transformers' neutral ones now.
- Seeded draws never leave top-k (the draw's zero uniform: tests/unit/test_seeded_draw.py).
- A request with one sampling_params dict per prompt ran each prompt as prompt 0 of its own
  request, so a seed drew the same tokens for every prompt; prompt i draws from its own seed,
  prompt_seed(seed, i), in either form.
- A temperature below 1e-6 is greedy (SGLang's rule; it overflowed the logits, an HTTP 500), and
  an infinite one is refused by name.
- A matched stop token id is left out of `text`, as SGLang's trim_matched_stop (and vLLM) do;
  `output_ids` keep it.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from fsdpfn.rollout import launch_server
from fsdpfn.testing import write_tiny_hf_dir

pytestmark = pytest.mark.dist
TEXTS = ["What is 2+3? The answer is 5.", "Paris is the capital of France.",
         "one two three four five six seven", "Hello, world! Hello again."] * 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Qwen2 directory with a wider lm_head (a clear top-k), and generation defaults
    as an instruct model ships them."""
    from safetensors.torch import load_file, save_file

    path = write_tiny_hf_dir(tmp_path_factory.mktemp("m") / "peaky", texts=TEXTS, seed=3)
    weights = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    weights["lm_head.weight"] = torch.randn(weights["lm_head.weight"].shape, generator=g) * 0.6
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "generation_config.json").read_text())
    config.update(do_sample=True, repetition_penalty=1.05, temperature=0.7, top_p=0.8, top_k=20)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def url(model_dir):
    with launch_server(model_dir, dtype="float32", extra_args=("--no-channel",)) as server:
        yield server.url


def _generate(url, payload):
    response = httpx.post(f"{url}/generate", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@torch.no_grad()
def _last_logits(model, ids):
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("text, temperature", [("Hello, world!", 0), ("Paris is", 0),
                                               ("Paris is", 1e-45)])
def test_greedy_is_the_argmax_whatever_the_models_generation_defaults(url, reference, text,
                                                                      temperature):
    # a temperature below 1e-6 is greedy, as SGLang serves it: dividing the logits by 1e-45
    # overflowed them to inf and the draw failed with an HTTP 500
    model, tok = reference
    prompt = tok.encode(text)
    out = _generate(url, {"input_ids": prompt, "sampling_params": {
        "temperature": temperature, "max_new_tokens": 20, "ignore_eos": True}})
    context = list(prompt)
    for step, got in enumerate(out["output_ids"]):
        logits = _last_logits(model, context)
        top2 = logits.topk(2).values
        assert got == int(logits.argmax()) or float(top2[0] - top2[1]) < 1e-4, (step, got)
        context.append(got)


@pytest.mark.timeout(240)
def test_seeded_one_token_draws_stay_inside_top_k(url, reference):
    model, tok = reference
    prompt = tok.encode("Hello, world!")
    top3 = set(_last_logits(model, prompt).topk(3).indices.tolist())
    for seed in [144116, 595958, *range(40)]:
        out = _generate(url, {"input_ids": prompt, "sampling_params": {
            "temperature": 1.0, "top_k": 3, "max_new_tokens": 1, "ignore_eos": True,
            "sampling_seed": seed}})
        assert out["output_ids"][0] in top3, (seed, out["output_ids"])


@pytest.mark.timeout(240)
def test_a_list_of_sampling_params_draws_what_one_dict_draws(url, reference):
    _, tok = reference
    prompt = tok.encode("Hello, world!")
    sp = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 42}
    one = _generate(url, {"input_ids": [prompt] * 3, "sampling_params": sp,
                          "return_format": "fsdpfn"})
    per = _generate(url, {"input_ids": [prompt] * 3, "sampling_params": [sp] * 3,
                          "return_format": "fsdpfn"})
    one = [o["output_ids"] for o in one["outputs"]]
    per = [o["output_ids"] for o in per["outputs"]]
    assert per == one and len({tuple(x) for x in one}) == 3, (one, per)


@pytest.mark.timeout(240)
def test_a_matched_stop_token_id_is_left_out_of_the_text(url, reference):
    _, tok = reference
    prompt = tok.encode("Hello, world!")
    base = {"temperature": 0, "max_new_tokens": 14, "ignore_eos": True}
    stop = _generate(url, {"input_ids": prompt, "sampling_params": base})["output_ids"][5]
    out = _generate(url, {"input_ids": prompt, "sampling_params": {**base,
                                                                    "stop_token_ids": [stop]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"][-1] == stop
    assert out["text"] == tok.decode(out["output_ids"][:-1], skip_special_tokens=True)
    kept = _generate(url, {"input_ids": prompt, "sampling_params": {
        **base, "stop_token_ids": [stop], "no_stop_trim": True}})
    assert kept["text"] == tok.decode(kept["output_ids"], skip_special_tokens=True)


@pytest.mark.timeout(120)
def test_an_infinite_temperature_is_refused_by_name(url):
    response = httpx.post(f"{url}/generate", content='{"input_ids": [1, 2, 3], '
                          '"sampling_params": {"temperature": Infinity}}',
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    assert "sampling_params.temperature: must be a finite number >= 0" in response.text
    assert _generate(url, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
