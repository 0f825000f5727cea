"""Token log-probabilities and entropies, from logits or straight from hidden states.

`token_logprobs` / `token_entropy` take materialised logits[..., V]. `chunked_logprobs` takes the
last hidden states and the lm_head weight and never holds more than chunk_size x V logits: the
backward recomputes each chunk's logits instead of saving them. `vocab_parallel_logprobs` is the same
computation when the lm_head rows are split over a process group (tensor-parallel vocab): it reduces
the max, the sum of exponentials, the target logit and the entropy term, never an [N, V] tensor.

All math is float32, whatever the input dtype; gradients come back in the input dtypes.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.validators import check_temperature

__all__ = ["token_logprobs", "token_entropy", "chunked_logprobs", "vocab_parallel_logprobs",
           "vocab_shard_range", "liger_logprobs", "liger_available"]


def _scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


def _check_logits(logits) -> None:
    """BatchError unless ``logits`` is a tensor [..., V] with V >= 1: a 0-dim tensor has no
    vocabulary dimension to normalise over."""
    if not isinstance(logits, torch.Tensor):
        raise BatchError(f"logits: must be a torch.Tensor [..., V], got {type(logits).__name__}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise BatchError(f"logits: must have a vocabulary dimension of size >= 1 (shape "
                         f"[..., V]), got shape {tuple(logits.shape)}")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) gathered at targets.

    logits[..., V] (any float dtype), targets[...] int64 -> logp[...] float32.
    """
    temperature = check_temperature(temperature)
    _check_logits(logits)
    if not isinstance(targets, torch.Tensor):
        raise BatchError(f"targets: must be a torch.Tensor of token ids, got "
                         f"{type(targets).__name__}")
    if logits.shape[:-1] != targets.shape:
        raise BatchError(f"targets must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise BatchError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    _check_targets(targets, logits.shape[-1], "logits.shape[-1]")
    z = _scaled_logits(logits, temperature)  # (..., V) fp32
    picked = z.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def _check_targets(targets: torch.Tensor, vocab: int, source: str) -> None:
    """BatchError unless every target is a row of the head: in [0, V). Without it a target past
    the vocabulary is an index error on the CPU, a device assert on CUDA, and a finite but
    meaningless log-prob in the chunked head (which reads it as another shard's row)."""
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or not targets.numel():
        return  # the dtype is refused by the caller's own check; nothing to read
    bad = (targets < 0) | (targets >= vocab)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise BatchError(f"targets: must be token ids in [0, V) with V = {source} = {vocab}, got "
                         f"{int(targets[index])} at index {list(index)}")


def token_entropy(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature): logits[..., V] -> entropy[...] float32."""
    temperature = check_temperature(temperature)
    _check_logits(logits)
    z = _scaled_logits(logits, temperature)
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    # -inf logits contribute 0: logp is masked before the product, since p * logp would be
    # 0 * -inf = nan there, and its gradient nan on the whole row even where discarded
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)


# --------------------------------------------------------------------------------------------
# chunked core, shared by the single-device and the vocab-parallel paths
# --------------------------------------------------------------------------------------------

def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _local_targets(targets: torch.Tensor, vocab_start: int, v_local: int):
    """Index into the local vocab rows (clamped to a safe value) and whether it is really local."""
    local = targets - vocab_start
    in_range = (local >= 0) & (local < v_local)
    return local.clamp(0, max(v_local - 1, 0)), in_range


def _fast_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a @ b in a's half dtype with float32 output (tensor cores, fp32 accumulate and result),
    when the device supports it; None otherwise."""
    if a.device.type != "cuda" or a.dtype not in (torch.bfloat16, torch.float16):
        return None
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return None


def _mm32(a: torch.Tensor, b: torch.Tensor, half: torch.dtype | None) -> torch.Tensor:
    """float32 a @ b: through a half-precision tensor-core GEMM when ``half`` is given (the
    weight's dtype on CUDA), else in float32."""
    if half is not None:
        out = _fast_mm(a.to(half), b.to(half))
        if out is not None:
            return out
    return a.float() @ b.float()


def _half_dtype(weight: torch.Tensor) -> torch.dtype | None:
    if weight.device.type == "cuda" and weight.dtype in (torch.bfloat16, torch.float16):
        return weight.dtype
    return None


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, temperature: float,
                  half: torch.dtype | None, bias=None, softcap=None) -> torch.Tensor:
    """The head's logits of one chunk as the model computes them, then / temperature:
    h @ w.T (+ bias), softcapped as softcap * tanh(z / softcap) when the model caps them."""
    z = _mm32(h, w.t(), half)  # (c, V_local) fp32, a fresh buffer we may overwrite
    if bias is not None:
        z.add_(bias.float())
    if softcap is not None:
        z = z.div_(softcap).tanh_().mul_(softcap)
    return z if temperature == 1.0 else z.div_(temperature)


