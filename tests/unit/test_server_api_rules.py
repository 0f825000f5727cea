"""The server's request rules and answer fields where its SGLang and OpenAI faces must agree: a
list of prompts on /v1/completions runs as /generate runs it (one batch: one length cap, a
seed's draws per prompt), a prompt's errors name it as the client sent it, versions carry the
label an update gave them on both faces, per-prompt return_logprob, OpenAI's message rules, a
byte piece's own bytes, and OpenAI-shaped 400s for bodies that do not parse.

A real server process (python -m fsdpfn.rollout) on a tiny model directory; the references are
the tokenizer itself and the request as sent.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from fsdpfn.rollout import launch_server
from fsdpfn.testing import write_tiny_hf_dir

TEXTS = ["What is 2+3? The answer is 5.", "Paris is the capital of France.",
         "café über naïve 日本語 ÿ", "one two three four five six seven"] * 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_dir(tmp_path_factory.mktemp("m") / "tiny", texts=TEXTS, seed=5)


@pytest.fixture(scope="module")
def server(model_dir):
    with launch_server(model_dir, dtype="float32", extra_args=("--no-channel",)) as srv:
        yield srv


@pytest.fixture(scope="module")
def context(model_dir):
    return json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]


def _post(server, path: str, body, *, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.timeout(120)
def test_a_list_of_prompts_runs_as_one_batch(server, context):
    short = [5, 6]
    long = [3 + i % 200 for i in range(context - 4)]  # leaves the model 4 positions
    status, out = _post(server, "/v1/completions", {
        "prompt": [short, long], "max_tokens": 50, "ignore_eos": True, "temperature": 1})
    assert status == 200, out
    # capped at what the longest prompt leaves, for every prompt, as /generate caps it
    assert [len(c["token_ids"]) for c in out["choices"]] == [4, 4]
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
    assert out["usage"]["prompt_tokens"] == len(short) + len(long)
    assert [c["prompt_token_ids"] for c in out["choices"]] == [short, long]


@pytest.mark.timeout(120)
def test_a_seed_draws_each_prompt_its_own_tokens(server):
    prompts = [[10, 11, 12], [40, 41, 42, 43]]
    ask = {"prompt": prompts, "seed": 5, "temperature": 1.0, "max_tokens": 12,
           "ignore_eos": True}
    _, first = _post(server, "/v1/completions", ask)
    _, again = _post(server, "/v1/completions", ask)
    ids = [c["token_ids"] for c in first["choices"]]
    assert ids == [c["token_ids"] for c in again["choices"]]  # reproducible
    # the two prompts' draws are not the same stream: their tails are not equal
    assert ids[0][4:] != ids[1][4:]
    _, sglang = _post(server, "/generate", {"input_ids": prompts, "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "seed": 5}})
    assert [o["output_ids"] for o in sglang] == ids  # the same batch as /generate's


@pytest.mark.timeout(60)
def test_a_bad_prompt_is_named_as_sent(server, context):
    status, out = _post(server, "/v1/completions", {
        "prompt": [[5, 6], [7, 8], [3 + i % 200 for i in range(context + 3)]], "max_tokens": 2})
    assert status == 400
    assert out["error"]["message"].startswith("prompt[2]: must be shorter than the model's "
                                              "context"), out
    assert out["error"]["param"] == "prompt[2]"


@pytest.mark.timeout(120)
def test_versions_carry_the_updates_label_on_both_faces(server, model_dir):
    status, out = _post(server, "/update_weights_from_disk",
                        {"model_path": str(model_dir), "weight_version": "step-3"})
    assert status == 200 and out["success"], out
    _, chat = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    _, comp = _post(server, "/v1/completions", {"prompt": "Paris", "max_tokens": 3})
    _, gen = _post(server, "/generate", {"text": "Paris", "sampling_params": {
        "max_new_tokens": 3}})
    assert gen["meta_info"]["weight_version"] == "step-3"
    assert chat["choices"][0]["weight_version"] == "step-3"
    assert comp["choices"][0]["weight_version"] == "step-3"


@pytest.mark.timeout(120)
def test_return_logprob_per_prompt(server):
    prompts = [[10, 11, 12], [20, 21]]
    base = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    for flags in ([True, False], [False, True]):
        status, out = _post(server, "/generate", {**base, "return_logprob": flags})
        assert status == 200
        assert ["output_token_logprobs" in o["meta_info"] for o in out] == flags
    status, out = _post(server, "/generate", {**base, "return_logprob": [True]})
    assert status == 400 and "return_logprob: a list must hold one value per prompt (2), " \
        "got 1" in out["message"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("messages, named", [
    ([{"role": "user"}], "messages[0].content: required for role 'user'"),
    ([{"role": "bogus", "content": "hi"}], "messages[0].role: must be one of"),
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": 5}],
     "messages[1].content: must be a string or a list of"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content: must be a string or a list of"),
    (["hi"], "messages[0]: must be an object"),
])
def test_chat_messages_follow_openais_rules(server, messages, named):
    status, out = _post(server, "/v1/chat/completions", {"messages": messages,
                                                         "max_tokens": 2})
    assert status == 400 and out["error"]["message"].startswith(named), out
    assert out["error"]["param"] == named.split(":")[0]


@pytest.mark.timeout(60)
def test_text_parts_are_their_texts_joined_and_tool_call_turns_need_no_content(server):
    def prompt(messages):
        status, out = _post(server, "/v1/chat/completions", {
            "messages": messages, "max_tokens": 1, "temperature": 0})
        assert status == 200, out
        return out["choices"][0]["prompt_token_ids"]

    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+3?"}]
    assert prompt([{"role": "user", "content": parts}]) == \
        prompt([{"role": "user", "content": "What is\n2+3?"}])
    # an assistant turn that only calls a tool has no content (null, as OpenAI's clients send)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    turns = [{"role": "user", "content": "What is 2+3?"},
             {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    assert len(prompt(turns)) > len(prompt(turns[:1]))
    status, out = _post(server, "/v1/chat/completions", {  # no content and no call: refused
        "messages": [turns[0], {"role": "assistant", "content": None}], "max_tokens": 1})
    assert status == 400 and out["error"]["param"] == "messages[1].content", out


@pytest.mark.timeout(60)
def test_stream_options_need_stream_and_bad_json_is_a_400(server):
    status, out = _post(server, "/v1/completions", {
        "prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}})
    assert status == 400 and out["error"]["param"] == "stream_options"
    assert "only with stream true" in out["error"]["message"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, out = _post(server, path, None, raw=b'{"prompt": "hi", ')
        assert status == 400 and set(out) == {"error"}, out
        assert out["error"]["message"].startswith("body: must be a JSON document")
    status, out = _post(server, "/generate", None, raw=b"{not json")
    assert status == 400 and out["success"] is False


@pytest.mark.timeout(60)
def test_each_choice_names_the_temperature_its_tokens_were_drawn_at(server):
    for temperature in (0.3, 1.0, 0):
        _, out = _post(server, "/v1/completions", {"prompt": "Paris", "max_tokens": 2,
                                                   "temperature": temperature})
        assert out["choices"][0]["temperature"] == temperature


def test_token_bytes_rebuild_the_text_byte_for_byte(model_dir):
    """OpenAI's ``bytes``: a token's own bytes, so byte pieces (part of a character, which
    decode alone to U+FFFD) join back into the text."""
    from fsdpfn.rollout.text import load_tokenizer

    text = load_tokenizer(model_dir)
    for s in ("café über naïve", "日本語 ÿ and €", "plain ascii"):
        ids = text.encode(s)
        pieces = [bytes(text.token_bytes(t)) for t in ids]
        assert b"".join(pieces) == s.encode(), (s, ids, pieces)
    pieces = [text.decode([t], skip_special_tokens=False) for t in text.encode("日本語")]
    assert "\ufffd" in "".join(pieces)  # the case this is about: byte pieces occur


USER = [{"role": "user", "content": "What is 2+3?"}]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path, body, param", [
    # a bool is not an int, a 1 not a bool: each is named, never a 500 or a silent "true"
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": True},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "hi", "echo": 0}, "echo"),
    ("/v1/chat/completions", {"messages": USER, "parallel_tool_calls": "no"},
     "parallel_tool_calls"),
    # values past what the draws take, and ids past the vocabulary: 400s, not overflows
    ("/v1/chat/completions", {"messages": USER, "seed": 2 ** 64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10 ** 30]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10 ** 6]}, "stop_token_ids"),
    # the empty stop string is not "no stop"
    ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop"),
    # bools are not token ids
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    # OpenAI's shapes of a tool turn
    ("/v1/chat/completions", {"messages": USER + [
        {"role": "assistant", "content": None, "tool_calls": "add(2, 3)"}]},
     "messages[1].tool_calls"),
    ("/v1/chat/completions", {"messages": USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": ""}}]}]},
     "messages[1].tool_calls[0]"),
    ("/v1/chat/completions", {"messages": USER + [{"role": "tool", "content": "5"}]},
     "messages[1].tool_call_id"),
])
def test_loose_values_are_refused_by_name(server, path, body, param):
    status, out = _post(server, path, {"max_tokens": 2, **body})
    assert status == 400 and out["error"]["param"] == param, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": USER, "stream": 1}),
    ("/v1/completions", {"prompt": "hi", "stream": "yes",
                         "stream_options": {"include_usage": True}}),
])
def test_a_stream_that_is_not_a_bool_is_named_by_its_rule(server, path, body):
    """Streaming is supported: a 1 is refused as not a bool, not as "not supported"."""
    status, out = _post(server, path, {"max_tokens": 2, **body})
    assert status == 400 and out["error"]["param"] == "stream", out
    assert out["error"]["message"].startswith("stream: must be null or a bool, got "), out


@pytest.mark.timeout(60)
def test_the_largest_seed_draws_and_a_generate_seed_past_it_is_named(server):
    status, out = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                    "seed": 2 ** 63 - 1})
    assert status == 200 and len(out["choices"][0]["token_ids"]) == 2, out
    status, out = _post(server, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 2, "sampling_seed": 2 ** 64}})
    assert status == 400 and "sampling_params.sampling_seed" in out["message"], out


@pytest.mark.timeout(60)
def test_a_request_of_more_rows_than_the_cap_is_refused_before_any_row_is_built(server):
    """prompts x n past the cap is a 400 naming n on both faces, answered at once (a billion
    rows would otherwise be built before the first token, taking the server's memory down);
    the server serves the next request."""
    from fsdpfn.rollout.engine import MAX_REQUEST_ROWS

    status, out = _post(server, "/generate", {"input_ids": [[1, 2], [3, 4]], "sampling_params": {
        "max_new_tokens": 2, "n": 10 ** 9}})
    assert status == 400 and "sampling_params.n" in out["message"], out
    assert f"<= {MAX_REQUEST_ROWS}, got 2 x {10 ** 9}" in out["message"], out
    status, out = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                    "n": MAX_REQUEST_ROWS + 1})
    assert status == 400 and out["error"]["param"] == "n", out
    status, out = _post(server, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 2, "n": 2}})
    assert status == 200 and len(out) == 2, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path, body, named", [
    ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"],
                                          "shapes": [[1]], "group_name": "nobody"},
     "no weights-update group 'nobody'"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1"},
     "master_port: required (init_weights_update_group takes master_address, master_port"),
])
def test_sglangs_group_endpoints_answer_a_refusal_400_as_sglang_does(server, path, body, named):
    """SGLang answers every refusal of these endpoints 400 {success: false, message}; its
    clients test for that status (an unknown group was a 404 here)."""
    status, out = _post(server, path, body)
    assert status == 400 and out["success"] is False and named in out["message"], out


@pytest.mark.timeout(120)
def test_a_port_taken_before_the_server_binds_it_is_chosen_again(model_dir, monkeypatch):
    """Another process may take the free port launch_server chose before the server binds it
    (a clean-clone CI run lost a test to that race): the server is started on another."""
    import socket

    from fsdpfn.rollout import process

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = process.free_port
    monkeypatch.setattr(process, "free_port", lambda: ports.pop() if ports else real())
    try:
        with launch_server(model_dir, dtype="float32", extra_args=("--no-channel",)) as srv:
            assert srv.status("/health") == 200
            assert not srv.url.endswith(f":{taken.getsockname()[1]}")
    finally:
        taken.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body, named", [
    ({"input_ids": [[1, 2, 3]], "temperature": "hot"}, "temperature: must be a finite number"),
    ({"input_ids": [[1, 2, 3]], "temperature": 1e400}, "temperature: must be a finite number"),
    ({"input_ids": [[1, 2, 3]], "temperature": 0}, "temperature: must be a finite number"),
    ({"input_ids": [[1, 2, 3]], "temperature": 1e-7},
     "temperature: must be a finite number >= 1e-06"),
    ({"input_ids": [[1, 2, 3]], "temperature": True}, "temperature: must be a finite number"),
    ({"input_ids": [[1, 2, 3]], "return_logits": "false"}, "return_logits: must be a bool"),
    ({"input_ids": [[1, 2, 3]] * 65_537}, "input_ids: at most 65536 rows a request"),
])
def test_forward_refuses_a_bad_field_with_a_400_naming_it(server, body, named):
    """/forward's fields are read as sent: a string temperature was a 500, an infinite one
    scored every token uniformly and a "false" return_logits returned the logits."""
    status, out = _post(server, "/forward", body)
    assert status == 400 and named in out["message"], out
    status, out = _post(server, "/forward", {"input_ids": [[1, 2, 3]], "temperature": 2})
    assert status == 200 and out["token_logprobs"][0][0] == 0.0 and "logits" not in out, out


@pytest.mark.timeout(60)
def test_forward_refuses_a_row_longer_than_the_context(server, context):
    status, out = _post(server, "/forward", {"input_ids": [[1, 2], [4] * (context + 1)]})
    assert status == 400 and "input_ids[1]: must fit the model's context" in out["message"], out
    status, out = _post(server, "/forward", {"input_ids": [[4] * context]})
    assert status == 200 and len(out["token_logprobs"][0]) == context, out
