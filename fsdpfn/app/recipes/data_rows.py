"""The user's data files as rows, and the check of every value a recipe reads, before anything
is tokenized or launched.

A bad file or a bad row refuses the whole split with one ConfigError line naming the config key,
the file, where in it (``line N`` of a JSON-lines or CSV file, counted from 1 as editors do, a
CSV row's first line; ``row N`` of a Parquet file or a JSON array, counted from 0 as pandas
does), the column with the key that names it, the rule and the value:

    data.train_files: 'train.jsonl' line 7: column 'question' (data.prompt_key) must be a
    non-empty string or chat messages [{role, content}], got null (and 2 more bad rows)

Refused: a file that is missing, empty, not UTF-8 (the byte, its offset and line), not valid JSON
(the line and column, with the parser's reason), a row that is not an object, and a value that
is missing, null or of the wrong type. A row is never dropped silently for its content: a data
bug would hide behind a smaller epoch. (Rows over the token limits are dropped and counted by
design, in fsdpfn.app.recipes.data.)

JSON files are parsed here with the standard library: one object per line (.jsonl, .json), or
a single array of objects (a .json file that starts with ``[``). Parquet files are read with
pyarrow. CSV (.csv) and tab-separated (.tsv) files are read with the standard library's csv
module: the first line names the columns, every value is the text as written ("007" stays
"007"; an empty cell is the empty string), and a row with more or fewer cells than the header
is refused. A cell holds text only, so chat messages need JSON lines or Parquet.
"""

from __future__ import annotations

import bisect
import codecs
import csv
import io
import json
from pathlib import Path

from fsdpfn.errors import ConfigError

__all__ = ["UserRows", "read_rows", "check_rows", "SUFFIX_FORMAT"]

SUFFIX_FORMAT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv",
                 ".tsv": "csv"}
PROMPT_RULE = "a non-empty string or chat messages [{role, content}]"
MESSAGES_RULE = "chat messages: a non-empty list of {role: string, content: string}"
_FIELDS = {"prompt": "prompt_key", "messages": "messages_key", "answer": "answer_key",
           "response": "response_key", "chosen": "chosen_key", "rejected": "rejected_key",
           "text": "text_key"}
_JSON_TYPES = {str: "string", bool: "boolean", int: "number", float: "number", list: "array",
               dict: "object"}


class UserRows:
    """The rows of one split's files in order; ``where(i)`` names row i's file and position."""

    def __init__(self, key: str):
        self.key = key
        self.rows: list[dict] = []
        self.columns: dict[str, None] = {}   # every row's keys, first seen first
        self._starts: list[int] = []         # index of each file's first row
        self._origins: list[tuple[str, list[int] | None]] = []  # (file, JSONL line of each row)

    def add(self, path: str, rows: list, lines: list[int] | None) -> None:
        self._starts.append(len(self.rows))
        self._origins.append((path, lines))
        for j, row in enumerate(rows):
            if not isinstance(row, dict):
                raise ConfigError(f"{self._where_in(path, lines, j)}: must be an object "
                                  f"{{column: value}}, got {_describe(row)}")
            self.columns.update(dict.fromkeys(row))
        self.rows.extend(rows)

    def _file(self, i: int) -> int:
        return bisect.bisect_right(self._starts, i) - 1

    def where(self, i: int) -> str:
        f = self._file(i)
        path, lines = self._origins[f]
        return self._where_in(path, lines, i - self._starts[f])

    def path(self, i: int) -> str:
        return self._origins[self._file(i)][0]

    def _where_in(self, path: str, lines: list[int] | None, j: int) -> str:
        return f"data.{self.key}: {path!r} " + (f"line {lines[j]}" if lines else f"row {j}")

    def full(self, i: int) -> dict:
        """Row i with every column (None where the row has no such key)."""
        row = self.rows[i]
        return row if len(row) == len(self.columns) else {c: row.get(c) for c in self.columns}


def _describe(value, *, missing: bool = False) -> str:
    if missing:
        return "no such key in the row"
    if value is None:
        return "null"
    if isinstance(value, str) and not value.strip():
        return f"an empty string {value!r}"
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{_JSON_TYPES.get(type(value), type(value).__name__)} {text}"


# ---------------------------------------------------------------- reading


def read_rows(files: tuple[str, ...], key: str) -> UserRows:
    """Every row of ``files`` (config key ``key``), refusing a bad file with a ConfigError."""
    for f in files:
        if not Path(f).is_file():
            raise ConfigError(f"data.{key}: file does not exist, got {f!r}")
        if Path(f).suffix not in SUFFIX_FORMAT:
            raise ConfigError(f"data.{key}: must be .jsonl, .json, .parquet, .csv or .tsv "
                              f"files, got {f!r}")
    read = {"json": _json_rows, "parquet": _parquet_rows, "csv": _csv_rows}
    data = UserRows(key)
    for f in files:
        rows, lines = read[SUFFIX_FORMAT[Path(f).suffix]](f, key)
        if not rows:
            raise ConfigError(f"data.{key}: {f!r} is empty: it has no rows")
        data.add(f, rows, lines)
    return data


