"""A bad data file or row is refused with one ConfigError line naming the config key, the file,
the line (JSON lines and CSV, from 1) or row (Parquet, JSON arrays, from 0), the column with
its key, the rule and the value, before anything is tokenized or written
(fsdpfn.app.recipes.data_rows).

The refusals run prepare_files with no tokenizer at all (``tok=None``): any tokenization would
fail with an AttributeError instead of the ConfigError expected. Where a file is accepted, the
prepared prompts are compared with the tokenizer's own ids of the text written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes.data import DataConfig, prepare_files

GOOD = {"prompt": "What is 1+2?", "answer": "3", "response": "3", "chosen": "3",
        "rejected": "4", "messages": [{"role": "user", "content": "1+2?"},
                                      {"role": "assistant", "content": "3"}]}


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _refused(tmp_path: Path, recipe: str = "grpo", **data) -> str:
    """prepare_files' ConfigError message, without a tokenizer; nothing written."""
    out = tmp_path / "prepared"
    with pytest.raises(ConfigError) as info:
        prepare_files(DataConfig(**data), None, recipe, out)
    message = str(info.value)
    assert "\n" not in message and not out.exists(), message
    return message


def _with(**change) -> dict:
    row = dict(GOOD, **change)
    return {k: v for k, v in row.items() if v is not _MISSING}


_MISSING = object()


# ---------------------------------------------------------------- values of the columns read


@pytest.mark.parametrize("value, got", [
    (_MISSING, "got no such key in the row"),
    (None, "got null"),
    (7, "got number 7"),
    ("  ", "got an empty string '  '"),
    ([{"role": "user"}], "got array [{'role': 'user'}]"),
])
def test_a_bad_prompt_names_file_line_column_key_and_value(tmp_path, value, got):
    f = _jsonl(tmp_path / "train.jsonl", [GOOD, GOOD, _with(prompt=value), GOOD])
    message = _refused(tmp_path, train_files=(f,))
    assert message == (f"data.train_files: {f!r} line 3: column 'prompt' (data.prompt_key) must "
                       f"be a non-empty string or chat messages [{{role, content}}], {got}")


def test_a_custom_column_name_is_named_with_its_key_and_other_bad_rows_are_counted(tmp_path):
    rows = [{"question": "q"}, {"question": None}, {"question": 1}, {"question": "q"},
            {"question": False}]
    f = _jsonl(tmp_path / "train.jsonl", rows)
    message = _refused(tmp_path, train_files=(f,), prompt_key="question")
    assert message.startswith(f"data.train_files: {f!r} line 2: column 'question' "
                              f"(data.prompt_key) must be")
    assert message.endswith("got null (and 2 more bad rows)")


# a response: a string, or a conversational completion's turns (TRL's formats)
COMPLETION = ("a non-blank string, or chat messages with an assistant turn (a conversational "
              "completion: the turns after the prompt)")


@pytest.mark.parametrize("recipe, row, column, key, rule, got", [
    ("grpo", _with(answer=None), "answer", "answer_key", "present (not null) in every row",
     "null"),
    ("sft", _with(response=3), "response", "response_key", COMPLETION, "number 3"),
    ("sft", _with(response=" \n"), "response", "response_key", COMPLETION,
     "an empty string ' \\n'"),
    ("dpo", _with(chosen=None), "chosen", "chosen_key", COMPLETION, "null"),
    ("dpo", _with(rejected=""), "rejected", "rejected_key", COMPLETION,
     "an empty string ''"),
    ("rw", _with(rejected=_MISSING), "rejected", "rejected_key", COMPLETION,
     "no such key in the row"),
])
def test_every_column_a_recipe_reads_is_checked(tmp_path, recipe, row, column, key, rule, got):
    f = _jsonl(tmp_path / "train.jsonl", [GOOD, row])
    assert _refused(tmp_path, recipe, train_files=(f,)) == (
        f"data.train_files: {f!r} line 2: column {column!r} (data.{key}) must be {rule}, "
        f"got {got}")


def test_a_pair_of_equal_responses_is_refused(tmp_path):
    row = {**GOOD, "chosen": "same", "rejected": "same"}
    f = _jsonl(tmp_path / "train.jsonl", [GOOD, row])
    assert _refused(tmp_path, "dpo", train_files=(f,)) == (
        f"data.train_files: {f!r} line 2: columns 'chosen' (data.chosen_key) and 'rejected' "
        f"(data.rejected_key) must differ (a pair of equal responses prefers nothing), got "
        f"string 'same' twice")


