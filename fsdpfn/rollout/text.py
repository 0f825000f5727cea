"""The served model's tokenizer, for the text fields of /generate and the OpenAI endpoints.

``load_tokenizer(model_dir)``: the directory's transformers tokenizer (AutoTokenizer) when it has
one, the character vocabulary of the embedded model (char_vocab.json) otherwise, or None (then
text fields are refused by name). ``eos_ids(model_dir, tokenizer)``: the ids that end a sequence
unless a request sets ignore_eos: generation_config.json's eos_token_id, else config.json's, else
the tokenizer's.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

__all__ = ["CharVocab", "load_tokenizer", "eos_ids"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class CharVocab:
    """char_vocab.json behind the small interface the server uses: encode, decode, a token's
    text; no chat template."""

    chat_template = None

    def __init__(self, path: Path):
        table = json.loads(path.read_text())
        self.itos: list[str] = list(table["itos"])
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.special = {int(table[k]) for k in ("pad", "bos", "eos")
                        if table.get(k) is not None}
        self.eos_token_id = table.get("eos")

    def encode(self, text: str) -> list[int]:
        missing = sorted({c for c in text if c not in self.stoi})
        if missing:
            raise ValueError(f"characters {missing[:8]} are not in the model's char_vocab.json")
        return [self.stoi[c] for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.itos[i] for i in ids
                       if 0 <= i < len(self.itos) and not (skip_special_tokens
                                                           and i in self.special))

    def token_bytes(self, token: int) -> list[int]:
        return list(self.decode([token], skip_special_tokens=False).encode())


class HFText:
    """A transformers tokenizer behind the same interface (prompts encoded without special
    tokens added, as SGLang does for input_ids it is given as text)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.chat_template = getattr(tokenizer, "chat_template", None)
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token: int) -> list[int]:
        """The token's own bytes (OpenAI's ``bytes`` of a log-prob entry): its text's UTF-8 where
        the token decodes alone; a byte piece (part of a character, which decodes alone to
        "\ufffd") from its vocabulary entry: byte-level BPE's character per byte, or
        sentencepiece's "<0xNN>"."""
        text = self.tok.decode([token], skip_special_tokens=False)
        if "\ufffd" not in text:
            return list(text.encode())
        piece = self.tok.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            if byte:
                return [int(byte.group(1), 16)]
            table = _byte_level()
            if piece and all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(text.encode())

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=True)


@functools.cache
def _byte_level() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's table), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def load_tokenizer(model_dir: str | Path):
    """HFText, CharVocab or None (see the module doc)."""
    path = Path(model_dir)
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return HFText(AutoTokenizer.from_pretrained(str(path)))
    if (path / "char_vocab.json").is_file():
        return CharVocab(path / "char_vocab.json")
    return None


def eos_ids(model_dir: str | Path, tokenizer) -> list[int]:
    path = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            value = json.loads(file.read_text()).get("eos_token_id")
            if value is not None:
                return [int(v) for v in (value if isinstance(value, list) else [value])]
    value = getattr(tokenizer, "eos_token_id", None)
    return [] if value is None else [int(value)]
