"""The built-in server's SGLang and OpenAI faces, driven as their own clients drive them: requests
shaped as AReaL's RemoteSGLangEngine and verl's async SGLang server send them (answers parsed as
they parse them: meta_info.output_token_logprobs as [logprob, id, text] triples), and the real
``openai`` package against /v1/completions and /v1/chat/completions, on a real server process
(python -m fsdpfn.rollout) serving a tiny model directory with a trained tokenizer.

References: a float64 teacher-forced forward of the same weights (log-probs), a float64 greedy
loop applying SGLang's penalties (tokens), the tokenizer itself (texts).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from fsdpfn.rollout import RolloutEngine, SamplingParams, UpdateError, launch_server, openai_api
from fsdpfn.rollout.client import from_sglang, generate
from fsdpfn.testing import write_tiny_hf_dir

LOGP_ATOL = 1e-5  # float32 server against a float64 reference (see tests/unit/test_rollout.py)
TEXTS = ["What is 2+3? The answer is 5.", "Paris is the capital of France.",
         "one two three four five six seven", "Hello, world! Hello again."] * 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_dir(tmp_path_factory.mktemp("m") / "tiny", texts=TEXTS, seed=3)


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("s") / "logs" / "not-yet-made"


@pytest.fixture(scope="module")
def server(model_dir, logs):
    # log_dir need not exist (it was a FileNotFoundError): launch_server makes it
    with launch_server(model_dir, dtype="float32", extra_args=("--no-channel",),
                       log_dir=logs) as srv:
        yield srv


def test_the_server_logs_into_the_directory_it_was_given(server, logs):
    assert [p.name for p in logs.iterdir()] == [f"rollout-{server.url.rsplit(':', 1)[1]}.log"]


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def _ref_logp(model, prompt, output, temperature=1.0) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([prompt + output])
        logp = torch.log_softmax(model(input_ids=ids).logits[0] / temperature, -1)
    return logp[len(prompt) - 1:-1].gather(-1, ids[0, len(prompt):, None])[:, 0]


def _post_raw(server, path: str, payload: dict):
    """POST JSON, the answer as parsed (SGLang answers a list for several outputs)."""
    import json
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(server.url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with opener.open(req, timeout=60) as resp:
        return json.loads(resp.read())


def _get_raw(server, path: str) -> tuple[int, bytes]:
    """GET: (HTTP status, body as sent)."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(server.url + path, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _check_triples(model, prompt, meta, temperature):
    """Parse as AReaL/verl do; the log-probs are the float64 forward's."""
    triples = meta["output_token_logprobs"]
    assert all(len(t) == 3 for t in triples)
    tokens, logps = [t[1] for t in triples], [t[0] for t in triples]
    torch.testing.assert_close(torch.tensor(logps, dtype=torch.float64),
                               _ref_logp(model, prompt, tokens, temperature),
                               atol=LOGP_ATOL, rtol=0)
    return tokens


# ---------------------------------------------------------------- SGLang's /generate


@pytest.mark.timeout(120)
def test_areal_shaped_request_gets_sglangs_answer(server, reference):
    model, tok = reference
    prompt = tok.encode("What is 2+3?")
    payload = {"input_ids": prompt, "image_data": None, "sampling_params": {
        "top_p": 0.9, "top_k": -1, "max_new_tokens": 6, "temperature": 0.8,
        "stop_token_ids": None, "frequency_penalty": 0.0}, "return_logprob": True,
        "stream": False}
    out = server.post("/generate", payload)
    assert out.pop("status") == 200 and set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    tokens = _check_triples(model, prompt, meta, 0.8)
    assert tokens == out["output_ids"] and meta["completion_tokens"] == len(tokens)
    assert meta["prompt_tokens"] == len(prompt) and meta["weight_version"] == "0"
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert len(tokens) == 6 and meta["finish_reason"]["length"] == 6
    assert out["text"] == tok.decode(tokens, skip_special_tokens=True)