@pytest.mark.parametrize("recipe, messages, rule_end", [
    ("sft", [{"role": "user", "content": "hi"}], "with at least one assistant turn (the loss "
                                                 "is on them)"),
    ("sft", [{"role": "user", "content": None}], "content: string}"),
    ("sft", [], "content: string}"),
    ("sft", "hello", "content: string}"),
    ("grpo", [{"role": "assistant", "content": "3"}], "with a turn before the last assistant "
                                                     "turns"),
])
def test_chat_messages_are_checked(tmp_path, recipe, messages, rule_end):
    rows = [{"messages": GOOD["messages"]}, {"messages": messages}]
    f = _jsonl(tmp_path / "chat.jsonl", rows)
    message = _refused(tmp_path, recipe, train_files=(f,))
    assert message.startswith(f"data.train_files: {f!r} line 2: column 'messages' "
                              f"(data.messages_key) must be chat messages: a non-empty list of")
    assert f"{rule_end}, got " in message


# ---------------------------------------------------------------- files that cannot be rows


def test_a_file_that_is_not_utf8_names_the_byte_its_offset_and_line(tmp_path):
    f = tmp_path / "latin1.jsonl"
    head = (json.dumps(GOOD) + "\n").encode()
    f.write_bytes(head + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    offset = len(head) + len('{"prompt": "caf')
    message = _refused(tmp_path, train_files=(str(f),))
    assert message.startswith(f"data.train_files: {str(f)!r} is not UTF-8 text: byte 0xe9 at "
                              f"offset {offset} (line 2)")


def test_a_malformed_json_line_names_its_line_and_the_json_error(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps(GOOD) + "\n\n" + '{"prompt": "a",}\n')
    message = _refused(tmp_path, train_files=(str(f),))
    # the parser's reason is Python's own (its wording changes between versions)
    assert message.startswith(f"data.train_files: {str(f)!r} line 3: not valid JSON (")
    assert message.endswith(" at column 16)"), message


def test_a_line_cut_short_reads_once_where_its_string_starts(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + '{"prompt": "What is\n')  # an export cut off
    message = _refused(tmp_path, train_files=(str(f),))
    assert message.startswith(f"data.train_files: {str(f)!r} line 2: not valid JSON (")
    assert message.endswith(" at column 12)") and " at at " not in message, message


def test_a_row_that_is_not_an_object_is_refused(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + '["What is 1+2?", "3"]\n')
    assert _refused(tmp_path, train_files=(str(f),)) == (
        f"data.train_files: {str(f)!r} line 2: must be an object {{column: value}}, got array "
        f"['What is 1+2?', '3']")


@pytest.mark.parametrize("content", ["", "\n \n", "[]"])
def test_an_empty_file_is_refused(tmp_path, content):
    f = tmp_path / "empty.json"
    f.write_text(content)
    assert _refused(tmp_path, train_files=(str(f),)) == (
        f"data.train_files: {str(f)!r} is empty: it has no rows")


def test_a_missing_file_and_a_bad_eval_file_fail_before_anything_is_written(tmp_path):
    good = _jsonl(tmp_path / "train.jsonl", [GOOD])
    missing = str(tmp_path / "nope.jsonl")
    assert _refused(tmp_path, eval_files=(missing,), train_files=(good,)) == (
        f"data.eval_files: file does not exist, got {missing!r}")
    bad = _jsonl(tmp_path / "eval.jsonl", [GOOD, GOOD, {"prompt": None}])
    assert _refused(tmp_path, train_files=(good,), eval_files=(bad,)).startswith(
        f"data.eval_files: {bad!r} line 3: column 'prompt'")


def test_the_second_file_is_named_with_its_own_line(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [GOOD] * 5)
    b = _jsonl(tmp_path / "b.jsonl", [GOOD, {"prompt": 2}])
    assert _refused(tmp_path, train_files=(a, b)).startswith(
        f"data.train_files: {b!r} line 2: column 'prompt'")


def test_a_json_array_and_parquet_name_the_row_index(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow (fsdpfn reads Parquet with it) is missing")
    import pyarrow.parquet as pq

    arr = tmp_path / "train.json"
    arr.write_text(json.dumps([GOOD, GOOD, {"prompt": None}]))
    assert _refused(tmp_path, train_files=(str(arr),)).startswith(
        f"data.train_files: {str(arr)!r} row 2: column 'prompt' (data.prompt_key) must be")
    pq.write_table(pa.table({"prompt": ["a", "b", None, "d"]}), tmp_path / "train.parquet")
    f = str(tmp_path / "train.parquet")
    assert _refused(tmp_path, train_files=(f,)).endswith(
        f"{f!r} row 2: column 'prompt' (data.prompt_key) must be a non-empty string or chat "
        f"messages [{{role, content}}], got null")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1" + os.urandom(64))
    assert _refused(tmp_path, train_files=(str(broken),)).startswith(
        f"data.train_files: {str(broken)!r} cannot be read as Parquet (")


# ---------------------------------------------------------------- what is accepted


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from fsdpfn.app.recipes.model import HFTokenizer
    from fsdpfn.testing.hf_dir import write_tiny_hf_dir

    path = write_tiny_hf_dir(tmp_path_factory.mktemp("tok"), weights=False,
                             texts=["What is 1+2? 3", "caf\u00e9 \u2028 line"])
    return HFTokenizer(path)


def test_good_rows_are_read_exactly_in_every_accepted_shape(tmp_path, tok):
    """A BOM, blank lines, CRLF, U+2028 inside a string, a JSON array, a row without the
    optional column: all rows are kept, in order, each prompt tokenized as written."""
    rows = [{"prompt": "What is 1+2?", "answer": "3"}, {"prompt": "caf\u00e9 \u2028 line",
                                                        "answer": 4, "extra": [1]}]
    lines = tmp_path / "a.jsonl"
    lines.write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(json.dumps(r, ensure_ascii=False).encode()
                                                     for r in rows) + b"\r\n\r\n")
    arr = tmp_path / "b.json"
    arr.write_text(json.dumps(rows[::-1]))
    report = prepare_files(DataConfig(train_files=(str(lines), str(arr))), tok, "grpo",
                           tmp_path / "out")
    assert report["train"] == {"rows": 4, "kept": 4, "dropped": {}}
    got = [json.loads(x) for x in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    want = rows + rows[::-1]
    assert [g["prompt"] for g in got] == [w["prompt"] for w in want]
    assert [g["prompt_ids"] for g in got] == [tok.prompt_ids(w["prompt"]) for w in want]
    assert [g["answer"] for g in got] == [w["answer"] for w in want]
    # every row carries every column, None where it had none (the reward's ``sample``)
    assert got[0]["sample"] == {"prompt": "What is 1+2?", "answer": "3", "extra": None}


def test_rows_over_the_token_limits_are_still_dropped_and_counted(tmp_path, tok):
    long = {"prompt": "What is " + "1+" * 100 + "2?", "answer": "x"}
    f = _jsonl(tmp_path / "train.jsonl", [GOOD, long, GOOD])
    report = prepare_files(DataConfig(train_files=(f,), max_prompt_tokens=32), tok, "grpo",
                           tmp_path / "out")
    assert report["train"] == {"rows": 3, "kept": 2,
                               "dropped": {"prompt over max_prompt_tokens": 1}}


# ---------------------------------------------------------------- the command line


@pytest.mark.timeout(120)
def test_fsdpfn_run_prints_one_line_and_exits_2_before_launching(tmp_path):
    from fsdpfn.testing.hf_dir import write_tiny_hf_dir

    model = write_tiny_hf_dir(tmp_path / "model", texts=["What is 1+2? 3"])
    train = _jsonl(tmp_path / "train.jsonl", [GOOD, GOOD, _with(prompt=None)])
    cfg = {"recipe": "sft", "steps": 1, "model": {"path": str(model)},
           "data": {"train_files": [train], "max_prompt_tokens": 64, "max_response_tokens": 8},
           "launch": {"nproc": 1}}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "fsdpfn", "run", str(tmp_path / "sft.yaml"),
                           f"run_dir={run_dir}"], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"fsdpfn: error: data.train_files: {train!r} line 3: column 'prompt' (data.prompt_key) "
        f"must be a non-empty string or chat messages [{{role, content}}], got null"]
    assert proc.stdout == ""
    launched = ("run_state.json", "config.yaml", "rollout.log", "metrics.jsonl", "data")
    assert not any((run_dir / name).exists() for name in launched)


