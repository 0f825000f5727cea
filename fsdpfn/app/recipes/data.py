"""The recipes' data: the user's JSONL / Parquet / CSV files (read and checked row by row in
fsdpfn.app.recipes.data_rows), or the embedded addition task, behind one interface.

    data:
      train_files: [data/train.jsonl]          # .jsonl / .json / .parquet / .csv / .tsv
      eval_files: [data/test-*.parquet]        # also a directory, or hf://datasets/ORG/NAME/PATH
      prompt_key: prompt                        # a string, or chat messages [{role, content}]
      answer_key: answer                        # handed to the reward (optional column)
      max_prompt_tokens: 512
      max_response_tokens: 1024

Columns by recipe: grpo/ppo read ``prompt_key`` (or ``messages_key``: the conversation up to its
last assistant turn is the prompt) and ``answer_key`` when present; sft reads ``messages_key``
(loss on the assistant turns only) or ``prompt_key`` + ``response_key`` (loss on the response);
rw/dpo read ``prompt_key`` + ``chosen_key`` + ``rejected_key``. TRL's conversational formats are
read as they come: a response, chosen or rejected value may be chat messages (the turns after
the prompt; the loss on their assistant turns, a prompt's own assistant turns being context),
and rw/dpo rows without a prompt column may hold each side as a whole conversation (the
prompt being the turns the two share). sft rows of plain text (``text_key``, without a prompt
or messages column) train on every token (continued pretraining). String prompts are tokenized as
they are, or rendered as one user turn with the chat template when ``chat_template: true``; chat
messages always go through the tokenizer's chat template. ``system_prompt`` goes into chat
prompts (before a conversation without a system turn), so with string prompts it needs
``chat_template: true``.

The loss of a chat row is on each assistant turn's content and its end-of-turn token (the last
special token the template closes the turn with, e.g. ``<|im_end|>``), not on the template's
framing: a default system turn, the turn's header, the newline after its end. A templated
prompt with a response (sft, and each side of an rw/dpo pair) is the conversation [user prompt,
assistant response], so it ends the same way; an untemplated one is the prompt's ids, the
response's and the tokenizer's first stop token. Responses must be non-blank strings, a pair's
two responses must differ, and an sft conversation needs an assistant turn.

A bad file or a bad row (a prompt missing, null or not a string, a line that is not JSON, a
file that is not UTF-8 or is empty) refuses the split with one ConfigError naming the file, the
line or row, the column and its key, before anything is tokenized (fsdpfn.app.recipes.data_rows).

Samples that do not fit (a prompt over ``max_prompt_tokens``; for sft/rw/dpo a response over
``max_response_tokens``, a chat's response being all its assistant tokens and its prompt the
rest) are dropped when the data is prepared, never cut, and counted: the launcher
prints the counts and writes them to run_dir/data/stats.json. RL responses are generated with
``max_new_tokens = max_response_tokens``; the clipped fraction is a per-step metric.

Order: with ``shuffle`` every epoch is a permutation drawn under (seed, epoch); sample k of the
run is a pure function of k, so the data cursor (samples consumed, saved in each checkpoint's
``extra``) is all a resumed run needs to continue with the next unseen sample. A step that
crosses an epoch's end takes the rest of that epoch and the start of the next, so one row can
appear twice in it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import attrs

from fsdpfn.validators import boolean, fail, integer, is_nonempty_str, satisfies
from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes.data_rows import check_rows, read_rows, split_implicit

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
    """Local data files; none: the embedded addition task (``task:``). See the module doc.
    Without ``train_files`` the other keys but ``eval_size`` are refused, never ignored; with
    them, so is a column key set that the recipe does not read (``chosen_key`` in sft)."""

    train_files: tuple[str, ...] = attrs.field(default=(), converter=_files, validator=_file_list)
    eval_files: tuple[str, ...] = attrs.field(default=(), converter=_files, validator=_file_list)
    prompt_key: str = attrs.field(default="prompt", validator=_key)
    answer_key: str = attrs.field(default="answer", validator=_key)
    messages_key: str = attrs.field(default="messages", validator=_key)
    response_key: str = attrs.field(default="response", validator=_key)
    text_key: str = attrs.field(default="text", validator=_key)
    chosen_key: str = attrs.field(default="chosen", validator=_key)
    rejected_key: str = attrs.field(default="rejected", validator=_key)
    chat_template: bool = attrs.field(default=False, validator=boolean)
    system_prompt: str | None = attrs.field(
        default=None, validator=satisfies("must be a non-empty string",
                                          is_nonempty_str, optional=True, section="data."))
    max_prompt_tokens: int = attrs.field(default=1024, validator=integer(1))
    max_response_tokens: int = attrs.field(default=1024, validator=integer(1))
    shuffle: bool = attrs.field(default=True, validator=boolean)
    eval_size: int | None = attrs.field(default=None, validator=integer(1, allow=(None,)))

    @property
    def from_files(self) -> bool:
        return bool(self.train_files)


# ---------------------------------------------------------------- reading and preparing files


def answer_reason(cfg) -> str | None:
    """Why a grpo/ppo run's data files must hold data.answer_key's column (None: the reward
    may go without it, and gets answer None). ``cfg``: the recipe's whole config."""
    from fsdpfn.app.recipes.reward import DEFAULT_REWARDS

    if cfg.recipe not in ("grpo", "ppo") or not cfg.data.from_files:
        return None
    if cfg.reward.fn in (None, DEFAULT_REWARDS["files"]):
        return (f"the built-in math reward (reward.fn: {cfg.reward.fn or 'null'}) scores each "
                f"completion against it; add the column, name yours with data.answer_key, or "
                f"set reward.fn")
    if cfg.data.answer_key != "answer":
        return "data.answer_key is set: its column is what reward.fn gets as answer"
    return None


