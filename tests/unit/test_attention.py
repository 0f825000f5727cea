"""Packed attention on CPU: causal attention within each sequence of a packed row, against a
float64 softmax computed sequence by sequence (and against the dense block-causal mask)."""

from __future__ import annotations

import math

import pytest
import torch

from fsdpfn.engine.attention import block_causal_mask, packed_attention


def _reference(q, k, v, lens, scale):
    """float64, one sequence at a time, explicit causal softmax; [1, Hq, N, D] -> [1, N, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (t[0, :, start:start + n].double() for t in (q, k, v))
        scores = qs @ ks.transpose(-1, -2) * scale
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        out.append(torch.softmax(scores, -1) @ vs)
        start += n
    return torch.cat(out, 1).transpose(0, 1)[None]


@pytest.mark.parametrize("lens,hq,hkv", [([5, 1, 7], 4, 2), ([3], 2, 2), ([2, 9, 4, 1], 6, 1)])
def test_packed_attention_per_sequence_matches_float64(lens, hq, hkv):
    g = torch.Generator().manual_seed(sum(lens) + hq)
    n, d = sum(lens), 8
    q = torch.randn(1, hq, n, d, generator=g)
    k = torch.randn(1, hkv, n, d, generator=g)
    v = torch.randn(1, hkv, n, d, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    ref = _reference(q, k, v, lens, scale)
    out, _ = packed_attention(None, q, k, v, None, scaling=scale, cu_seq_lens_q=cu,
                              max_length_q=max(lens))
    assert out.shape == (1, n, hq, d)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    dense, _ = packed_attention(None, q, k, v, block_causal_mask(cu, n, "cpu"), scaling=scale)
    torch.testing.assert_close(dense.double(), ref, atol=1e-5, rtol=1e-5)