def test_a_pretty_printed_object_is_named_as_such(tmp_path):
    f = tmp_path / "train.json"
    f.write_text(json.dumps({"prompt": "1+2?", "response": "3"}, indent=2))
    message = _refused(tmp_path, "sft", train_files=(str(f),))
    assert message.startswith(f"data.train_files: {str(f)!r} line 1: not valid JSON")
    assert message.endswith("it holds one JSON object over several lines: write one object a "
                            "line (JSON lines) or an array of objects")


def test_no_sample_within_the_limits_names_the_shortest_part_dropped(tmp_path, tok):
    """When every row is dropped, the error names, per reason, how many tokens the shortest
    dropped part has: the limit a run would need (counted as the data is prepared)."""
    rows = [{"prompt": "What is " + "1+" * n + "2?", "answer": "x"} for n in (20, 9, 30)]
    f = _jsonl(tmp_path / "train.jsonl", rows)
    shortest = min(len(tok.prompt_ids(r["prompt"])) for r in rows)
    with pytest.raises(ConfigError) as info:
        prepare_files(DataConfig(train_files=(f,), max_prompt_tokens=shortest - 1), tok, "grpo",
                      tmp_path / "out")
    assert str(info.value).endswith(
        f"dropped {{'prompt over max_prompt_tokens': 3}}; the shortest prompt dropped has "
        f"{shortest} tokens (data.max_prompt_tokens)"), str(info.value)
    report = prepare_files(DataConfig(train_files=(f,), max_prompt_tokens=shortest), tok, "grpo",
                           tmp_path / "out")
    assert report["train"]["kept"] == 1