def columns_for(cfg: DataConfig, recipe: str, columns: list[str], key: str, *,
                answer_reason: str | None = None) -> dict:
    """Which columns this recipe reads; a missing one is a ConfigError naming its key.
    ``answer_reason``: why the answer column is needed (else it is read when present)."""
    def need(field: str, why: str = "") -> str:
        col = getattr(cfg, field)
        if col not in columns:
            files = list(getattr(cfg, key))
            alt = (f"; sft reads data.messages_key ({cfg.messages_key!r}), data.prompt_key + "
                   f"data.response_key, or data.text_key ({cfg.text_key!r})"
                   if recipe == "sft" else f"; {why}" if why else "")
            if field == "response_key" and "completion" in columns:
                alt += (" (prompt-completion rows, as TRL writes them: data.response_key: "
                        "completion)")
            raise ConfigError(f"data.{field}: column {col!r} is not in {key} {files} (columns: "
                              f"{columns}){alt}")
        return col

    if recipe in ("grpo", "ppo"):
        use = {"messages": need("messages_key")} if cfg.prompt_key not in columns \
            and cfg.messages_key in columns else {"prompt": need("prompt_key")}
        if answer_reason is not None:
            use["answer"] = need("answer_key", answer_reason)
        elif cfg.answer_key in columns:
            use["answer"] = cfg.answer_key
        return use
    if recipe == "sft":
        if cfg.prompt_key not in columns and cfg.messages_key in columns:
            return {"messages": cfg.messages_key}
        if cfg.prompt_key not in columns and cfg.text_key in columns:  # plain text: all trained
            return {"text": cfg.text_key}
        return {"prompt": need("prompt_key"), "response": need("response_key")}
    if cfg.prompt_key not in columns and cfg.chosen_key in columns and \
            cfg.rejected_key in columns:  # TRL's implicit prompt: whole conversations
        return {"chosen": cfg.chosen_key, "rejected": cfg.rejected_key}
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


def _chat_loss_mask(cfg: DataConfig, tok, messages: list, *,
                    from_turn: int = 0) -> tuple[list[int], list[bool]]:
    """The whole conversation's ids, loss on the assistant turns only (those at index
    ``from_turn`` of ``messages`` or later: a conversational completion's): each turn's tokens
    are the difference between the template rendered up to it (with the generation prompt, so
    its header is framing) and rendered through it; of those, the tokens after the turn's last
    special token (its end-of-turn marker, e.g. the newline after <|im_end|>) are framing too."""
    shown = _with_system(cfg, messages)
    from_turn += len(shown) - len(messages)  # a system turn put in front
    messages = shown
    ids = tok.chat_ids(messages, generation_prompt=False)
    loss = [False] * len(ids)
    special = tok.special_ids
    for i, m in enumerate(messages):
        if m.get("role") != "assistant" or i < from_turn:
            continue
        through = tok.chat_ids(messages[:i + 1], generation_prompt=False)
        if ids[:len(through)] != through:
            raise ConfigError("data.messages_key: the chat template does not render a "
                              "conversation's prefixes as prefixes of the whole, so assistant "
                              "turns cannot be located; use prompt_key + response_key")
        start = (len(tok.chat_ids(messages[:i], generation_prompt=True)) if i
                 else _first_turn_start(tok, m, through))
        end = len(through)
        marks = [t for t in range(start, end) if ids[t] in special]
        if marks and marks[-1] > start:  # the turn's own end-of-turn token closes its loss
            end = marks[-1] + 1
        for t in range(start, end):
            loss[t] = True
    return ids, loss


