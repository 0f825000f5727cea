"""A complete HF model directory built locally: a BPE tokenizer trained with ``tokenizers`` on the
user's texts (with a ChatML chat template), and a tiny causal LM sized to it. For testing recipes
end to end, as a user's own model directory would be used; nothing is downloaded.

    path = write_tiny_hf_dir(tmp_path / "model", texts=["What is 2+3? 5", ...])
    fsdpfn run my.yaml model.path=<path>
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

__all__ = ["CHATML_TEMPLATE", "TOOLS_CHAT_TEMPLATE", "train_tokenizer", "write_tiny_hf_dir"]

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 256):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts``; eos/pad
    ``<|endoftext|>``, ChatML chat template (``<|im_end|>`` ends an assistant turn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = CHATML_TEMPLATE
    return fast


# ChatML with Hermes-style tools, as Qwen2.5 writes them: for testing tool calls (write it to a
# tiny directory's chat_template.jinja)
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nFor each call return <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_hf_dir(path: str | Path, *, texts: Iterable[str], vocab_size: int = 256,
                      hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                      weights: bool = True) -> Path:
    """Write config.json, model.safetensors (random init under ``seed``; none with
    ``weights=False``), tokenizer files and generation_config.json (eos: ``<|endoftext|>`` and
    ``<|im_end|>``) into ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    path = Path(path)
    tok = train_tokenizer(texts, vocab_size=vocab_size)
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    config = Qwen2Config(vocab_size=len(tok), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         rms_norm_eps=1e-6, pad_token_id=eos[0], eos_token_id=eos[0],
                         bos_token_id=eos[0])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        if weights:
            model.save_pretrained(path, safe_serialization=True)
        else:
            config.save_pretrained(path)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    GenerationConfig(eos_token_id=eos, pad_token_id=eos[0]).save_pretrained(path)
    tok.save_pretrained(path)
    return path