def _utf8_text(path: str, key: str) -> str:
    raw = Path(path).read_bytes()
    skip = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = exc.start + skip
        line = raw.count(b"\n", 0, at) + 1
        raise ConfigError(f"data.{key}: {path!r} is not UTF-8 text: byte 0x{raw[at]:02x} at "
                          f"offset {at} (line {line}) is {exc.reason}; save the file as "
                          f"UTF-8") from None


def _json_reason(exc: json.JSONDecodeError) -> str:
    """The parser's reason and column: 'Unterminated string starting at column 12' (its
    messages that end in 'at' are not made to read 'at at column')."""
    msg = exc.msg[:-3] if exc.msg.endswith(" at") else exc.msg
    return f"{msg} at column {exc.colno}"


def _json_rows(path: str, key: str) -> tuple[list, list[int] | None]:
    """(rows, their line numbers) of a JSON-lines file; (rows, None) of a JSON array."""
    text = _utf8_text(path, key)
    if Path(path).suffix == ".json" and text.lstrip().startswith("["):
        try:
            return json.loads(text), None  # valid JSON that starts with '[' is an array
        except json.JSONDecodeError as exc:
            raise ConfigError(f"data.{key}: {path!r} line {exc.lineno}: not valid JSON "
                              f"({_json_reason(exc)})") from None
    rows, lines = [], []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may sit in a string
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            whole = ""
            if not rows:  # one object over several lines (a pretty-printed file)?
                try:
                    whole = "" if not isinstance(json.loads(text), dict) else (
                        "; it holds one JSON object over several lines: write one object a "
                        "line (JSON lines) or an array of objects")
                except json.JSONDecodeError:
                    pass
            raise ConfigError(f"data.{key}: {path!r} line {n}: not valid JSON "
                              f"({_json_reason(exc)}){whole}") from None
        lines.append(n)
    return rows, lines


def _parquet_rows(path: str, key: str) -> tuple[list, None]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"data.{key}: reading Parquet needs pyarrow (pip install pyarrow), "
                          f"got {path!r}") from None
    try:
        return pq.read_table(path).to_pylist(), None
    except Exception as exc:  # noqa: BLE001 - a damaged file is the user's input error
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise ConfigError(f"data.{key}: {path!r} cannot be read as Parquet ({reason})") from None


def _csv_rows(path: str, key: str) -> tuple[list, list[int]]:
    """(rows, the line each row starts on) of a CSV (.csv) or tab-separated (.tsv) file whose
    first line names the columns; every value is a string, as written."""
    text = _utf8_text(path, key)
    delimiter = "\t" if Path(path).suffix == ".tsv" else ","
    csv.field_size_limit(2**31 - 1)  # a long document in one cell is a normal row
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    where = f"data.{key}: {path!r} line"
    start = 1  # the line the row being read starts on
    try:
        header = next(reader, None)
        if header is None:
            return [], []
        seen: set[str] = set()
        for name in header:
            if not name.strip() or name in seen:
                raise ConfigError(f"{where} 1: the header must name each column once, with a "
                                  f"non-blank name, got {header!r}")
            seen.add(name)
        rows, lines = [], []
        start = reader.line_num + 1
        for cells in reader:
            if cells:  # a blank line is no row
                if len(cells) != len(header):
                    shown = repr(cells) if len(repr(cells)) <= 200 else repr(cells)[:197] + "..."
                    raise ConfigError(f"{where} {start}: must have {len(header)} cells as the "
                                      f"header names {header!r}, got {len(cells)}: {shown}")
                rows.append(dict(zip(header, cells)))
                lines.append(start)
            start = reader.line_num + 1
    except csv.Error as exc:
        raise ConfigError(f"{where} {start}: not valid CSV ({exc}; a cell with the separator, "
                          f"a quote or a line break is quoted, its quotes doubled)") from None
    return rows, lines


# ---------------------------------------------------------------- checking the values read


def _prompt_problem(value) -> str | None:
    if isinstance(value, str):
        return None if value.strip() else PROMPT_RULE
    if isinstance(value, list):
        return None if _messages_problem(value) is None else PROMPT_RULE
    return PROMPT_RULE


def _messages_problem(value) -> str | None:
    if not isinstance(value, list) or not value:
        return MESSAGES_RULE
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            return MESSAGES_RULE
    return None


