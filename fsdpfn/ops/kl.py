"""Per-token KL estimators between the policy and a reference policy (Schulman's k1/k2/k3)."""

from __future__ import annotations

import torch

from fsdpfn.errors import ConfigError
from fsdpfn.ops.aggregate import check_same_shape

__all__ = ["kl", "KL_KINDS"]

KL_KINDS = ("k1", "k2", "k3", "abs")


def kl(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from sampled-token log-probs; logp[...], ref_logp[...]
    of one shape (BatchError otherwise).

    k1 = logp - ref; k2 = 1/2 (logp - ref)^2; k3 = exp(ref - logp) - (ref - logp) - 1 clamped to
    [-10, 10]; abs = |logp - ref|. float32 out. There is no mask: callers select masked tokens.
    """
    if kind not in KL_KINDS:
        raise ConfigError(f"kind must be one of {list(KL_KINDS)}, got {kind!r}")
    check_same_shape("logp", logp, ref_logp=ref_logp)
    d = logp.float() - ref_logp.float()  # log ratio pi / ref
    if kind == "k1":
        return d
    if kind == "k2":
        # the same values as d.square() / 2, but a zero upstream gradient stays zero where d is
        # finite and d * d is not (square's backward forms 2 * d, inf past 1.7e38, and 0 * inf)
        return (0.5 * d) * d
    if kind == "abs":
        return d.abs()
    # k3 > 10 already for |ref - logp| > 12, so clamping the exponent first changes no value and no
    # (zero) gradient, and keeps exp from overflowing to inf (inf * 0 = nan in the backward)
    neg = (-d).clamp(-20.0, 20.0)
    return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)
