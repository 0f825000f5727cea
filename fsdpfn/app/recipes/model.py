"""The recipes' model and tokenizer: a user's HF directory, or the embedded tiny Qwen2.

    model:
      path: /models/Qwen2.5-1.5B-Instruct     # config.json, *.safetensors, tokenizer files
      random_init: false                       # true: same architecture, weights drawn under seed

With ``path`` unset, the embedded default is used: a small Qwen2 built in code (``hidden_size``,
``num_layers``, ... below) with fsdpfn's character tokenizer, nothing downloaded. With ``path``,
the tokenizer and its chat template come from that directory (``AutoTokenizer``), so the rollout
server, the rewards and the trainer all read the same text.

A tokenizer here is anything with ``encode(text) -> ids``, ``decode(ids) -> text`` (up to the
first stop token), ``stop_ids``, ``pad_id``, ``vocab_size``, ``prompt_ids(prompt)`` (a string,
or chat messages rendered with the chat template and its generation prompt) and ``save(dir)``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs

from fsdpfn.validators import boolean, fail, integer, is_nonempty_str, satisfies, seed_int
from fsdpfn.errors import ConfigError
from fsdpfn.engine.weight_files import no_safetensors

__all__ = ["ModelConfig", "CharTokenizer", "HFTokenizer", "load_tokenizer", "check_model_dir",
           "read_config_json", "standard_names", "text_model_config", "check_weight_headers",
           "initial_model_dir", "write_initial_model", "prepare_initial_model", "has_weights",
           "TOKENIZER_FILES"]

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARS = "0123456789+="  # the embedded addition task's characters

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "generation_config.json",
                   "char_vocab.json")


_opt_path = satisfies("must be null or a directory path", is_nonempty_str, optional=True,
                      section="model.")


_DEFAULT_HIDDEN = 128


@attrs.frozen
class ModelConfig:
    """``path``: a local HF causal-LM directory (config.json, safetensors, tokenizer), or a
    Hugging Face hub model id (``org/name``), which the launcher resolves to its snapshot in
    the Hugging Face cache, downloading what is missing (fsdpfn.app.recipes.sources); None: the
    embedded tiny Qwen2 (the fields below) with the character tokenizer. ``random_init``: build
    ``path``'s architecture from its config.json with fresh weights, HF's init drawn on the
    trainer's devices under the run's ``seed``; the directory then needs no weights. ``seed`` and
    the size fields apply to the embedded model only."""

    path: str | None = attrs.field(default=None, validator=_opt_path)
    random_init: bool = attrs.field(default=False, validator=boolean)
    hidden_size: int = attrs.field(default=_DEFAULT_HIDDEN, validator=integer(8))
    intermediate_size: int = attrs.field(default=256, validator=integer(8))
    num_layers: int = attrs.field(default=2, validator=integer(1))
    num_heads: int = attrs.field(default=8, validator=integer(1))
    num_kv_heads: int = attrs.field(default=4, validator=integer(1))
    seed: int = attrs.field(default=0, validator=seed_int)

    def __attrs_post_init__(self):
        """Keys that apply to one kind of model only are refused on the other, never
        ignored."""
        if self.path is None:
            if self.random_init:
                fail("random_init", "must be false without model.path (the embedded model is "
                     "always built fresh, under model.seed)", self.random_init)
            head, rest = divmod(self.hidden_size, self.num_heads)
            why = "the rotary embedding turns pairs of a head's dimensions"
            if (rest or head % 2) and self.hidden_size == _DEFAULT_HIDDEN:  # num_heads was set
                fail("num_heads", f"must divide hidden_size ({self.hidden_size}) into heads of "
                     f"an even size ({why})", self.num_heads)
            if rest or head % 2:
                fail("hidden_size", f"must be num_heads ({self.num_heads}) x an even head size "
                     f"({why})", self.hidden_size)
            return
        for a in attrs.fields(type(self)):
            if a.name not in ("path", "random_init") and getattr(self, a.name) != a.default:
                fail(a.name, "applies to the embedded model only (model.path's config.json "
                     "sets the shape; the run's seed the init of random_init)",
                     getattr(self, a.name))

    @property
    def embedded(self) -> bool:
        return self.path is None

    def config_dict(self, vocab_size: int) -> dict:
        """The embedded model's config.json fields that set its shape (what the launcher's
        memory and position checks read, without importing transformers: 4 s of every
        launch)."""
        return {"model_type": "qwen2", "vocab_size": vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "max_position_embeddings": 128,
                "tie_word_embeddings": False}

    def hf_config(self, vocab_size: int):
        """The embedded model's transformers config."""
        from transformers import Qwen2Config

        fields = {k: v for k, v in self.config_dict(vocab_size).items() if k != "model_type"}
        return Qwen2Config(**fields, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2)