def _first_turn_start(tok, message: dict, through: list[int]) -> int:
    """Where the content of a conversation's first turn (an assistant's) begins: the tokens it
    shares with the same turn rendered empty are the template's (BOS, a default system turn,
    the turn's header)."""
    empty = tok.chat_ids([{**message, "content": ""}], generation_prompt=False)
    n = 0
    while n < min(len(empty), len(through)) and empty[n] == through[n]:
        n += 1
    return n


def _chat_pair(prompt, response) -> tuple[list[dict], int]:
    """A string or chat prompt and its response (a string, or a conversational completion's
    turns) as one conversation for the template to render, and the index of the response's
    first turn: the loss goes on the response's assistant turns."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    turns = list(response) if isinstance(response, list) else \
        [{"role": "assistant", "content": response}]
    return messages + turns, len(messages)


def _response_ids(tok, text) -> list[int]:
    """A response string's ids, ending with the first stop token (the model learns to stop)."""
    ids = tok.encode(text)
    return ids + ([tok.stop_ids[0]] if tok.stop_ids else [])


def _templated(cfg: DataConfig, prompt, response=None) -> bool:
    """Whether a prompt goes through the chat template (chat messages, a conversational
    completion, or chat_template)."""
    return not isinstance(prompt, str) or isinstance(response, list) or cfg.chat_template


def _pair_rows(cfg: DataConfig, tok, prompt, response):
    """(ids, loss, prompt tokens) of a prompt and response: through the chat template as a
    conversation (its end-of-turn token closing the response, as chat rows end their turns;
    a conversational completion's assistant turns trained on), else the prompt as tokenized
    then the response and the tokenizer's stop token."""
    if _templated(cfg, prompt, response):
        messages, first = _chat_pair(prompt, response)
        ids, loss = _chat_loss_mask(cfg, tok, messages, from_turn=first)
        return ids, loss, loss.index(True) if True in loss else len(ids)
    head = _prompt_ids(cfg, tok, prompt)
    body = _response_ids(tok, response)
    return head + body, [False] * len(head) + [True] * len(body), len(head)


def _prepare_row(cfg: DataConfig, tok, recipe: str, cols: dict, row: dict):
    """(example, None, None) or (None, reason it was dropped, the tokens of the part over its
    limit: None for a reason without one)."""
    if cfg.system_prompt and "prompt" in cols and isinstance(row[cols["prompt"]], str) \
            and not cfg.chat_template:
        raise ConfigError(f"data.system_prompt: goes into chat prompts, and string prompts "
                          f"are chat prompts only with data.chat_template: true, got "
                          f"system_prompt {cfg.system_prompt[:60]!r} with chat_template false")
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
            return None, "prompt over max_prompt_tokens", len(ex["prompt_ids"])
        return ex, None, None
    if recipe == "sft":
        if "messages" in cols:
            ids, loss = _chat_loss_mask(cfg, tok, list(row[cols["messages"]]))
        elif "text" in cols:  # the tokenizer's BOS (if any), the text and a stop token
            head, body = tok.prompt_ids(""), _response_ids(tok, row[cols["text"]])
            ids = head + body  # every token trained on but the first, which nothing predicts
            loss = [False] * len(head) + [True] * len(body)
            loss[0] = False
        else:
            ids, loss, _ = _pair_rows(cfg, tok, row[cols["prompt"]], row[cols["response"]])
        # the response: every token trained on (all assistant turns); the prompt: the rest
        if len(ids) - sum(loss) > cfg.max_prompt_tokens:
            return None, "prompt over max_prompt_tokens", len(ids) - sum(loss)
        if sum(loss) > cfg.max_response_tokens:
            return None, "response over max_response_tokens", sum(loss)
        if not any(loss[1:]):
            return None, "no response tokens", None
        ex.update(ids=ids, loss=loss)
        return ex, None, None
    if "prompt" in cols:
        prompt, sides = row[cols["prompt"]], {s: row[cols[s]] for s in ("chosen", "rejected")}
    else:  # the prompt is the conversations' shared first turns (checked by data_rows)
        prompt, *rests = split_implicit(row[cols["chosen"]], row[cols["rejected"]])
        sides = dict(zip(("chosen", "rejected"), rests))
    for side in ("chosen", "rejected"):
        ids, loss, head = _pair_rows(cfg, tok, prompt, sides[side])
        if head > cfg.max_prompt_tokens:
            return None, "prompt over max_prompt_tokens", head
        if sum(loss) > cfg.max_response_tokens:
            return None, f"{side} response over max_response_tokens", sum(loss)
        ex[side] = (ids, loss)
    if ex["chosen"][0][:head] != ex["rejected"][0][:head]:
        raise ConfigError("data.chat_template: the chat template renders the same prompt "
                          "differently before two responses, so a pair cannot share it; use "
                          "string prompts with chat_template: false")
    return ex, None, None


