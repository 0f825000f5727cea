"""A float64 reference for the decode loop's float8 KV cache (``--kv-cache-dtype fp8_e4m3``).

    logits = cache_reference_logits(model, rows, prompt_lens, cached=float8_of(torch.float32))
    gaps = cache_logit_gaps(net, model, lengths, steps=4)  # a SlotModel on a float8 cache

The model's own modules in float64, its attention a plain float64 one (causal, GQA, the
model's scaling). With ``cached``, every query past its row's prompt attends k and v through
it, as the loop's decode steps read the cache; the prompt's own queries (the prefill, which
gives the first new token) attend them unrounded. Independent of the loop's code: what
tests/unit/test_decode.py (under Triton's interpreter) and tests/e2e/test_decode_gpu.py compare
the loop's logits with.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["cache_logit_gaps", "cache_reference_logits", "float8_of"]

NAME = "fsdpfn_cache_reference"


def float8_of(via: torch.dtype):
    """k or v as a float8 e4m3 cache holds them: rounded to ``via`` (the served dtype), then to
    float8 (to nearest even, saturating), as float64."""
    return lambda t: t.to(via).to(torch.float8_e4m3fn).to(torch.float64)


def _register(now: dict) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
        T, group = query.shape[2], query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        later = torch.ones(T, T, dtype=torch.bool, device=query.device).triu(1)

        def attend(k, v):
            scores = (query @ k.transpose(-1, -2)) * scaling
            return scores.masked_fill(later, float("-inf")).softmax(-1) @ v

        out = attend(k, v)
        if now["cached"] is not None:
            past = (torch.arange(T, device=query.device) >= now["prompt"])[None, None, :, None]
            out = torch.where(past, attend(now["cached"](k), now["cached"](v)), out)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)


def cache_reference_logits(model, rows, prompt_lens, cached=None) -> list[torch.Tensor]:
    """Each row's logits [len(row), V] in float64 from a float64 copy of ``model`` (an HF
    causal LM; it is not changed) on its device: ``rows`` token id lists, ``prompt_lens`` each
    row's prompt length, ``cached`` (see the module doc) or None for the unrounded model."""
    now = {"cached": cached, "prompt": 0}
    _register(now)
    ref = copy.deepcopy(model).to(torch.float64).eval()
    ref.set_attn_implementation(NAME)
    device = next(ref.parameters()).device
    out = []
    with torch.no_grad():
        for row, n in zip(rows, prompt_lens):
            now["prompt"] = int(n)
            out.append(ref(input_ids=torch.tensor([list(row)], device=device)).logits[0])
    return out


def cache_logit_gaps(net, model, lengths: torch.Tensor, steps: int, seed: int = 0) -> dict:
    """Prefill random prompts of ``lengths`` (one a slot, on ``net``'s device) into ``net``, a
    SlotModel of ``model`` over a float8 cache, run ``steps`` decode steps on random tokens, and
    return the largest logit gap of those steps to the float64 model reading k and v as the
    cache holds them ("float8": rounded to ``model``'s dtype, then float8) and to the
    unrounded one ("unrounded")."""
    device = net.device
    g = torch.Generator(device=device).manual_seed(seed)
    vocab, R = model.config.vocab_size, len(lengths)
    lengths = lengths.to(device)
    ids = torch.randint(0, vocab, (R, int(lengths.max())), generator=g, device=device)
    tokens = torch.randint(0, vocab, (steps, R), generator=g, device=device)
    slots = torch.arange(R, device=device)
    with torch.no_grad():
        net.prefill(ids, lengths, slots, slots)
        got = [net.decode(tok, lengths + i, net.max_len).double() for i, tok in enumerate(tokens)]
    n = lengths.tolist()
    rows = [torch.cat([ids[r, :n[r]], tokens[:, r]]).tolist() for r in range(R)]
    gaps = {}
    for name, cached in (("float8", float8_of(next(model.parameters()).dtype)),
                         ("unrounded", None)):
        refs = cache_reference_logits(model, rows, n, cached)
        gaps[name] = max(float((got[i][r] - refs[r][n[r] + i]).abs().max())
                         for r in range(R) for i in range(steps))
    return gaps