def check_model_dir(cfg: ModelConfig, *, weights: bool = True) -> None:
    """Fail before any rank starts: the directory, its config, weights and tokenizer.
    ``weights`` False: the weights are not there yet (a hub model's dry run)."""
    if cfg.embedded:
        return
    path = Path(cfg.path)
    if not path.is_dir():
        raise ConfigError(f"model.path: must be an existing directory (or a Hugging Face hub "
                          f"model id, org/name), got {cfg.path!r}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: must hold a transformers config.json, got {cfg.path!r} "
                          f"(no config.json)")
    read_config_json(path)
    if weights and not cfg.random_init and not has_weights(path):
        raise no_safetensors("model.path", cfg.path, "must hold *.safetensors weights (or set "
                             "model.random_init=true)")
    if weights and not cfg.random_init:
        check_weight_headers(path)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model",
                                                    "vocab.json", "char_vocab.json")):
        raise ConfigError(f"model.path: must hold a tokenizer (tokenizer.json, tokenizer.model "
                          f"or vocab.json), got {cfg.path!r} (no tokenizer files)")


# what the preflight reads of every config.json, under transformers' standard names
STANDARD_NAMES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def standard_names(data: dict, path: str | Path) -> dict:
    """``data`` (a config.json) with the standard names the preflight reads. A family that
    spells them its own way (GPT-2's n_embd, n_layer, n_head, n_positions; MPT's d_model) is
    read through its config class's ``attribute_map``, transformers being imported for such a
    family only; a missing ``intermediate_size`` is the family's own (n_inner, ffn_dim,
    ffn_hidden_size, dff) or 4 x hidden_size, the feed-forward width those families default
    to. A name that none of this gives is a ConfigError naming it, the file and the
    model_type."""
    if all(k in data for k in STANDARD_NAMES) and "intermediate_size" in data:
        return data
    out = dict(data)
    kind = data.get("model_type")
    try:
        from transformers import CONFIG_MAPPING
        aliases = getattr(CONFIG_MAPPING[kind], "attribute_map", None) or {}
    except (ImportError, KeyError):  # no transformers here, or a model_type it does not know
        aliases = {}
    for name, own in aliases.items():
        if out.get(name) is None and data.get(own) is not None:
            out[name] = data[own]
    missing = [k for k in STANDARD_NAMES if not isinstance(out.get(k), int)]
    if missing:
        raise ConfigError(f"model.path: config.json must give the model's {missing[0]} (an "
                          f"integer, under that name or its family's own), got none in "
                          f"{str(Path(path) / 'config.json')!r} (model_type {kind!r})")
    if not isinstance(out.get("intermediate_size"), int):
        out["intermediate_size"] = next(
            (data[k] for k in ("n_inner", "ffn_dim", "ffn_hidden_size", "dff")
             if isinstance(data.get(k), int)), 4 * out["hidden_size"])
    return out


def text_model_config(path: str | Path) -> dict:
    """The directory's config.json as the preflight and the recipes read it: the text model's
    (``text_config`` of a multimodal config), under the standard names (standard_names)."""
    data = read_config_json(path)
    if "hidden_size" not in data and isinstance(data.get("text_config"), dict):
        data = data["text_config"]
    return standard_names(data, path)


