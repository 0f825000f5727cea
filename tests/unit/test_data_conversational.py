"""TRL's conversational dataset formats, as the hub's SFT and preference datasets come:
- prompt-completion: ``{"prompt": [turns], "completion": [assistant turns]}`` (sft, with
  data.response_key: completion), the loss on the completion's assistant turns only;
- preference with an explicit prompt: ``{"prompt": [turns], "chosen": [turns], "rejected":
  [turns]}`` (rw, dpo);
- preference with an implicit prompt: ``{"chosen": [whole conversation], "rejected": [...]}``,
  the prompt being the turns the two share.

Each is held against a format the recipes already read (a messages row, a string pair through
the chat template), and the trained tokens against the text the tokenizer itself decodes them
to."""

from __future__ import annotations

import json

import pytest

from fsdpfn.app.recipes.data import DataConfig, prepare_files
from fsdpfn.errors import ConfigError

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from fsdpfn.testing.hf_dir import write_tiny_hf_dir

    return write_tiny_hf_dir(tmp_path_factory.mktemp("tok"), weights=False,
                             texts=["What is 1+2? 3", "What is 7+2? 9", "Say hi. hi there"])


@pytest.fixture(scope="module")
def tok(tok_dir):
    from fsdpfn.app.recipes.model import HFTokenizer

    return HFTokenizer(tok_dir)


def _prepared(tmp_path, tok, recipe: str, rows: list[dict], **data) -> list[dict]:
    f = tmp_path / f"{len(list(tmp_path.iterdir()))}.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"out_{f.stem}"
    prepare_files(DataConfig(train_files=(str(f),), **data), tok, recipe, out)
    return [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]


def _trained_text(tok_dir, ids, loss) -> list[str]:
    """The text of each run of trained tokens, as the tokenizer itself decodes it."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    runs, cur = [], []
    for i, on in zip(ids, loss):
        if on:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return [hf.decode(r) for r in runs + ([cur] if cur else [])]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_a_conversational_completion_trains_its_own_turns_as_a_messages_row_would(
        tmp_path, tok, tok_dir):
    one = _prepared(tmp_path, tok, "sft", [{"prompt": [user("What is 1+2?")],
                                            "completion": [assistant("3")]}],
                    response_key="completion")[0]
    same = _prepared(tmp_path, tok, "sft", [{"messages": [user("What is 1+2?"),
                                                          assistant("3")]}])[0]
    assert (one["ids"], one["loss"]) == (same["ids"], same["loss"])
    assert _trained_text(tok_dir, one["ids"], one["loss"]) == ["3" + END]
    # a prompt with an assistant turn of its own: that turn is context, not trained on
    turns = [user("What is 7+2?"), assistant("8"), user("Again?")]
    multi = _prepared(tmp_path, tok, "sft", [{"prompt": turns, "completion": [assistant("9")]}],
                      response_key="completion")[0]
    whole = _prepared(tmp_path, tok, "sft", [{"messages": [*turns, assistant("9")]}])[0]
    assert multi["ids"] == whole["ids"]
    assert _trained_text(tok_dir, multi["ids"], multi["loss"]) == ["9" + END]
    assert _trained_text(tok_dir, whole["ids"], whole["loss"]) == ["8" + END, "9" + END]
    # a string prompt before a conversational completion goes through the template too
    mixed = _prepared(tmp_path, tok, "sft", [{"prompt": "What is 1+2?",
                                              "completion": [assistant("3")]}],
                      response_key="completion")[0]
    assert (mixed["ids"], mixed["loss"]) == (same["ids"], same["loss"])


@pytest.mark.parametrize("recipe", ["dpo", "rw"])
def test_preference_pairs_explicit_and_implicit_equal_the_templated_string_pair(
        tmp_path, tok, tok_dir, recipe):
    strings = _prepared(tmp_path, tok, recipe, [{"prompt": "Say hi.", "chosen": "hi there",
                                                 "rejected": "no"}], chat_template=True)[0]
    explicit = _prepared(tmp_path, tok, recipe, [{
        "prompt": [user("Say hi.")], "chosen": [assistant("hi there")],
        "rejected": [assistant("no")]}])[0]
    implicit = _prepared(tmp_path, tok, recipe, [{
        "chosen": [user("Say hi."), assistant("hi there")],
        "rejected": [user("Say hi."), assistant("no")]}])[0]
    for side in ("chosen", "rejected"):
        assert explicit[side] == strings[side] == implicit[side], side
    ids, loss = implicit["chosen"]
    assert _trained_text(tok_dir, ids, loss) == ["hi there" + END]
    # several shared turns make the prompt; the responses are what follows them
    shared = [user("What is 7+2?"), assistant("9"), user("And 1+2?")]
    long = _prepared(tmp_path, tok, recipe, [{"chosen": [*shared, assistant("3")],
                                              "rejected": [*shared, assistant("4")]}])[0]
    assert _trained_text(tok_dir, *long["chosen"]) == ["3" + END]
    assert _trained_text(tok_dir, *long["rejected"]) == ["4" + END]


@pytest.mark.parametrize("recipe, row, key, why", [
    ("sft", {"prompt": [user("hi")], "completion": [user("hello")]}, "response_key",
     "column 'completion' (data.response_key) must be a non-blank string, or chat messages "
     "with an assistant turn (a conversational completion: the turns after the prompt), got "
     "array"),
    ("dpo", {"chosen": [user("a"), assistant("b")], "rejected": [user("c"), assistant("d")]},
     None, "columns 'chosen' (data.chosen_key) and 'rejected' (data.rejected_key) must be chat "
     "messages, the whole conversation (without a prompt column, each side is its prompt's "
     "turns then its response's, and the two share the prompt), with an assistant turn after "
     "it on each side (or the rows need the prompt column data.prompt_key names), got array"),
    ("rw", {"chosen": "b", "rejected": "d"}, None,
     "columns 'chosen' (data.chosen_key) and 'rejected' (data.rejected_key) must be chat "
     "messages, the whole conversation"),
])
def test_a_conversation_the_formats_do_not_allow_is_refused_by_name(tmp_path, tok, recipe,
                                                                    row, key, why):
    with pytest.raises(ConfigError) as err:
        _prepared(tmp_path, tok, recipe, [row],
                  **({key: "completion"} if key else {}))
    assert why in str(err.value) and "line 1" in str(err.value), str(err.value)


def test_prompt_completion_rows_without_the_key_name_it(tmp_path, tok):
    with pytest.raises(ConfigError) as err:
        _prepared(tmp_path, tok, "sft", [{"prompt": "hi", "completion": "hello"}])
    assert str(err.value).endswith("(prompt-completion rows, as TRL writes them: "
                                   "data.response_key: completion)"), str(err.value)


def test_plain_text_rows_train_on_every_token_after_the_first(tmp_path, tok, tok_dir):
    """TRL's standard language-modeling format, {"text": ...} (continued pretraining): the
    text as the tokenizer itself encodes it (its BOS, if it adds one) and a stop token, every
    token trained on but the first."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_dir)
    text = "What is 7+2? 9"
    row = _prepared(tmp_path, tok, "sft", [{"text": text}])[0]
    want = hf(text)["input_ids"] + [hf.convert_tokens_to_ids("<|endoftext|>")]
    assert row["ids"] == want
    assert row["loss"] == [False] + [True] * (len(want) - 1)
    renamed = _prepared(tmp_path, tok, "sft", [{"body": text}], text_key="body")[0]
    assert renamed["ids"] == want
    with pytest.raises(ConfigError) as err:
        _prepared(tmp_path, tok, "sft", [{"text": "  "}])
    assert "column 'text' (data.text_key) must be a non-blank string" in str(err.value)