def _chunk_forward(z, targets, vocab_start, group, with_entropy):
    """From local logits z[c, V_local] to (lse, logp, entropy) of the full (all-rank) vocab."""
    c, v_local = z.shape
    m = z.amax(dim=-1) if v_local > 0 else z.new_full((c,), float("-inf"))
    _all_reduce(m, dist.ReduceOp.MAX, group)  # the max only stabilises exp; no grad through it
    shifted = z.sub_(m.unsqueeze(-1))  # (c, V_local), <= 0
    idx, in_range = _local_targets(targets, vocab_start, v_local)
    picked = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) if v_local > 0 else z.new_zeros(c)
    if with_entropy:
        e = shifted.exp()
        sums = [e.sum(-1), torch.where(in_range, picked, 0.0),
                e.mul_(shifted).sum(-1)]  # sum exp(z-m)(z-m), for the entropy
    else:  # one [c, V] buffer only: exponentiate in place
        sums = [shifted.exp_().sum(-1), torch.where(in_range, picked, 0.0)]
    sums = _all_reduce(torch.stack(sums), dist.ReduceOp.SUM, group)
    log_se = sums[0].log()
    lse = m + log_se
    logp = sums[1] - log_se
    # H = -sum p log p with log p = (z - m) - log_se
    entropy = log_se - sums[2] / sums[0] if with_entropy else None
    return lse, logp, entropy


def _chunk_grad_logits(z, lse, entropy, g, ge, targets, vocab_start, temperature):
    """d loss / d (h @ w.T) for one chunk, overwriting z.

    dlogp/dz = onehot(t) - p ; dH/dz = -p (log p + H) ; then divide by the temperature.
    """
    v_local = z.shape[1]
    s = z.sub_(lse.unsqueeze(-1))  # log p, (c, V_local)
    p = s.exp()
    if ge is not None:
        coef = s.add_(entropy.unsqueeze(-1)).mul_(ge.unsqueeze(-1))
        if g is not None:
            coef.add_(g.unsqueeze(-1))
        grad = p.mul_(coef).neg_()
    else:
        grad = p.mul_(-g.unsqueeze(-1))
    if g is not None and v_local > 0:
        idx, in_range = _local_targets(targets, vocab_start, v_local)
        grad.scatter_add_(1, idx.unsqueeze(-1), torch.where(in_range, g, 0.0).unsqueeze(-1))
    return grad if temperature == 1.0 else grad.div_(temperature)


