"""Tools in chat completions: the model's own template renders them, its own format is read back;
what cannot be served is refused by name.

References: the tokenizer's own apply_chat_template (the rendered prompt), literal answers in each
family's documented call format (the parser).
"""

from __future__ import annotations

import json

import pytest

from fsdpfn.rollout import RolloutEngine, UpdateError
from fsdpfn.rollout import openai_api
from fsdpfn.rollout.tool_calls import parse_tool_calls, tool_format
from fsdpfn.testing import write_tiny_hf_dir
from fsdpfn.testing.hf_dir import TOOLS_CHAT_TEMPLATE

HERMES_TEMPLATE = TOOLS_CHAT_TEMPLATE
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"},
                                               "b": {"type": "integer"}}}}}]
TEXTS = ["what is two plus two", "the tool said four", "call add with two and two"] * 10


def _call(name, args):
    return {"name": name, "arguments": args}


@pytest.mark.parametrize("text, fmt, content, calls", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>', "hermes",
     None, [_call("add", {"a": 2, "b": 2})]),
    ('Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
     '<tool_call>{"name": "neg", "arguments": {"x": 3}}</tool_call>', "hermes", "Let me add.",
     [_call("add", {"a": 1}), _call("neg", {"x": 3})]),
    ('<tool_call>{"name": "add", "arguments": {"a": </tool_call>', "hermes",
     '<tool_call>{"name": "add", "arguments": {"a": </tool_call>', []),     # malformed: text
    ("no call here", "hermes", "no call here", []),
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 2}}]', "mistral", None,
     [_call("add", {"a": 2})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 5}}', "llama3_json", None,
     [_call("add", {"a": 2, "b": 5})]),
    ('The answer is {"x": 1}', "llama3_json", 'The answer is {"x": 1}', []),
])
def test_each_format_is_read_back_into_openai_tool_calls(text, fmt, content, calls):
    got_content, got = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
            for c in got] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got)


def test_the_format_comes_from_the_template():
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert tool_format("{% for t in tools %}[TOOL_CALLS]{% endfor %}") == "mistral"
    assert tool_format('{% if tools %}"parameters"{% endif %}<|python_tag|>') == "llama3_json"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_format(None) is None


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    plain = write_tiny_hf_dir(tmp_path_factory.mktemp("t") / "plain", texts=TEXTS, seed=1)
    tools = write_tiny_hf_dir(tmp_path_factory.mktemp("t") / "tools", texts=TEXTS, seed=1)
    (tools / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return RolloutEngine(str(plain), dtype="float32"), RolloutEngine(str(tools), dtype="float32")


def test_tools_are_rendered_by_the_models_template_and_history_calls_read_as_objects(engines):
    _, engine = engines
    messages = [{"role": "user", "content": "what is two plus two"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    answer = openai_api.chat_completions(engine, {"messages": messages, "tools": TOOLS,
                                                  "max_tokens": 3, "seed": 0})
    tok = engine.tokenizer.tok
    history = [dict(m) for m in messages]
    history[1] = {**history[1], "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "add", "arguments": {"a": 2, "b": 2}}}]}
    rendered = tok.apply_chat_template(history, tools=TOOLS, tokenize=False,
                                       add_generation_prompt=True)
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)
    assert '"a": 2' in rendered and "<tools>" in rendered  # the call as an object, the tools
    assert choice["message"]["role"] == "assistant"
    # three tokens of a random model: "length" when all three came, "stop" when it ended
    # sooner (a tool call cannot be complete in three tokens)
    assert choice["finish_reason"] == ("length" if len(choice["token_ids"]) == 3 else "stop")


def test_what_cannot_be_served_is_refused_by_name(engines):
    plain, engine = engines
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for eng, extra, words in ((plain, {"tools": TOOLS}, "tools: the chat template"),
                              (engine, {"tools": TOOLS, "tool_choice": "required"},
                               "tool_choice: only 'auto' and 'none'"),
                              (engine, {"tools": [{"type": "web"}]}, "tools: must be a list"),
                              (engine, {"tools": TOOLS, "tool_choice": {
                                  "type": "function", "function": {"name": "add"}}},
                               "tool_choice")):
        with pytest.raises(UpdateError, match=words):
            openai_api.chat_completions(eng, {**ask, **extra})
    with pytest.raises(UpdateError, match="stream: must be null or a bool, got 'yes'"):
        openai_api.completions(engine, {"prompt": "hi", "stream": "yes"})


def test_a_streamed_answer_is_openais_chunks_with_fsdpfns_fields_on_the_last(engines):
    _, engine = engines
    answer = openai_api.chat_completions(engine, {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 4, "n": 2, "stream": True,
                                                  "logprobs": True})
    events = openai_api.chat_chunks(answer, include_usage=True)
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"] == answer["usage"] and chunks[-1]["choices"] == []
    for i, choice in enumerate(answer["choices"]):
        first, last = chunks[2 * i]["choices"][0], chunks[2 * i + 1]["choices"][0]
        assert first["delta"]["content"] == choice["message"]["content"]
        assert last["finish_reason"] == choice["finish_reason"]
        assert last["token_ids"] == choice["token_ids"] and "prompt_token_ids" in last


def _answer(engine, text: str, *, eos: bool) -> dict:
    """A choice as the engine gives it: the text's tokens, then the eos it stopped at."""
    ids = engine.tokenizer.encode(text)
    stop = engine.eos_ids[0]
    return {"output_ids": ids + [stop] * eos, "output_logprobs": [-1.0] * (len(ids) + eos),
            "finish_reason": "stop" if eos else "length", "matched": stop if eos else None}


@pytest.mark.parametrize("eos", [True, False], ids=["stopped-at-eos", "cut-by-length"])
def test_a_mistral_call_is_read_back_when_the_answer_ends_with_its_eos(engines, eos):
    """The mistral format is read with special tokens kept ([TOOL_CALLS]); the eos a finished
    answer carries is not part of the call (it once made every finished call plain text)."""
    _, engine = engines
    o = _answer(engine, '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2}}]', eos=eos)
    sp = openai_api.SamplingParams(max_new_tokens=64)
    message = openai_api._message(engine, o, sp, "mistral")
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"a": 2}]
    assert message["tool_calls"][0]["function"]["name"] == "add"


def test_parallel_tool_calls_false_keeps_the_first_call(engines, monkeypatch):
    """Two hermes calls in one answer: both by default, the first with parallel_tool_calls
    false (vLLM's rule), the tokens unchanged."""
    _, engine = engines
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
    o = _answer(engine, text, eos=True)

    def generate(prompts, sp, top_logprobs=0, rid=None):  # RolloutEngine.generate's
        return {"weight_version": 0, "outputs": [{**o, "prompt_index": 0,
                                                  "weight_versions": [0] * len(o["output_ids"])}]}

    monkeypatch.setattr(engine, "generate", generate)  # the answer above, as if sampled
    ask = {"messages": [{"role": "user", "content": "add"}], "tools": TOOLS, "max_tokens": 64}
    both = openai_api.chat_completions(engine, ask)["choices"][0]
    one = openai_api.chat_completions(engine, {**ask, "parallel_tool_calls": False})["choices"][0]
    assert [c["function"]["arguments"] for c in both["message"]["tool_calls"]] == \
        ['{"a": 1}', '{"a": 2}']
    assert [c["function"]["arguments"] for c in one["message"]["tool_calls"]] == ['{"a": 1}']
    assert one["finish_reason"] == "tool_calls" and one["token_ids"] == both["token_ids"]
