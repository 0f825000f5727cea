"""The embedded default task: multi-digit addition with a character tokenizer, and a tiny model.

Nothing is downloaded. A prompt is ``<bos>`` + ``"a+b="``; the answer is the decimal sum followed
by ``<eos>``: ``<bos>37+48=85<eos>``. The reward parses the generated characters up to ``<eos>``
and compares the number with a+b (1.0 when equal, else 0.0).

    tok = CharTokenizer()
    task = AdditionTask(digits=2)
    problems = task.sample(8, seed=0)                   # [(a, b), ...]
    prompt_ids = [task.prompt_ids(tok, a, b) for a, b in problems]
    reward = task.reward(a, b, tok.decode(output_ids))  # 1.0 or 0.0
"""

from __future__ import annotations

import random
from pathlib import Path

import attrs

from typing import TYPE_CHECKING

from fsdpfn import keys as K
from fsdpfn.errors import ConfigError
from fsdpfn.validators import boolean, integer
from fsdpfn.app.recipes.model import CharTokenizer, ModelConfig

if TYPE_CHECKING:
    from tensordict import TensorDict

__all__ = ["CharTokenizer", "AdditionTask", "TinyModel", "save_initial_model", "sft_batch",
           "sequences_batch"]



@attrs.frozen
class AdditionTask:
    """``a + b`` with a, b uniform in [0, 10**digits). Variants: ``reverse`` writes the answer
    least-significant digit first (37+48= -> "58"), ``zero_pad`` writes the operands with
    ``digits`` digits (07+48=). The reward always checks the number the answer denotes."""

    digits: int = attrs.field(default=2, validator=integer(1))
    reverse: bool = attrs.field(default=False, validator=boolean)
    zero_pad: bool = attrs.field(default=False, validator=boolean)

    def prompt(self, a: int, b: int) -> str:
        """``"a+b="``; with ``zero_pad`` the operands have ``digits`` digits (07+48=)."""
        if self.zero_pad:
            return f"{a:0{self.digits}d}+{b:0{self.digits}d}="
        return f"{a}+{b}="

    def answer(self, a: int, b: int) -> str:
        """The target text of ``a + b`` (without <eos>)."""
        return self.write(a + b)

    def write(self, value: int) -> str:
        return str(value)[::-1] if self.reverse else str(value)

    def prompt_ids(self, tok: "CharTokenizer", a: int, b: int) -> list[int]:
        """The prompt's ids: <bos> + characters with the embedded tokenizer; with a model's own
        (fsdpfn.app.recipes.model.HFTokenizer), its encoding with the BOS it adds, if any."""
        return tok.prompt_ids(self.prompt(a, b))

    def answer_ids(self, tok: "CharTokenizer", value: int) -> list[int]:
        """``value`` as written by the task, then <eos> (the tokenizer's end-of-sequence token:
        the answer ends there, and the reward reads up to it)."""
        if tok.eos_id is None:
            raise ConfigError(f"model.path: the embedded addition task (no data.train_files) "
                              f"ends each answer with the tokenizer's end-of-sequence token, "
                              f"and the tokenizer in {str(getattr(tok, 'path', ''))!r} has "
                              f"none (eos_token); give data.train_files, or a tokenizer with "
                              f"one")
        return [*tok.encode(self.write(value)), tok.eos_id]

    def sample(self, n: int, *, seed: int) -> list[tuple[int, int]]:
        rng = random.Random(seed)
        hi = 10 ** self.digits
        return [(rng.randrange(hi), rng.randrange(hi)) for _ in range(n)]

    @property
    def max_answer_tokens(self) -> int:
        return self.digits + 2  # digits of the sum (one more than an operand) + <eos>

    def reward(self, a: int, b: int, completion: str) -> float:
        """1.0 when ``completion`` (the text before <eos>) is the decimal a+b, else 0.0."""
        text = completion.strip()[::-1] if self.reverse else completion.strip()
        if not text.isdigit() or (len(text) > 1 and text[0] == "0"):
            return 0.0
        return 1.0 if int(text) == a + b else 0.0


TinyModel = ModelConfig  # the embedded model's config (``ModelConfig()`` with path unset)


def save_initial_model(path: str | Path, model: TinyModel, tokenizer: CharTokenizer) -> Path:
    """Build the model (random init under ``model.seed``, float32) and write an HF directory
    with char_vocab.json."""
    from fsdpfn.app.recipes.model import write_initial_model

    return write_initial_model(model, Path(path), tokenizer)


# ---------------------------------------------------------------- batches in the public layout


def sequences_batch(seqs: list[tuple[list[int], list[bool]]]) -> TensorDict:
    """The public batch of (ids, loss) sequences: loss_mask True where loss is (never at t=0)."""
    import torch  # here, not at the top: the CLI reads recipe configs without importing torch
    from tensordict import TensorDict

    T = max(len(ids) for ids, _ in seqs)
    B = len(seqs)
    ids_t = torch.zeros(B, T, dtype=torch.int64)
    attn = torch.zeros(B, T, dtype=torch.bool)
    loss_t = torch.zeros(B, T, dtype=torch.bool)
    for i, (ids, loss) in enumerate(seqs):
        ids_t[i, :len(ids)] = torch.tensor(ids)
        attn[i, :len(ids)] = True
        loss_t[i, :len(ids)] = torch.tensor(loss, dtype=torch.bool)
    loss_t[:, 0] = False
    return TensorDict({K.INPUT_IDS: ids_t, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss_t},
                      batch_size=[B])


def sft_batch(task: AdditionTask, tok: CharTokenizer, n: int, *, seed: int) -> TensorDict:
    """n solved problems: prompt + correct answer, loss on the answer (digits and <eos>)."""
    from fsdpfn.batch.rows import pad_rows

    rows, plens = [], []
    for a, b in task.sample(n, seed=seed):
        prompt = task.prompt_ids(tok, a, b)
        rows.append(prompt + task.answer_ids(tok, a + b))
        plens.append(len(prompt))
    return pad_rows(rows, plens)


def wrong_answer(a: int, b: int, rng: random.Random) -> int:
    """A near miss: the sum with one digit changed (or off by one in the last digit)."""
    digits = list(str(a + b))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0"
                                                                  and len(digits) > 1)]
    digits[i] = rng.choice(choices)
    return int("".join(digits))