class _ChunkedLogprobs(torch.autograd.Function):
    """hidden[N, H], weight[V_local, H], targets[N] -> (logp[N], entropy[N] or empty)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, temperature, with_entropy, group,
                vocab_start, bias, softcap):
        n = hidden.shape[0]
        half = _half_dtype(weight)
        w_mm = weight if half is not None else weight.float()
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=torch.float32)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = _chunk_logits(hidden[s:e], w_mm, temperature, half, bias, softcap)
            lse[s:e], logp[s:e], ent = _chunk_forward(z, targets[s:e], vocab_start, group, with_entropy)
            if with_entropy:
                entropy[s:e] = ent
            del z
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, bias)
        ctx.cfg = (chunk_size, temperature, with_entropy, group, vocab_start, softcap)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy, bias = ctx.saved_tensors
        chunk_size, temperature, with_entropy, group, vocab_start, softcap = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[8]
        if not with_entropy:
            grad_entropy = None
        n = hidden.shape[0]
        half = _half_dtype(weight)
        w_mm = weight if half is not None else weight.float()
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        if grad_logp is not None or grad_entropy is not None:
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                h = hidden[s:e] if half is not None else hidden[s:e].float()
                z = _chunk_logits(h, w_mm, temperature, half, bias, softcap)
                # d softcap*tanh(x/softcap) / dx = 1 - tanh², tanh = z * temperature / softcap
                cap_grad = None if softcap is None else \
                    1.0 - (z * (temperature / softcap)).square_()
                gz = _chunk_grad_logits(
                    z, lse[s:e], entropy[s:e] if grad_entropy is not None else None,
                    None if grad_logp is None else grad_logp[s:e].float(),
                    None if grad_entropy is None else grad_entropy[s:e].float(),
                    targets[s:e], vocab_start, temperature)
                if cap_grad is not None:
                    gz.mul_(cap_grad)
                if need_b:
                    grad_b.add_(gz.sum(0))
                if need_h:
                    grad_h[s:e] = _mm32(gz, w_mm, half)
                if need_w and half is not None:
                    grad_w.add_(_mm32(gz.t(), h, half))
                elif need_w:
                    grad_w.addmm_(gz.t(), h)
                del z, gz, cap_grad
        if need_h and n > 0:
            # each rank only saw its vocab rows: the hidden grad is the sum over the group
            _all_reduce(grad_h, dist.ReduceOp.SUM, group)
        return (None if grad_h is None else grad_h.to(hidden.dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None, None, None, None, None, None,
                None if grad_b is None else grad_b.to(bias.dtype), None)


def _chunked(hidden, weight, targets, chunk_size, temperature, with_entropy, group, vocab_start,
             bias=None, softcap=None):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    temperature = check_temperature(temperature)
    if weight.dim() != 2:
        raise BatchError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise BatchError(f"hidden must be [..., H] with H = weight.shape[1] = {weight.shape[1]}, "
                         f"got shape {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise BatchError(f"targets must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise BatchError(f"targets must be an integer tensor, got dtype {targets.dtype}")
    if bias is not None and tuple(bias.shape) != tuple(weight.shape[:1]):
        raise BatchError(f"bias must be [V] with V = weight.shape[0] = {weight.shape[0]}, got "
                         f"shape {tuple(bias.shape)}")
    if softcap is not None and not float(softcap) > 0:
        raise ConfigError(f"softcap must be > 0 or None, got {softcap!r}")
    lead = targets.shape
    logp, entropy = _ChunkedLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).long(),
        chunk_size, temperature, bool(with_entropy), group, int(vocab_start), bias,
        None if softcap is None else float(softcap))
    return logp.reshape(lead), (entropy.reshape(lead) if with_entropy else None)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                     chunk_size: int = 1024, temperature: float = 1.0, with_entropy: bool = False,
                     bias: torch.Tensor | None = None, softcap: float | None = None):
    """Log-probabilities of targets under softmax(z / temperature), chunked, with the head's
    logits z = hidden @ weight.T (+ ``bias`` [V]), capped as softcap * tanh(z / softcap) when
    ``softcap`` is given (Gemma-2/3's final_logit_softcapping).

    hidden[N, H] (or [..., H]), weight[V, H] (lm_head), targets[N] int -> (logp[N] float32,
    entropy[N] float32 or None). At most chunk_size x V float32 logits exist at a time (a small
    constant number of such buffers), in the forward and in the backward, which recomputes each
    chunk's logits from the saved hidden and weight. Grads flow to hidden and weight, in their dtypes.
    A target outside [0, V) is a BatchError.
    """
    if targets.shape == hidden.shape[:-1]:  # else _chunked names the shape
        _check_targets(targets, weight.shape[0], "weight.shape[0]")
    return head_logprobs(hidden, weight, targets, chunk_size=chunk_size, temperature=temperature,
                         with_entropy=with_entropy, bias=bias, softcap=softcap)


def head_logprobs(hidden, weight, targets, *, chunk_size: int = 1024, temperature: float = 1.0,
                  with_entropy: bool = False, bias=None, softcap=None):
    """``chunked_logprobs`` without its range check of the targets (a device sync): the
    engine's head, whose batches were checked against the vocabulary before (validate_batch)."""
    return _chunked(hidden, weight, targets, chunk_size, temperature, with_entropy, None, 0,
                    bias, softcap)


def vocab_shard_range(vocab_size: int, n_shards: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of a [vocab_size, H] matrix held by shard ``index`` of ``n_shards``
    under torch.chunk's split (DTensor's Shard(0)): ceil(V / n) rows each, the last shards
    shorter or empty when n does not divide V. No padding rows exist anywhere."""
    if n_shards < 1 or not 0 <= index < n_shards or vocab_size < 0:
        raise ConfigError(f"vocab_shard_range: needs 0 <= index < n_shards and vocab_size >= 0, "
                          f"got index={index}, n_shards={n_shards}, vocab_size={vocab_size}")
    rows = -(-vocab_size // n_shards)
    return min(index * rows, vocab_size), min((index + 1) * rows, vocab_size)


def vocab_parallel_logprobs(hidden: torch.Tensor, weight_shard: torch.Tensor, targets: torch.Tensor, *,
                            group, vocab_start: int, chunk_size: int = 1024, temperature: float = 1.0,
                            with_entropy: bool = False, bias: torch.Tensor | None = None,
                            softcap: float | None = None):
    """`chunked_logprobs` with the lm_head rows split over the ranks of `group`.

    weight_shard[V_local, H] holds rows vocab_start .. vocab_start + V_local of the full [V, H]
    weight; hidden[N, H] and targets[N] (global vocab ids) must be identical on every rank of
    group. Every rank gets the same (logp[N], entropy[N] or None). Per chunk the forward all-reduces
    the max (MAX) and one stacked SUM of (sum of exp, target logit, sum of exp * logit); no [N, V]
    tensor is ever gathered. In the backward, the grad of hidden is all-reduced (SUM) over group and
    the grad of weight_shard stays local. Every rank must call it with the same N and chunk_size.
    """
    if group is None:
        raise ConfigError("group must be a torch.distributed process group, got None "
                          "(use chunked_logprobs for an unsharded lm_head)")
    if int(vocab_start) < 0:
        raise ConfigError(f"vocab_start must be >= 0, got {vocab_start!r}")
    return _chunked(hidden, weight_shard, targets, chunk_size, temperature, with_entropy, group,
                    vocab_start, bias, softcap)


# --------------------------------------------------------------------------------------------
# Liger-Kernel's fused linear cross-entropy (CUDA, optional)
# --------------------------------------------------------------------------------------------


def liger_available(device: torch.device | str) -> bool:
    """Liger-Kernel's fused linear cross-entropy can run here: CUDA and liger_kernel present."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import (  # noqa: F401
            LigerFusedLinearCrossEntropyFunction)
    except ImportError:
        return False
    return True


def liger_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   temperature: float = 1.0) -> torch.Tensor:
    """The same quantity as ``chunked_logprobs`` (log_softmax(hidden @ weight.T / T)[targets],
    float32 [N]) through Liger-Kernel's fused linear cross-entropy with reduction="none" (its
    per-token loss is -logp; its backward recomputes the logits chunk by chunk). CUDA only; no
    entropy. Liger rounds each chunk's logits to the input dtype before its float32 softmax,
    where chunked_logprobs keeps float32 logits: the two differ by that rounding (bf16: ~1e-2)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    temperature = check_temperature(temperature)
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise BatchError(f"hidden [N, H] and weight [V, H] must agree on H, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise BatchError(f"targets must have shape [N] = {tuple(hidden.shape[:1])}, got "
                         f"{tuple(targets.shape)}")
    h = hidden if temperature == 1.0 else hidden / temperature
    loss = LigerFusedLinearCrossEntropyFunction.apply(
        h.contiguous(), weight, targets.long().contiguous(), None, None, -100, 0.0, 0.0,
        "none", None, False, torch.float32)[0]
    return -loss.float()
