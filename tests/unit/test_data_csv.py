"""CSV (.csv) and tab-separated (.tsv) data files: the first line names the columns, every value
is read as the text written, and a bad file or row is refused by name with the line its row
starts on (fsdpfn.app.recipes.data_rows).

The refusals run prepare_files with no tokenizer (``tok=None``), so any tokenization would fail
with an AttributeError instead of the ConfigError expected. Accepted files are compared with
the rows written, parsed here by hand, not with the csv module the reader uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdpfn.app.recipes.data import DataConfig, prepare_files
from fsdpfn.errors import ConfigError


def _refused(tmp_path: Path, recipe: str = "grpo", **data) -> str:
    out = tmp_path / "prepared"
    with pytest.raises(ConfigError) as info:
        prepare_files(DataConfig(**data), None, recipe, out)
    message = str(info.value)
    assert "\n" not in message and not out.exists(), message
    return message


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from fsdpfn.app.recipes.model import HFTokenizer
    from fsdpfn.testing.hf_dir import write_tiny_hf_dir

    path = write_tiny_hf_dir(tmp_path_factory.mktemp("tok"), weights=False,
                             texts=['What is 1,2? "quoted"', "two\nlines", "caf\u00e9 3"])
    return HFTokenizer(path)


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