def read_config_json(path: str | Path) -> dict:
    """The directory's config.json as a dict, or a ConfigError naming the file and json's
    reason (a truncated or hand-edited file)."""
    file = Path(path) / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: config.json must be a JSON object, got {str(file)!r} "
                          f"({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.path: config.json must be a JSON object, got {str(file)!r} "
                          f"(a {type(data).__name__})")
    return data


def check_weight_headers(path: str | Path) -> None:
    """Each *.safetensors file's header reads and covers the file (safetensors checks it
    against the file's size): a truncated or corrupt download is refused here, by name. Only
    the headers are read, no tensor."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy") as handle:
                handle.keys()
        except (SafetensorError, OSError) as exc:
            raise ConfigError(f"model.path: each *.safetensors file must be a readable "
                              f"safetensors file, got {str(file)!r} ({exc})") from None


class CharTokenizer:
    """ids 0..2 are <pad>, <bos>, <eos>; then one id per character of ``0123456789+=``."""

    def __init__(self):
        self.itos = [PAD, BOS, EOS, *CHARS]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.stop_ids = [self.eos_id]

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text]

    def prompt_ids(self, prompt: str) -> list[int]:
        """<bos> then the characters (HFTokenizer.prompt_ids: the tokenizer's own BOS if any)."""
        return [self.bos_id, *self.encode(prompt)]

    def decode(self, ids, *, stop_at_eos: bool = True) -> str:
        """The text of ``ids`` without <pad>/<bos>, up to the first <eos> (or showing it)."""
        out = []
        for i in ids:
            if stop_at_eos and i == self.eos_id:
                break
            if i not in (self.pad_id, self.bos_id):
                out.append(self.itos[i])
        return "".join(out)

    def save(self, directory: str | Path) -> Path:
        """Write ``char_vocab.json`` (the id -> symbol table) next to a model."""
        path = Path(directory) / "char_vocab.json"
        path.write_text(json.dumps({"itos": self.itos, "pad": 0, "bos": 1, "eos": 2}, indent=1))
        return path



class HFTokenizer:
    """A transformers tokenizer behind the recipes' small tokenizer interface."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        self.path = Path(path)
        try:
            self.tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # noqa: BLE001 - any loader failure is a config problem here
            raise ConfigError(f"model.path: the tokenizer in {str(path)!r} does not load "
                              f"({type(exc).__name__}: {exc})") from None
        stops = []
        eos = self.tok.eos_token_id
        if eos is not None:
            stops.append(int(eos))
        gen = self.path / "generation_config.json"
        if gen.is_file():
            import json

            ids = json.loads(gen.read_text()).get("eos_token_id")
            for i in ids if isinstance(ids, list) else [ids]:
                if i is not None and int(i) not in stops:
                    stops.append(int(i))
        self.stop_ids = stops
        pad = self.tok.pad_token_id
        self.pad_id = int(pad if pad is not None else (stops[0] if stops else 0))
        self.eos_id = stops[0] if stops else None
        self.vocab_size = len(self.tok)
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))
        # special tokens (a chat template's end-of-turn markers among them)
        self.special_ids = {int(i) for i in self.tok.all_special_ids} | {
            int(i) for i, t in getattr(self.tok, "added_tokens_decoder", {}).items()
            if getattr(t, "special", False)}

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        """The text up to the first stop token; ids past the tokenizer's vocabulary (a model's
        embedding is often padded beyond it) are left out."""
        out = []
        for t in ids:
            if t in self.stop_ids:
                break
            if 0 <= t < self.vocab_size:
                out.append(t)
        return self.tok.decode(out, skip_special_tokens=True)

    def prompt_ids(self, prompt) -> list[int]:
        """A string (tokenized as is, with the tokenizer's own BOS if it adds one) or chat
        messages (the chat template with its generation prompt)."""
        if isinstance(prompt, str):
            return list(self.tok.encode(prompt, add_special_tokens=True))
        return self.chat_ids(prompt, generation_prompt=True)

    def chat_ids(self, messages, *, generation_prompt: bool) -> list[int]:
        if not self.has_chat_template:
            raise ConfigError(f"data: chat messages (and data.chat_template: true) need the "
                              f"tokenizer's chat template, and the tokenizer in "
                              f"{str(self.path)!r} has none (no chat_template.jinja, no "
                              f"chat_template in tokenizer_config.json); add one there, use an "
                              f"instruct model's tokenizer, or give the rows as plain strings")
        out = self.tok.apply_chat_template(list(messages), tokenize=True,
                                           add_generation_prompt=generation_prompt)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def save(self, directory: str | Path) -> None:
        self.tok.save_pretrained(str(directory))


def load_tokenizer(cfg: ModelConfig):
    """The embedded character tokenizer, or ``model.path``'s."""
    if cfg.embedded:
        return CharTokenizer()
    check_model_dir(cfg, weights=False)  # the weights are the engine's to check
    return HFTokenizer(cfg.path)


def initial_model_dir(cfg: ModelConfig, run_dir: Path) -> Path:
    """Where the run's starting weights are: ``model.path`` itself, or run_dir/model0 (the
    embedded model, or ``random_init``), which trainer rank 0 writes (prepare_initial_model)."""
    if cfg.embedded or cfg.random_init:
        return Path(run_dir) / "model0"
    return Path(cfg.path)


def prepare_initial_model(cfg: ModelConfig, run_dir: Path, *, rank: int,
                          timeout_s: float = 600.0) -> None:
    """run_dir/model0 as a trainer rank starts (the embedded model, or ``random_init``'s config
    and tokenizer; nothing for a ``model.path`` with weights). Rank 0 writes it: it imports
    the modelling code anyway, which the launcher would otherwise import only for this, 4 s
    before any rank could start. The other ranks wait for its config.json (the directory
    appears whole, by a rename), as the launcher's rollout servers do (``--wait-for-model``).
    A rank 0 that fails first ends the run through the launcher; ``timeout_s`` bounds the wait
    of a rank started any other way."""
    if not (cfg.embedded or cfg.random_init):
        return
    path = initial_model_dir(cfg, run_dir)
    if rank == 0:
        write_initial_model(cfg, path, load_tokenizer(cfg))
        return
    if cfg.embedded:  # every rank builds it next: its import (3 s) runs beside rank 0's write
        import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from fsdpfn.rollout.process import wait_for_model_dir

    if not wait_for_model_dir(path, timeout_s):
        raise TimeoutError(f"trainer rank {rank}: {path} has no config.json after "
                           f"{timeout_s:g} s (trainer rank 0 writes it as it starts)")


def has_weights(path: str | Path) -> bool:
    """Whether an HF model directory holds weights (``model.random_init`` run directories hold
    only the config and the tokenizer: the trainer draws the weights on its devices)."""
    return any(Path(path).glob("*.safetensors"))


def write_initial_model(cfg: ModelConfig, path: Path, tokenizer) -> Path:
    """run_dir/model0: the embedded model (its weights drawn under seed, float32), or for
    ``random_init`` the user's config and tokenizer files alone. No weights are drawn here for
    ``random_init``: the trainer draws HF's init on its own devices, piece by piece, under the
    run's seed (fsdpfn.engine.load_weights), the server starts on placeholder weights
    (``--load-format dummy``) and the first push gives it the trainer's. Drawing a 7B model on
    one process's CPU and writing it to disk held the start-up for minutes."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if cfg.embedded:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        with torch.random.fork_rng(devices=[]):  # the caller's CPU generator is left as it was
            torch.manual_seed(cfg.seed)
            hf = AutoModelForCausalLM.from_config(cfg.hf_config(tokenizer.vocab_size),
                                                  dtype=torch.float32)
        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            hf.save_pretrained(tmp, safe_serialization=True)
        finally:
            if bar_was_on:
                hf_logging.enable_progress_bar()
        tokenizer.save(tmp)
    else:
        tmp.mkdir(parents=True)
        for name in ("config.json", *TOKENIZER_FILES):
            if (Path(cfg.path) / name).is_file():
                shutil.copy(Path(cfg.path) / name, tmp / name)
    tmp.rename(path)
    return path