def prepare_files(cfg: DataConfig, tok, recipe: str, out_dir: Path, *,
                  answer_reason: str | None = None) -> dict:
    """Read, check, tokenize and filter the train and eval files into ``out_dir`` (JSON lines,
    one example per line); returns {split: {"rows", "kept", "dropped": {reason: count}}}. Runs
    in the launcher, so a missing file, column or a bad row fails before any rank starts; every
    split is read and checked before anything is tokenized or written."""
    splits = []
    for split, files, key in (("train", cfg.train_files, "train_files"),
                              ("eval", cfg.eval_files, "eval_files")):
        if files:
            data = read_rows(files, key)
            cols = columns_for(cfg, recipe, list(data.columns), key,
                               answer_reason=answer_reason)
            check_rows(data, cols, recipe)
            splits.append((split, key, data, cols))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval"):  # a split no file feeds now (left by an earlier run)
        if split not in {name for name, *_ in splits}:
            (out_dir / f"{split}.jsonl").unlink(missing_ok=True)
    report = {split: _write_split(cfg, tok, recipe, data, cols, out_dir / f"{split}.jsonl", key)
              for split, key, data, cols in splits}
    (out_dir / "stats.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _write_split(cfg: DataConfig, tok, recipe: str, data, cols: dict, path: Path, key: str):
    """Tokenize and filter one split's checked rows into ``path``; its report."""
    kept, dropped, fewest = 0, {}, {}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        for i in range(len(data.rows)):
            try:
                ex, reason, tokens = _prepare_row(cfg, tok, recipe, cols, data.full(i))
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - the tokenizer's or the chat template's
                # a template that refuses the row (raise_exception: roles that must alternate,
                # no system role), a template that does not parse, text the tokenizer cannot
                # encode (a lone surrogate): the row named, not a traceback
                raise ConfigError(f"{data.where(i)}: the tokenizer of "
                                  f"{str(getattr(tok, 'path', 'model.path'))!r} or its chat "
                                  f"template cannot tokenize this row ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})") from exc
            if ex is None:
                dropped[reason] = dropped.get(reason, 0) + 1
                if tokens is not None:  # the shortest part over its limit, per reason
                    fewest[reason] = min(fewest.get(reason, tokens), tokens)
                continue
            ex["index"] = i
            fh.write(json.dumps(ex, default=str) + "\n")
            kept += 1
    if kept == 0:
        tmp.unlink()
        parts = ((*r.split(" over "), n) for r, n in sorted(fewest.items()))
        raise ConfigError(f"data.{key}: no sample fits the limits (max_prompt_tokens="
                          f"{cfg.max_prompt_tokens}, max_response_tokens="
                          f"{cfg.max_response_tokens}); dropped {dropped}"
                          + "".join(f"; the shortest {part} dropped has {n} tokens (data.{limit})"
                                    for part, limit, n in parts))
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
        """Epoch ``epoch``'s permutation. Two threads take from a source at once (a
        RolloutStream reads prompts ahead while the step reads its own rows, an epoch apart at
        a boundary): the last few epochs are kept, and the dict is replaced, never mutated."""
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {**{e: o for e, o in self._orders.items() if abs(e - epoch) <= 2},
                            epoch: order}
        return order

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
