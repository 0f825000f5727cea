"""The options a model's own head and attention apply, against float64 written out here:
- the chunked log-prob head with an lm_head bias and final-logit softcapping (values and gradients
  of hidden, weight and bias, any chunking, with and without entropy);
- the packed attention with a sliding window and attention-logit softcapping, sequence by sequence.
"""

from __future__ import annotations

import math

import pytest
import torch

from fsdpfn.engine.attention import packed_attention
from fsdpfn.ops import chunked_logprobs


def _head_reference(h, w, b, t, softcap, temperature):
    z = h.double() @ w.double().t() + b.double()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    logp_all = torch.log_softmax(z / temperature, -1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, t[:, None])[:, 0], entropy


@pytest.mark.parametrize("softcap,temperature,chunk", [(None, 1.0, 4), (3.0, 1.0, 5),
                                                       (2.0, 0.7, 64)])
def test_chunked_head_with_bias_and_softcap_matches_float64(softcap, temperature, chunk):
    g = torch.Generator().manual_seed(7)
    n, hdim, vocab = 13, 8, 11
    h = torch.randn(n, hdim, generator=g, requires_grad=True)
    w = torch.randn(vocab, hdim, generator=g, requires_grad=True)
    b = torch.randn(vocab, generator=g, requires_grad=True)
    t = torch.randint(0, vocab, (n,), generator=g)
    gl, ge = torch.randn(n, generator=g), torch.randn(n, generator=g)
    logp, entropy = chunked_logprobs(h, w, t, chunk_size=chunk, temperature=temperature,
                                     with_entropy=True, bias=b, softcap=softcap)
    ((logp * gl).sum() + (entropy * ge).sum()).backward()
    got = [x.grad.clone() for x in (h, w, b)]
    for x in (h, w, b):
        x.grad = None
    ref_logp, ref_entropy = _head_reference(h, w, b, t, softcap, temperature)
    ((ref_logp * gl.double()).sum() + (ref_entropy * ge.double()).sum()).backward()
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=0)
    for mine, x in zip(got, (h, w, b)):
        torch.testing.assert_close(mine.double(), x.grad.double(), atol=1e-5, rtol=1e-5)


def _attention_reference(q, k, v, lens, scale, window, softcap):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (x[0, :, start:start + n].double() for x in (q, k, v))
        scores = qs @ ks.transpose(-1, -2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        i = torch.arange(n)
        allowed = (i[None] <= i[:, None]) & (i[:, None] - i[None] < (window or n))
        out.append(torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vs)
        start += n
    return torch.cat(out, 1).transpose(0, 1)[None]


@pytest.mark.parametrize("window,softcap", [(3, None), (None, 2.0), (4, 1.5), (50, None)])
def test_packed_attention_window_and_softcap_match_float64(window, softcap):
    g = torch.Generator().manual_seed(11)
    lens, hq, hkv, d = [9, 1, 14, 5], 4, 2, 8
    n = sum(lens)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(24)  # not 1/sqrt(d): a query_pre_attn_scalar of its own
    out, _ = packed_attention(None, q, k, v, None, scaling=scale, cu_seq_lens_q=cu,
                              max_length_q=max(lens), sliding_window=window, softcap=softcap)
    ref = _attention_reference(q, k, v, lens, scale, window, softcap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
