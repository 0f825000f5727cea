"""The recipes' data: the user's JSONL / Parquet files (read and checked row by row in
fsdpfn.app.recipes.data_rows), or the embedded addition task, behind one interface.

    data:
      train_files: [data/train.jsonl]          # .jsonl / .json / .parquet, local files
      eval_files: [data/test.jsonl]
      prompt_key: prompt                        # a string, or chat messages [{role, content}]
      answer_key: answer                        # handed to the reward (optional column)
      max_prompt_tokens: 512
      max_response_tokens: 1024

Columns by recipe: grpo/ppo read ``prompt_key`` (or ``messages_key``: the conversation up to its
last assistant turn is the prompt) and ``answer_key`` when present; sft reads ``messages_key``
(loss on the assistant turns only) or ``prompt_key`` + ``response_key`` (loss on the response);
rw/dpo read ``prompt_key`` + ``chosen_key`` + ``rejected_key``. String prompts are tokenized as
they are, or rendered as one user turn with the chat template when ``chat_template: true``; chat
messages always go through the tokenizer's chat template.

A bad file or a bad row (a prompt missing, null or not a string, a line that is not JSON, a
file that is not UTF-8 or is empty) refuses the split with one ConfigError naming the file, the
line or row, the column and its key, before anything is tokenized (fsdpfn.app.recipes.data_rows).

Samples that do not fit (a prompt over ``max_prompt_tokens``; for sft/rw/dpo a response over
``max_response_tokens``) are dropped when the data is prepared, never cut, and counted: the launcher
prints the counts and writes them to run_dir/data/stats.json. RL responses are generated with
``max_new_tokens = max_response_tokens``; the clipped fraction is a per-step metric.

Order: with ``shuffle`` every epoch is a permutation drawn under (seed, epoch); sample k of the
run is a pure function of k, so the data cursor (samples consumed, saved in each checkpoint's
``extra``) is all a resumed run needs to continue with the next unseen sample.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import attrs

from fsdpfn.validators import boolean, fail, integer, is_nonempty_str, satisfies
from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes.data_rows import check_rows, read_rows

__all__ = ["DataConfig", "FileSource", "AdditionSource", "prepare_files", "load_source",
           "DATA_DIR"]

DATA_DIR = "data"   # under run_dir: the prepared (tokenized, filtered) splits


def _files(value):
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _file_list(_, attribute, value):
    if not isinstance(value, tuple):
        fail(f"data.{attribute.name}", "must be a list of file paths", value)
    for v in value:
        if not isinstance(v, str) or not v:
            fail(f"data.{attribute.name}", "must be a list of file paths", v)


_key = satisfies("must be a column name", is_nonempty_str, section="data.")


@attrs.frozen
class DataConfig:
    """Local data files; none: the embedded addition task (``task:``). See the module doc."""

    train_files: tuple[str, ...] = attrs.field(default=(), converter=_files, validator=_file_list)
    eval_files: tuple[str, ...] = attrs.field(default=(), converter=_files, validator=_file_list)
    prompt_key: str = attrs.field(default="prompt", validator=_key)
    answer_key: str = attrs.field(default="answer", validator=_key)
    messages_key: str = attrs.field(default="messages", validator=_key)
    response_key: str = attrs.field(default="response", validator=_key)
    chosen_key: str = attrs.field(default="chosen", validator=_key)
    rejected_key: str = attrs.field(default="rejected", validator=_key)
    chat_template: bool = attrs.field(default=False, validator=boolean)
    system_prompt: str | None = attrs.field(default=None)
    max_prompt_tokens: int = attrs.field(default=1024, validator=integer(1))
    max_response_tokens: int = attrs.field(default=1024, validator=integer(1))
    shuffle: bool = attrs.field(default=True, validator=boolean)
    eval_size: int | None = attrs.field(default=None, validator=integer(1, allow=(None,)))

    @property
    def from_files(self) -> bool:
        return bool(self.train_files)


# ---------------------------------------------------------------- reading and preparing files


def _columns_for(cfg: DataConfig, recipe: str, columns: list[str], key: str) -> dict:
    """Which columns this recipe reads; a missing one is a ConfigError naming its key."""
    def need(field: str) -> str:
        col = getattr(cfg, field)
        if col not in columns:
            raise ConfigError(f"data.{field}: column {col!r} is not in {key} (columns: "
                              f"{columns})")
        return col

    if recipe in ("grpo", "ppo"):
        use = {"messages": need("messages_key")} if cfg.prompt_key not in columns \
            and cfg.messages_key in columns else {"prompt": need("prompt_key")}
        if cfg.answer_key in columns:
            use["answer"] = cfg.answer_key
        return use
    if recipe == "sft":
        if cfg.prompt_key not in columns and cfg.messages_key in columns:
            return {"messages": cfg.messages_key}
        return {"prompt": need("prompt_key"), "response": need("response_key")}
    return {"prompt": need("prompt_key"), "chosen": need("chosen_key"),
            "rejected": need("rejected_key")}


def _with_system(cfg: DataConfig, messages: list) -> list:
    if cfg.system_prompt and not (messages and messages[0].get("role") == "system"):
        return [{"role": "system", "content": cfg.system_prompt}, *messages]
    return list(messages)


def _prompt_ids(cfg: DataConfig, tok, prompt) -> list[int]:
    if isinstance(prompt, str) and not cfg.chat_template:
        return tok.prompt_ids(prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tok.chat_ids(_with_system(cfg, messages), generation_prompt=True)


def _chat_loss_mask(cfg: DataConfig, tok, messages: list) -> tuple[list[int], list[bool]]:
    """The whole conversation's ids, loss on the assistant turns only: each turn's tokens are
    the difference between the template rendered up to it and up to the turn before."""
    messages = _with_system(cfg, messages)
    ids = tok.chat_ids(messages, generation_prompt=False)
    loss = [False] * len(ids)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        start = len(tok.chat_ids(messages[:i], generation_prompt=True)) if i else 0
        end = len(tok.chat_ids(messages[:i + 1], generation_prompt=False))
        if ids[:end] != tok.chat_ids(messages[:i + 1], generation_prompt=False):
            raise ConfigError("data.messages_key: the chat template does not render a "
                              "conversation's prefixes as prefixes of the whole, so assistant "
                              "turns cannot be located; use prompt_key + response_key")
        for t in range(start, min(end, len(ids))):
            loss[t] = True
    return ids, loss


def _response_ids(tok, text) -> list[int]:
    """A response string's ids, ending with the first stop token (the model learns to stop)."""
    ids = tok.encode(text)
    return ids + ([tok.stop_ids[0]] if tok.stop_ids else [])