def _rl_messages_problem(value) -> str | None:
    """RL prompts are the conversation up to its last assistant turns: one must be left."""
    problem = _messages_problem(value)
    if problem is None and all(m["role"] == "assistant" for m in value):
        return MESSAGES_RULE + " with a turn before the last assistant turns"
    return problem


def _sft_messages_problem(value) -> str | None:
    """sft trains on the assistant turns: one must be there."""
    problem = _messages_problem(value)
    if problem is None and not any(m["role"] == "assistant" for m in value):
        return MESSAGES_RULE + " with at least one assistant turn (the loss is on them)"
    return problem


COMPLETION_RULE = ("a non-blank string, or chat messages with an assistant turn (a "
                   "conversational completion: the turns after the prompt)")


def _completion_problem(value) -> str | None:
    """A response: trained on, so an empty or blank one would teach answering nothing; as chat
    messages (TRL's conversational formats), the loss goes on its assistant turns."""
    if isinstance(value, str):
        return None if value.strip() else COMPLETION_RULE
    if isinstance(value, list) and _messages_problem(value) is None and \
            any(m["role"] == "assistant" for m in value):
        return None
    return COMPLETION_RULE


IMPLICIT_RULE = ("chat messages, the whole conversation (without a prompt column, each side "
                 "is its prompt's turns then its response's, and the two share the prompt)")


def split_implicit(chosen, rejected) -> tuple[list, list, list] | None:
    """(prompt turns, chosen's response turns, rejected's) of a preference pair without a
    prompt column (TRL's implicit prompt): the two conversations' longest common run of first
    turns is the prompt; None where they share no turn or a side's rest has no assistant turn."""
    if _messages_problem(chosen) is not None or _messages_problem(rejected) is not None:
        return None
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    rests = chosen[n:], rejected[n:]
    if n == 0 or not all(any(m["role"] == "assistant" for m in r) for r in rests):
        return None
    return chosen[:n], *rests


def _text_problem(value) -> str | None:
    """A text trained on whole: an empty or blank one would teach nothing."""
    return None if isinstance(value, str) and value.strip() else "a non-blank string"


def _rules(recipe: str) -> dict:
    def present(value):
        return None if value is not None else "present (not null) in every row"

    messages = {"grpo": _rl_messages_problem, "ppo": _rl_messages_problem,
                "sft": _sft_messages_problem}.get(recipe, _messages_problem)
    return {"prompt": _prompt_problem, "messages": messages, "answer": present,
            "response": _completion_problem, "chosen": _completion_problem,
            "rejected": _completion_problem, "text": _text_problem}


def _row_problem(row: dict, cols: dict, rules: dict) -> str | None:
    for role, col in cols.items():
        missing = col not in row
        value = row.get(col)
        problem = rules[role](value)
        if problem is not None:
            return (f"column {col!r} (data.{_FIELDS[role]}) must be {problem}, got "
                    f"{_describe(value, missing=missing)}")
    if "chosen" in cols and "prompt" not in cols and \
            split_implicit(row.get(cols["chosen"]), row.get(cols["rejected"])) is None:
        return (f"columns {cols['chosen']!r} (data.chosen_key) and {cols['rejected']!r} "
                f"(data.rejected_key) must be {IMPLICIT_RULE}, with an assistant turn after "
                f"it on each side (or the rows need the prompt column data.prompt_key names), "
                f"got {_describe(row.get(cols['chosen']))}")
    if "chosen" in cols and row.get(cols["chosen"]) == row.get(cols["rejected"]):
        return (f"columns {cols['chosen']!r} (data.chosen_key) and {cols['rejected']!r} "
                f"(data.rejected_key) must differ (a pair of equal responses prefers nothing), "
                f"got {_describe(row.get(cols['chosen']))} twice")
    return None


def check_rows(data: UserRows, cols: dict, recipe: str) -> None:
    """Every value the recipe reads (``cols``: role -> column, from the recipe's columns) obeys
    its rule; else one ConfigError naming the first bad row and counting the others."""
    rules = _rules(recipe)
    first, bad = None, 0
    for i, row in enumerate(data.rows):
        problem = _row_problem(row, cols, rules)
        if problem is not None:
            bad += 1
            if first is None and MESSAGES_RULE in problem and (
                    SUFFIX_FORMAT[Path(data.path(i)).suffix] == "csv"):
                problem += " (a CSV cell holds text only: write chat messages as JSON lines)"
            first = first or f"{data.where(i)}: {problem}"
    if first is not None:
        more = f" (and {bad - 1} more bad row{'s' if bad > 2 else ''})" if bad > 1 else ""
        raise ConfigError(first + more)