@pytest.mark.timeout(120)
def test_verl_shaped_and_batched_requests_answer_lists_prompt_major(server, reference):
    model, tok = reference
    prompts = [tok.encode("Paris is"), tok.encode("one two three")]
    # verl: GenerateReqInput(rid, input_ids, sampling_params, return_logprob) as a dict
    one = server.post("/generate", {"rid": "req-7", "input_ids": prompts[0], "text": None,
                                    "sampling_params": {"temperature": 0, "max_new_tokens": 5,
                                                        "repetition_penalty": 1.0},
                                    "return_logprob": True, "lora_path": None})
    assert one["meta_info"]["id"] == "req-7"
    greedy = _check_triples(model, prompts[0], one["meta_info"], 1.0)
    with torch.no_grad():  # greedy: each token is the float64 argmax
        logits = model(input_ids=torch.tensor([prompts[0] + greedy])).logits[0]
    assert logits[len(prompts[0]) - 1:-1].argmax(-1).tolist() == greedy
    items = _post_raw(server, "/generate", {"input_ids": prompts, "return_logprob": True,
                                            "sampling_params": {"n": 2, "max_new_tokens": 4,
                                                                "sampling_seed": 5}})
    assert isinstance(items, list) and len(items) == 4
    for i, item in enumerate(items):
        _check_triples(model, prompts[i // 2], item["meta_info"], 1.0)
        assert item["meta_info"]["prompt_tokens"] == len(prompts[i // 2])
    converted = from_sglang(items, 2)
    assert [o["prompt_index"] for o in converted["outputs"]] == [0, 0, 1, 1]
    assert converted["weight_version"] == 0


@pytest.mark.timeout(120)
def test_text_stop_strings_min_tokens_and_eos(server, reference):
    model, tok = reference
    free = server.post("/generate", {"text": "Hello, world!", "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})
    assert free["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    text = free["text"]
    cut = text[2:4] if len(text) >= 4 else None
    assert cut and cut.strip(), text  # the stop-string checks below always run
    stopped = server.post("/generate", {"text": "Hello, world!", "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "stop": [cut]}})
    reason = stopped["meta_info"]["finish_reason"]
    assert reason == {"type": "stop", "matched": cut}
    assert stopped["text"] == text[:text.index(cut)]
    ids = stopped["output_ids"]
    assert cut in tok.decode(ids) and cut not in tok.decode(ids[:-1])
    later = server.post("/generate", {"text": "Hello, world!", "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "stop": [cut],
        "min_new_tokens": len(free["output_ids"])}})
    assert len(later["output_ids"]) == 12  # not ended before min_new_tokens
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    first = free["output_ids"][0]
    ended = server.post("/generate", {"text": "Hello, world!", "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "stop_token_ids": [first]}})
    assert ended["output_ids"] == [first]
    assert ended["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    info = server.get("/get_model_info")
    assert eos in info["eos_token_ids"]


def _greedy_with_penalties(model, prompt, steps, freq, pres, rep):
    """SGLang's penalties in float64, step by step, over the generated tokens only."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            counts = torch.zeros_like(logits)
            for t in out:
                counts[t] += 1
            logits = logits - freq * counts - pres * (counts > 0)
            logits = torch.where(counts > 0, torch.where(logits < 0, logits * rep,
                                                         logits / rep), logits)
            t = int(logits.argmax())
            out.append(t)
            ids.append(t)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("freq,pres,rep", [(1.5, 0.0, 1.0), (0.0, 1.2, 1.0), (0.0, 0.0, 1.8),
                                           (0.5, 0.5, 1.3)])
def test_penalties_follow_sglangs_definition(server, reference, freq, pres, rep):
    model, tok = reference
    prompt = tok.encode("one two three")
    out = server.post("/generate", {"input_ids": prompt, "sampling_params": {
        "temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "frequency_penalty": freq,
        "presence_penalty": pres, "repetition_penalty": rep}})
    assert out["output_ids"] == _greedy_with_penalties(model, prompt, 10, freq, pres, rep)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("payload,named", [
    ({"input_ids": [1, 2], "sampling_params": {"json_schema": "{}"}}, "json_schema"),
    ({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "regex"),
    ({"input_ids": [1, 2], "sampling_params": {"ebnf": "root ::= x"}}, "ebnf"),
    ({"input_ids": [1, 2], "sampling_params": {"temprature": 1}}, "temprature"),
    ({"input_ids": [1, 2], "stream": True}, "stream"),
    ({"input_ids": [1, 2], "logprob_start_len": 0}, "logprob_start_len"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "return_logprob": "abc"}, "return_logprob: must be a bool"),
    ({"input_ids": [[1, 2]], "return_logprob": [1]}, "return_logprob: must be a bool"),
    ({"input_ids": [1, 2], "return_text_in_logprobs": "no"},
     "return_text_in_logprobs: must be a bool"),
    ({"input_ids": [1, 2], "rid": 3}, "rid: must be a string"),
    ({"text": "hi", "input_ids": [1]}, "input_ids, text")])
def test_unsupported_keys_are_refused_by_name(server, payload, named):
    out = server.post("/generate", payload)
    assert out["status"] == 400 and out["object"] == "error" and out["code"] == 400
    assert named in out["message"]


@pytest.mark.timeout(60)
def test_a_body_that_is_not_json_gets_each_endpoints_error_shape(server):
    """/generate answered a body that does not parse in the update endpoints' shape, without
    SGLang's "object" and "code"; every endpoint outside /v1 answers both shapes at once."""
    import json
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    for path in ("/generate", "/update_weights_from_disk"):
        req = urllib.request.Request(server.url + path, data=b"{not json",
                                     headers={"Content-Type": "application/json"},
                                     method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            opener.open(req, timeout=30)
        body = json.loads(info.value.read())
        assert info.value.code == 400 and body["success"] is False
        assert body["message"].startswith("body: must be a JSON document")
        assert (body.get("object"), body.get("code")) == ("error", 400), (path, body)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("payload,named", [
    ({"flush_cache": "maybe"}, "flush_cache"),
    ({"commit": "false"}, "commit"),  # read as truth, it committed what was meant to be staged
    ({"verify_checksums": 0}, "verify_checksums"),
    ({"merged_adapters": "yes"}, "merged_adapters"),
    ({"abort_all_requests": 1}, "abort_all_requests")])
def test_an_update_flag_that_is_not_a_bool_is_refused_and_the_weights_stay(server, model_dir,
                                                                           payload, named):
    before = server.get("/get_model_info")
    out = server.post("/update_weights_from_disk", {"model_path": str(model_dir), **payload})
    assert out["status"] == 400 and out["success"] is False
    assert out["message"].startswith(f"{named}: must be a bool (true or false), got "), out
    after = server.get("/get_model_info")
    assert (after["version"], after["weight_version"]) == (before["version"],
                                                           before["weight_version"])


@pytest.mark.timeout(120)
def test_info_versions_pause_and_disk_update_speak_sglang(server, model_dir):
    info = server.get("/get_model_info")
    assert info["tokenizer_path"] == str(model_dir) and info["is_generation"] is True
    assert info["weight_version"] == str(server.get("/weight_version")["weight_version"])
    assert isinstance(server.get("/get_weight_version")["weight_version"], str)
    paused = server.post("/pause_generation", {"mode": "abort"})
    resumed = server.post("/continue_generation", {})
    assert paused == {"status": "ok", "message": "Generation paused successfully.",
                      "success": True}  # the helper's HTTP status is overwritten by SGLang's
    assert resumed["message"] == "Generation continued successfully."
    bad = server.post("/update_weights_from_disk", {"model_path": str(model_dir),
                                                    "weight_version": 1.5})
    assert bad["status"] == 400 and "weight_version" in bad["message"]
    assert bad["num_paused_requests"] == 0 and bad["success"] is False
    # any string labels the weights, as SGLang takes it; fsdpfn's own version moves by one
    version = server.get("/weight_version")["weight_version"]
    ok = server.post("/update_weights_from_disk", {"model_path": str(model_dir),
                                                   "weight_version": "rl-step-1"})
    assert ok["success"] is True and ok["num_paused_requests"] == 0
    assert ok["weight_version"] == version + 1 == server.get("/weight_version")["weight_version"]
    assert server.get("/get_weight_version") == {"weight_version": "rl-step-1"}
    info = server.get("/get_model_info")
    assert info["weight_version"] == "rl-step-1" and info["version"] == version + 1
    out = server.post("/generate", {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2}})
    assert out["meta_info"]["weight_version"] == "rl-step-1"
    ok = server.post("/update_weights_from_disk", {"model_path": str(model_dir),
                                                   "weight_version": "4"})
    assert ok["success"] is True and ok["weight_version"] == 4
    assert server.get("/get_weight_version") == {"weight_version": "4"}
    # a string spelling a version otherwise is that version, its string kept as SGLang keeps it
    ok = server.post("/update_weights_from_disk", {"model_path": str(model_dir),
                                                   "weight_version": "007"})
    assert ok["success"] is True and ok["weight_version"] == 7
    assert server.get("/get_weight_version") == {"weight_version": "007"}
    assert server.get("/get_model_info")["version"] == 7
    # the server takes the version it is given, a lower one too
    ok = server.post("/update_weights_from_disk", {"model_path": str(model_dir),
                                                   "weight_version": 2})
    assert ok["success"] is True and server.get("/weight_version") == {"weight_version": 2}
    # a missing directory: SGLang's 400 with success false, the weights kept
    missing = server.post("/update_weights_from_disk", {"model_path": str(model_dir / "none")})
    assert missing["status"] == 400 and missing["success"] is False
    assert "model_path: must be a directory" in missing["message"]
    assert missing["num_paused_requests"] == 0
    assert server.get("/weight_version") == {"weight_version": 2}


@pytest.mark.timeout(120)
def test_health_generate_pause_modes_and_meta_info_speak_sglang(server):
    assert _get_raw(server, "/health_generate") == (200, b"")  # one token generated
    assert _get_raw(server, "/health") == (200, b"")  # SGLang's: the state is /get_model_info's
    bad = server.post("/pause_generation", {"mode": "sleep"})
    assert bad["status"] == 400 and bad["success"] is False
    assert bad["message"] == "mode: must be one of ['abort', 'retract', 'in_place'], got 'sleep'"
    for mode in ("retract", "in_place"):  # SGLang's "status" stands where the HTTP one would
        paused = server.post("/pause_generation", {"mode": mode})
        resumed = server.post("/continue_generation", {})
        assert paused["message"] == "Generation paused successfully." and paused["success"]
        assert resumed["message"] == "Generation continued successfully."
    # nothing was left paused: generation answers, with SGLang's counts of what it never does
    one = server.post("/generate", {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2}})
    several = _post_raw(server, "/generate", {"input_ids": [[1, 2], [3]], "sampling_params": {
        "max_new_tokens": 2}})
    for meta in [one["meta_info"]] + [item["meta_info"] for item in several]:
        assert meta["num_retractions"] == 0 and meta["reasoning_tokens"] == 0


@pytest.mark.timeout(120)
def test_fsdpfn_client_keeps_its_answer(server, reference):
    model, tok = reference
    prompts = [tok.encode("Paris is"), tok.encode("Hello")]
    answer = generate(server.url, prompts, n=2, max_new_tokens=4, seed=3, temperature=1.0)
    assert isinstance(answer["weight_version"], int)
    assert [o["prompt_index"] for o in answer["outputs"]] == [0, 0, 1, 1]
    again = generate(server.url, prompts, n=2, max_new_tokens=4, seed=3, temperature=1.0)
    assert again["outputs"] == answer["outputs"]  # seeded
    for o in answer["outputs"]:
        torch.testing.assert_close(
            torch.tensor(o["output_logprobs"], dtype=torch.float64),
            _ref_logp(model, prompts[o["prompt_index"]], o["output_ids"]), atol=LOGP_ATOL,
            rtol=0)


def test_from_sglang_reads_one_object_or_a_list():
    item = {"text": "x", "output_ids": [5, 6], "meta_info": {
        "finish_reason": {"type": "length", "length": 2}, "weight_version": "3",
        "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]}}
    assert from_sglang(item, 1) == {"weight_version": 3, "outputs": [{
        "prompt_index": 0, "output_ids": [5, 6], "output_logprobs": [-0.5, -1.5],
        "finish_reason": "length"}]}
    stop = {**item, "meta_info": {**item["meta_info"], "finish_reason": {"type": "stop"},
                                  "weight_version": "default"}}
    out = from_sglang([item, stop, item, stop], 2)
    assert [o["prompt_index"] for o in out["outputs"]] == [0, 0, 1, 1]
    assert out["outputs"][1]["finish_reason"] == "stop" and out["weight_version"] == 3


# ---------------------------------------------------------------- OpenAI's /v1


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", reason="the openai package drives /v1")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.mark.timeout(120)
def test_openai_client_completions_with_logprobs(client, model_dir, reference):
    model, tok = reference
    assert [m.id for m in client.models.list().data] == [str(model_dir)]
    res = client.completions.create(model=str(model_dir), prompt="What is 2+3?", max_tokens=5,
                                    n=2, temperature=0.7, logprobs=2, seed=1)
    prompt = tok.encode("What is 2+3?")
    assert len(res.choices) == 2 and res.usage.prompt_tokens == len(prompt)
    assert res.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in res.choices)
    for choice in res.choices:
        ids = choice.model_extra["token_ids"]
        lp = choice.logprobs
        assert lp.tokens == [tok.decode([t]) for t in ids]
        torch.testing.assert_close(torch.tensor(lp.token_logprobs, dtype=torch.float64),
                                   _ref_logp(model, prompt, ids, 0.7), atol=LOGP_ATOL, rtol=0)
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
        for i, top in enumerate(lp.top_logprobs):  # the two best
            assert len(top) == 2 and max(top.values()) >= lp.token_logprobs[i] - 1e-6, \
                (top, lp.token_logprobs[i])
        assert choice.finish_reason in ("stop", "length")
        assert choice.text == tok.decode(ids, skip_special_tokens=True)
    ids_prompt = client.completions.create(model="m", prompt=prompt, max_tokens=3,
                                           temperature=0)
    assert ids_prompt.usage.prompt_tokens == len(prompt)


@pytest.mark.timeout(120)
def test_openai_client_chat_with_logprobs(client, reference):
    model, tok = reference
    messages = [{"role": "user", "content": "What is 2+3?"}]
    res = client.chat.completions.create(model="m", messages=messages, max_tokens=6,
                                         logprobs=True, top_logprobs=3, temperature=1.0)
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    choice = res.choices[0]
    ids = choice.model_extra["token_ids"]
    assert res.usage.prompt_tokens == len(prompt_ids)
    assert res.usage.completion_tokens == len(ids) == len(choice.logprobs.content)
    content = choice.logprobs.content
    torch.testing.assert_close(torch.tensor([c.logprob for c in content], dtype=torch.float64),
                               _ref_logp(model, prompt_ids, ids), atol=LOGP_ATOL, rtol=0)
    for c, t in zip(content, ids):
        assert c.token == tok.decode([t])
        # a token's own bytes: its text's where it decodes alone, a byte piece's (test_server_
        # api_rules.py rebuilds texts from them) where it decodes to U+FFFD
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token
        assert "\ufffd" in c.token or c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 3
    assert choice.message.role == "assistant"
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.timeout(60)
def test_openai_client_sees_refusals_by_name(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="m", prompt="hi", max_tokens=2, logit_bias={"1": 5})
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="max_tokens: must be an int >= 1"):
        client.completions.create(model="m", prompt="hi", max_tokens=0)
    hi = [{"role": "user", "content": "hi"}]  # chat names the key it was sent
    with pytest.raises(openai.BadRequestError,
                       match="max_completion_tokens: must be an int >= 1, got -1"):
        client.chat.completions.create(model="m", messages=hi, max_completion_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens: must be an int >= 1, got 0"):
        client.chat.completions.create(model="m", messages=hi, max_tokens=0)


@pytest.mark.timeout(120)
def test_openai_client_streams_completions(client):
    ask = dict(model="m", prompt=["What is 2+3?", "Paris is"], max_tokens=5, n=2,
               temperature=1.0, seed=4, logprobs=2)
    whole = client.completions.create(**ask)
    chunks = list(client.completions.create(**ask, stream=True,
                                            stream_options={"include_usage": True}))
    assert {c.object for c in chunks} == {"text_completion"}
    texts, reasons, logprobs = {}, {}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        reasons[choice.index] = reasons.get(choice.index) or choice.finish_reason
        if choice.logprobs is not None:
            logprobs[choice.index] = choice.logprobs.token_logprobs
    assert texts == {c.index: c.text for c in whole.choices} and len(texts) == 4
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert logprobs == {c.index: c.logprobs.token_logprobs for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    plain = list(client.completions.create(**ask, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


# ---------------------------------------------------------------- the engine, in one process


@pytest.mark.timeout(120)
def test_health_generate_is_503_while_generation_cannot_answer(model_dir, monkeypatch):
    from fastapi.testclient import TestClient

    from fsdpfn.rollout import server

    engine = RolloutEngine(str(model_dir), dtype="float32", device="cpu")
    monkeypatch.setattr(server, "HEALTH_GENERATE_S", 1.0)
    client = TestClient(server.build_app(engine))
    assert client.get("/health_generate").status_code == 200
    engine.pause()  # the probe waits, as any request would, past its limit
    try:
        assert client.get("/health_generate").status_code == 503
        deadline = time.monotonic() + 10  # the timed-out probe is aborted, not left queued
        while engine.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.busy() and engine.abort(abort_all=True) == 0
    finally:
        engine.resume()
    assert client.get("/health_generate").status_code == 200


class _OneText:
    """A tokenizer whose every token decodes to one text, as byte pieces decode to "\ufffd"."""

    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [1] * len(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "\ufffd" * len(ids)


@pytest.mark.timeout(120)
def test_completion_top_logprobs_hold_the_n_best_when_texts_coincide(model_dir, reference):
    model, tok = reference
    engine = RolloutEngine(str(model_dir), dtype="float32", device="cpu")
    engine.tokenizer = _OneText()
    prompt = tok.encode("Paris is")
    out = openai_api.completions(engine, {"prompt": prompt, "max_tokens": 4, "logprobs": 3,
                                          "temperature": 1.0, "seed": 2})
    (choice,) = out["choices"]
    ids = choice["token_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0]
    best = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].topk(3)
    tops = choice["logprobs"]["top_logprobs"]
    assert len(tops) == len(ids)
    for top, values, indices in zip(tops, best.values, best.indices):
        # the text keys its best token; the others are keyed by id, best first
        assert list(top) == ["\ufffd"] + [f"token_id:{t}" for t in indices[1:].tolist()]
        torch.testing.assert_close(torch.tensor(list(top.values()), dtype=torch.float64),
                                   values, atol=LOGP_ATOL, rtol=0)


@pytest.mark.timeout(120)
def test_decode_loop_refuses_what_it_does_not_implement(model_dir):
    engine = RolloutEngine(str(model_dir), dtype="float32", device="cpu", decode="loop",
                           decode_rows=8, decode_max_len=64)
    for key, value in (("frequency_penalty", 0.5), ("presence_penalty", 0.5),
                       ("repetition_penalty", 1.2), ("min_new_tokens", 2), ("min_p", 0.1)):
        with pytest.raises(UpdateError, match=f"sampling_params.{key}: not supported by the "
                                              f"decode loop"):
            engine.generate([[1, 2]], SamplingParams(max_new_tokens=4, **{key: value}))
    with pytest.raises(UpdateError, match="top_logprobs_num: not supported by the decode loop"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=4), top_logprobs=2)
    out = engine.generate([[1, 2]], SamplingParams(max_new_tokens=4, temperature=0))["outputs"]
    assert len(out[0]["output_ids"]) == 4  # what it implements runs


def test_sampling_params_speak_sglangs_names():
    sp = SamplingParams(top_k=-1, sampling_seed=4, stop="x", max_new_tokens=3)
    assert (sp.top_k, sp.seed, sp.stop) == (0, 4, ["x"])
    assert SamplingParams(stop_token_ids=[7]).with_stops([2, 7]).stop_token_ids == [7, 2]
    assert SamplingParams(ignore_eos=True).with_stops([2]).stop_token_ids == []
    for key, value, rule in (("min_new_tokens", 5, "in \\[0, max_new_tokens\\]"),
                             ("frequency_penalty", 3, "in \\[-2, 2\\]"),
                             ("stop", [""], "non-empty string"),
                             ("stop", 5, "a non-empty string or a list of them, got 5"),
                             ("stop_token_ids", ["5"], "a list of token ids \\(ints >= 0\\)"),
                             ("stop_token_ids", [True], "a list of token ids"),
                             ("stop_token_ids", 3, "a list of token ids")):
        with pytest.raises(UpdateError, match=f"sampling_params.{key}: must be .*{rule}"):
            SamplingParams(max_new_tokens=3, **{key: value})
    # integers of numpy or torch are token ids too
    assert SamplingParams(stop_token_ids=[np.int64(3), torch.tensor(4)]).stop_token_ids == [3, 4]
    with pytest.raises(UpdateError, match="sampling_params.structural_tag: not supported"):
        SamplingParams(structural_tag={"x": 1})


@pytest.mark.timeout(120)
def test_decode_loop_seeds_rows_reproducibly(model_dir):
    engine = RolloutEngine(str(model_dir), dtype="float32", device="cpu", decode="loop",
                           decode_rows=8, decode_max_len=64)
    sp = SamplingParams(max_new_tokens=8, n=3, seed=11, temperature=1.0)
    first = [o["output_ids"] for o in engine.generate([[1, 2], [3]], sp)["outputs"]]
    again = [o["output_ids"] for o in engine.generate([[1, 2]], sp)["outputs"]]
    assert again == first[:3]  # the same rows, whatever else was batched with them
    assert len({tuple(o) for o in first[:3]}) > 1  # the n samples of one prompt differ
    other = SamplingParams(max_new_tokens=8, n=3, seed=12, temperature=1.0)
    assert [o["output_ids"] for o in engine.generate([[1, 2]], other)["outputs"]] != first[:3]


def test_seeded_race_samples_the_softmax():
    """Over many seeds, the seeded exponential race picks each token at its float64 softmax
    probability (4000 draws: 3 standard errors are below 0.025)."""
    from fsdpfn.rollout.decode import sample

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(4000, 1)
    one = torch.ones(4000)
    seeds = torch.arange(4000, dtype=torch.long) * 7 + 1
    token, _ = sample(logits, one, one, torch.zeros(4000, dtype=torch.long), truncate=False,
                      seeds=seeds, steps=torch.full_like(seeds, 3))
    freq = torch.bincount(token, minlength=6).double() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.025, rtol=0)