def _prepare_row(cfg: DataConfig, tok, recipe: str, cols: dict, row: dict):
    """(example, None) or (None, reason it was dropped)."""
    ex: dict = {"sample": row}
    if "answer" in cols:
        ex["answer"] = row[cols["answer"]]
    if recipe in ("grpo", "ppo"):
        if "messages" in cols:
            msgs = list(row[cols["messages"]])
            while msgs and msgs[-1].get("role") == "assistant":
                msgs.pop()
            ex["prompt"] = msgs
        else:
            ex["prompt"] = row[cols["prompt"]]
        ex["prompt_ids"] = _prompt_ids(cfg, tok, ex["prompt"])
        if len(ex["prompt_ids"]) > cfg.max_prompt_tokens:
            return None, "prompt over max_prompt_tokens"
        return ex, None
    if recipe == "sft":
        if "messages" in cols:
            ids, loss = _chat_loss_mask(cfg, tok, list(row[cols["messages"]]))
            first = loss.index(True) if True in loss else len(ids)
            if first > cfg.max_prompt_tokens:
                return None, "prompt over max_prompt_tokens"
            if len(ids) - first > cfg.max_response_tokens:
                return None, "response over max_response_tokens"
        else:
            prompt = _prompt_ids(cfg, tok, row[cols["prompt"]])
            response = _response_ids(tok, row[cols["response"]])
            if len(prompt) > cfg.max_prompt_tokens:
                return None, "prompt over max_prompt_tokens"
            if len(response) > cfg.max_response_tokens:
                return None, "response over max_response_tokens"
            ids, loss = prompt + response, [False] * len(prompt) + [True] * len(response)
        if not any(loss[1:]):
            return None, "no response tokens"
        ex.update(ids=ids, loss=loss)
        return ex, None
    prompt = _prompt_ids(cfg, tok, row[cols["prompt"]])
    if len(prompt) > cfg.max_prompt_tokens:
        return None, "prompt over max_prompt_tokens"
    for side in ("chosen", "rejected"):
        response = _response_ids(tok, row[cols[side]])
        if len(response) > cfg.max_response_tokens:
            return None, f"{side} response over max_response_tokens"
        ex[side] = (prompt + response, [False] * len(prompt) + [True] * len(response))
    return ex, None