def test_a_source_read_an_epoch_apart_by_two_threads_shuffles_each_epoch_once(tmp_path,
                                                                              monkeypatch):
    """A RolloutStream reads prompts of the next epoch while the step reads its rows of this one:
    the takes alternate between epochs, and each epoch's permutation is drawn once (it used to
    be drawn again at every switch, O(rows) each), the same permutation as a fresh source's."""
    import random

    from fsdpfn.app.recipes import data as data_mod

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(20)))
    fresh = [[x["i"] for x in data_mod.FileSource(path, seed=3, shuffle=True).take(e * 20, 20)]
             for e in range(3)]
    draws = []

    class Counted(random.Random):
        def shuffle(self, x):
            draws.append(len(x))
            return super().shuffle(x)

    monkeypatch.setattr(data_mod.random, "Random", Counted)
    src = data_mod.FileSource(path, seed=3, shuffle=True)
    for e in (0, 1, 0, 1, 2, 1):
        assert [x["i"] for x in src.take(e * 20 + 5, 10)] == fresh[e][5:15]
    assert len(draws) == 3, draws
    assert sorted(fresh[0]) == list(range(20)) and fresh[0] != fresh[1]


# ---------------------------------------------------------------- CSV and TSV files
# The first line names the columns and every value is the text written; a bad row is named by
# the line it starts on. Accepted files are compared with the rows written, parsed here by
# hand, not with the csv module the reader uses.


def _prepared(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]


def test_quoted_cells_line_breaks_and_text_as_written_are_read_exactly(tmp_path, tok):
    """A BOM, CRLF line ends, a blank line, a quoted comma, doubled quotes and a line break in
    a quoted cell; '007' stays the text '007', an extra column rides along in ``sample``."""
    raw = ('\ufeffprompt,answer,source\r\n'
           '"What is 1,2? ""quoted""",007,a\r\n'
           '\r\n'
           '"two\r\nlines",12,b\r\n'
           'caf\u00e9 3,1/2,\r\n')
    f = tmp_path / "train.csv"
    f.write_bytes(raw.encode("utf-8"))
    report = prepare_files(DataConfig(train_files=(str(f),)), tok, "grpo", tmp_path / "out")
    assert report["train"] == {"rows": 3, "kept": 3, "dropped": {}}
    got = _prepared(tmp_path / "out")
    prompts = ['What is 1,2? "quoted"', "two\r\nlines", "caf\u00e9 3"]
    assert [g["prompt"] for g in got] == prompts
    assert [g["prompt_ids"] for g in got] == [tok.prompt_ids(p) for p in prompts]
    assert [g["answer"] for g in got] == ["007", "12", "1/2"]
    assert got[2]["sample"] == {"prompt": "caf\u00e9 3", "answer": "1/2", "source": ""}