def test_a_row_the_chat_template_or_tokenizer_refuses_is_named_not_a_traceback(tmp_path,
                                                                               tok_dir):
    """A template that raises on a row (raise_exception: no system role, roles that must
    alternate), and a lone surrogate the tokenizer cannot encode, leaked jinja2's or tokenizers'
    exception from the data preparation, naming neither the file nor the line."""
    import shutil

    from fsdpfn.app.recipes.model import HFTokenizer

    strict = tmp_path / "strict"
    shutil.copytree(tok_dir, strict)
    (strict / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rows = [{"prompt": [user("What is 1+2?")], "answer": "3"},
            {"prompt": [{"role": "system", "content": "Be brief."}, user("What is 7+2?")],
             "answer": "9"}]
    with pytest.raises(ConfigError, match=r"^data\.train_files: '.*\.jsonl' line 2: the "
                                          r"tokenizer of '.*strict' or its chat template cannot "
                                          r"tokenize this row \(TemplateError: System role not "
                                          r"supported\)$"):
        _prepared(tmp_path, HFTokenizer(strict), "grpo", rows)
    f = tmp_path / "surrogate.jsonl"
    f.write_text('{"prompt": "What is 1+2?", "answer": "3"}\n'
                 '{"prompt": "What is 7+2? \\ud800", "answer": "9"}\n')
    with pytest.raises(ConfigError, match=r"^data\.train_files: '.*surrogate\.jsonl' line 2: "
                                          r"the tokenizer of .* cannot tokenize this row"):
        prepare_files(DataConfig(train_files=(str(f),)), HFTokenizer(tok_dir), "grpo",
                      tmp_path / "out_surrogate")