def prepare_files(cfg: DataConfig, tok, recipe: str, out_dir: Path) -> dict:
    """Read, check, tokenize and filter the train and eval files into ``out_dir`` (JSON lines,
    one example per line); returns {split: {"rows", "kept", "dropped": {reason: count}}}. Runs
    in the launcher, so a missing file, column or a bad row fails before any rank starts; every
    split is read and checked before anything is tokenized or written."""
    splits = []
    for split, files, key in (("train", cfg.train_files, "train_files"),
                              ("eval", cfg.eval_files, "eval_files")):
        if files:
            data = read_rows(files, key)
            cols = _columns_for(cfg, recipe, list(data.columns), key)
            check_rows(data, cols, recipe)
            splits.append((split, key, data, cols))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {split: _write_split(cfg, tok, recipe, data, cols, out_dir / f"{split}.jsonl", key)
              for split, key, data, cols in splits}
    (out_dir / "stats.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _write_split(cfg: DataConfig, tok, recipe: str, data, cols: dict, path: Path, key: str):
    """Tokenize and filter one split's checked rows into ``path``; its report."""
    kept, dropped = 0, {}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        for i in range(len(data.rows)):
            ex, reason = _prepare_row(cfg, tok, recipe, cols, data.full(i))
            if ex is None:
                dropped[reason] = dropped.get(reason, 0) + 1
                continue
            ex["index"] = i
            fh.write(json.dumps(ex, default=str) + "\n")
            kept += 1
    if kept == 0:
        tmp.unlink()
        raise ConfigError(f"data.{key}: no sample fits the limits (max_prompt_tokens="
                          f"{cfg.max_prompt_tokens}, max_response_tokens="
                          f"{cfg.max_response_tokens}); dropped {dropped}")
    tmp.rename(path)
    return {"rows": len(data.rows), "kept": kept, "dropped": dropped}


# ---------------------------------------------------------------- sources


class FileSource:
    """Prepared examples of one split; ``take(cursor, n)`` gives samples cursor..cursor+n-1 of
    the run's order (epochs, each a permutation under (seed, epoch) when shuffling)."""

    def __init__(self, path: Path, *, seed: int, shuffle: bool):
        self.examples = [json.loads(line) for line in Path(path).read_text().splitlines()]
        self.seed, self.shuffle = seed, shuffle
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.examples)

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is enough
        return self._orders[epoch]

    def take(self, cursor: int, n: int) -> list[dict]:
        n_all = len(self.examples)
        return [self.examples[self._order(k // n_all)[k % n_all]]
                for k in range(cursor, cursor + n)]

    def head(self, n: int) -> list[dict]:
        """The first ``n`` examples in file order (held-out evaluation)."""
        return self.examples[:n]


class AdditionSource:
    """The embedded task as a source: example k is a problem drawn under (seed, k) (an endless
    stream: no epochs). Examples carry what every recipe reads (prompt_ids and answer; sft
    ids/loss; rw/dpo chosen/rejected: the sum against a near miss)."""

    def __init__(self, task, tok, *, seed: int):
        self.task, self.tok, self.seed = task, tok, seed

    def example(self, k: int) -> dict:
        from fsdpfn.app.recipes.task import wrong_answer

        rng = random.Random(self.seed * 1_000_003 + k)
        hi = 10 ** self.task.digits
        a, b = rng.randrange(hi), rng.randrange(hi)
        prompt_ids = self.task.prompt_ids(self.tok, a, b)
        answer_ids = self.task.answer_ids(self.tok, a + b)
        wrong_ids = self.task.answer_ids(self.tok, wrong_answer(a, b, rng))
        p = len(prompt_ids)

        def seq(resp):
            return (prompt_ids + resp, [False] * p + [True] * len(resp))

        ids, loss = seq(answer_ids)
        return {"index": k, "prompt": self.task.prompt(a, b), "prompt_ids": prompt_ids,
                "answer": str(a + b), "sample": {"a": a, "b": b, "reverse": self.task.reverse},
                "ids": ids, "loss": loss, "chosen": seq(answer_ids), "rejected": seq(wrong_ids)}

    def take(self, cursor: int, n: int) -> list[dict]:
        return [self.example(k) for k in range(cursor, cursor + n)]

    def head(self, n: int) -> list[dict]:
        return [self.example(-1 - k) for k in range(n)]  # negative ids: never trained on


def load_source(cfg, tok, run_dir: Path, split: str = "train"):
    """The run's source of ``split``: prepared files under run_dir/data, or the addition task
    (its held-out split: problems the training stream never draws)."""
    if not cfg.data.from_files:
        return AdditionSource(cfg.task, tok, seed=cfg.seed)
    path = Path(run_dir) / DATA_DIR / f"{split}.jsonl"
    if not path.is_file():
        return None
    return FileSource(path, seed=cfg.seed, shuffle=cfg.data.shuffle and split == "train")