def test_a_tsv_file_splits_on_tabs_only(tmp_path, tok):
    f = tmp_path / "train.tsv"
    f.write_text("prompt\tresponse\nWhat is 1,2? \"quoted\"\t3, or 4\n", encoding="utf-8")
    prepare_files(DataConfig(train_files=(str(f),)), tok, "sft", tmp_path / "out")
    (row,) = _prepared(tmp_path / "out")
    assert row["sample"] == {"prompt": 'What is 1,2? "quoted"', "response": "3, or 4"}
    assert sum(row["loss"]) > 0 and len(row["ids"]) == len(row["loss"])


def test_a_row_with_too_few_or_many_cells_names_the_line_it_starts_on(tmp_path):
    f = tmp_path / "train.csv"
    # the row on line 2 spans lines 2 and 3, so the bad row starts on line 4
    f.write_text('prompt,answer\n"a\nb",1\nc\nd,2\n', encoding="utf-8")
    assert _refused(tmp_path, train_files=(str(f),)) == (
        f"data.train_files: {str(f)!r} line 4: must have 2 cells as the header names "
        f"['prompt', 'answer'], got 1: ['c']")
    f.write_text("prompt,answer\nc,1,extra\n", encoding="utf-8")
    assert "line 2: must have 2 cells" in _refused(tmp_path, train_files=(str(f),))


@pytest.mark.parametrize("content, where, reason", [
    ("prompt,prompt\nx,1\n", "line 1", "the header must name each column once, with a non-blank "
                                        "name, got ['prompt', 'prompt']"),
    ("prompt,\nx,1\n", "line 1", "the header must name each column once, with a non-blank name, "
                                 "got ['prompt', '']"),
    ('prompt,answer\nx,1\n"unclosed,1\n', "line 3", "not valid CSV (unexpected end of data"),
    ('prompt,answer\n"a"b,1\n', "line 2", "not valid CSV ("),
])
def test_a_bad_header_or_quote_is_refused_with_its_line(tmp_path, content, where, reason):
    f = tmp_path / "train.csv"
    f.write_text(content, encoding="utf-8")
    assert _refused(tmp_path, train_files=(str(f),)).startswith(
        f"data.train_files: {str(f)!r} {where}: {reason}")


def test_values_are_checked_as_in_json_files(tmp_path):
    f = tmp_path / "train.csv"
    f.write_text("prompt,answer\nWhat?,1\n   ,2\n,3\n", encoding="utf-8")
    assert _refused(tmp_path, train_files=(str(f),)) == (
        f"data.train_files: {str(f)!r} line 3: column 'prompt' (data.prompt_key) must be a "
        f"non-empty string or chat messages [{{role, content}}], got an empty string '   ' "
        f"(and 1 more bad row)")
    f.write_text("question,answer\nWhat?,1\n", encoding="utf-8")
    assert _refused(tmp_path, train_files=(str(f),)) == (
        f"data.prompt_key: column 'prompt' is not in train_files [{str(f)!r}] (columns: "
        f"['question', 'answer'])")


def test_chat_messages_in_a_cell_are_refused_with_the_way_to_write_them(tmp_path):
    f = tmp_path / "train.csv"
    f.write_text('messages\n"[{""role"": ""user"", ""content"": ""hi""}]"\n', encoding="utf-8")
    message = _refused(tmp_path, "sft", train_files=(str(f),), messages_key="messages")
    assert message.startswith(f"data.train_files: {str(f)!r} line 2: column 'messages' "
                              f"(data.messages_key) must be chat messages")
    assert message.endswith("(a CSV cell holds text only: write chat messages as JSON lines)")


@pytest.mark.parametrize("content", ["", "prompt,answer\n", "prompt,answer\n\n\n"])
def test_a_file_without_rows_is_refused(tmp_path, content):
    f = tmp_path / "train.csv"
    f.write_text(content, encoding="utf-8")
    assert _refused(tmp_path, train_files=(str(f),)) == (
        f"data.train_files: {str(f)!r} is empty: it has no rows")


def test_another_suffix_names_the_formats_read(tmp_path):
    f = tmp_path / "train.txt"
    f.write_text("What is 1+2?\n")
    assert _refused(tmp_path, train_files=(str(f),)) == (
        f"data.train_files: must be .jsonl, .json, .parquet, .csv or .tsv files, got {str(f)!r}")
