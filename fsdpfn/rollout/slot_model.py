"""The decode loop's network: the HF model's own modules run on a slot KV cache.

What is kept from transformers: the embedding, norms, q/k/v/o projections (and Qwen3's per-head q/k
norms), MLPs, rotary tables and lm_head, with their parameters, so a weight update that re-points
the parameters is what the next step reads. What is ours: the KV cache ([S, kv_heads, L, D] per
layer, one row per slot) and attention. Prefill runs whole right-padded prompts with causal SDPA
and copies each prompt's KV into its slots; decode runs one token per slot, GQA attended as G
"positions" of each kv head (q [R, kv, G, D] against the cache [R, kv, L, D]), so the cache is read
once and never repeated per query head. ``attention="triton"`` (``"auto"``'s choice on CUDA in
bf16/fp16, with Triton) reads each row's own cache length in place with fsdpfn's split-KV kernel
(fsdpfn/rollout/attention_kernel.py), the fastest of these paths. ``attention="flash"`` does the
same with torch's variable-length flash forward with ``seqused_k``, the cache seen as slots x kv
heads sequences of max_len positions, each attended by its kv head's G query heads as G query
positions; no mask and no padded column (faster than the masked SDPA), but its query tile is mostly
padding. ``compile=True`` runs the decode step through torch.compile (dynamic shapes: compiled
once, on first use). ``attention="flex"`` runs the decode attention through torch's FlexAttention
instead (compiled once with dynamic shapes; its decoding kernel splits each row's cache over
blocks; the causal limit is a score_mod on the rows' positions, no mask tensor).
``attention="matmul"`` runs it as two batched matmuls over the cache (scores with fp32 output,
softmax in fp32, probabilities in the model dtype times V), each reading the cache once; it is
slower than SDPA, kept as a reference path. The decode step projects q, k and v with one matmul
from fused buffers (refresh_weights copies the served weights in after every change) and rotates q
and k together with a rolled formula, bit-identical to HF's (Liger-Kernel's rotary kernel is not
used: it saves little of a step and doubles the served log-probs' gap to the trainer's
forward_logp). ``rope_kv="triton"`` (CUDA, a half dtype, no q/k norms; ``"auto"``, the default,
takes it where it runs) does that rotary, q's layout and the k and v writes into the cache in one
kernel a layer instead of seven (fsdpfn/rollout/rope_kernel.py), bit for bit the same: 6.38
against 7.50 ms a step at 512 rows of the 1.5B shape. Where the norms are Liger's (the server's
default), ``add_norm`` runs each residual add and the norm after it as Liger's one fused kernel,
also bit for bit: 6.34 against 6.43 ms. The time of each path: BENCHMARKS.md,
"Decode step per kernel" and "Decode attention kernel". See fsdpfn/rollout/decode.py for the
scheduling.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fsdpfn.rollout import attention_kernel, rope_kernel

__all__ = ["SlotModel", "unsupported_reason", "SUPPORTED", "ATTENTION", "ROPE_KV",
           "KV_CACHE_DTYPES", "kv_cache_refusal"]

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
ATTENTION = ("auto", "flash", "triton", "sdpa", "flex", "matmul")
ROPE_KV = ("auto", "torch", "triton")
# the cache's element type: the model's dtype ("auto"), or float8 e4m3 (SGLang's "fp8_e4m3",
# scale 1: values saturate at +-448), half the bytes a position for the attention to read
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def config_head_dim(config) -> int:
    """The attention head size a transformers config gives (its head_dim, or hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def flash_refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why torch's flash attention forward (variable lengths, ``seqused_k``) cannot serve this
    decode step (None: it can). It needs CUDA, a half dtype, a head size flash supports."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) \
            or head_dim % 8 or head_dim > 256:
        return (f"'flash' needs CUDA, bfloat16 or float16 and a head size that is a multiple "
                f"of 8 up to 256, got {device.type}, {str(dtype).removeprefix('torch.')} and "
                f"{head_dim}")
    return None


def flash_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return flash_refusal(device, dtype, head_dim) is None


def attention_refusal(attention: str, device: torch.device, dtype: torch.dtype,
                      head_dim: int) -> str | None:
    """Why ``attention`` cannot serve this decode step (None: it can, or it is not checked
    ahead: sdpa, flex and matmul run wherever torch runs them)."""
    if attention == "flash":
        return flash_refusal(device, dtype, head_dim)
    if attention == "triton":
        return attention_kernel.refusal(device, head_dim)
    return None


def kv_cache_refusal(kv_cache_dtype: str, attention: str, device: torch.device) -> str | None:
    """Why the cache cannot be held in ``kv_cache_dtype`` with the resolved ``attention`` here
    (None: it can). float8 is read by the Triton attention alone (which widens each loaded block
    to the model's dtype), on a GPU with float8 (compute capability 8.9 or later)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}"
    if kv_cache_dtype == "auto":
        return None
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if attention != "triton" or cap is None or cap < (8, 9):
        return (f"{kv_cache_dtype!r} needs the Triton decode attention (decode_attention "
                f"'triton', or 'auto' where it runs) on a GPU of compute capability 8.9 or "
                f"later, got {attention!r} attention on "
                f"{device.type if cap is None else f'{device.type} {cap[0]}.{cap[1]}'}")
    return None


def resolve_attention(attention: str, device: torch.device, dtype: torch.dtype,
                      head_dim: int) -> str:
    """"auto": the Triton kernel where it runs in bf16/fp16, else flash where it runs, else
    SDPA with a mask."""
    if attention == "auto":
        if dtype in (torch.bfloat16, torch.float16) \
                and attention_kernel.refusal(device, head_dim) is None:
            return "triton"
        return "flash" if flash_available(device, dtype, head_dim) else "sdpa"
    return attention


def _flash_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, used):
    """torch's flash attention forward over variable lengths, non-causal: [total, heads, D]."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, scale=scale, seqused_k=used)[0]


def _flash_decode(q, k_cache, v_cache, cu_q, cu_k, used, max_k: int, scale: float):
    """Attention of one new token per row over each row's own cache length, no mask, no padded
    column read. The cache [S, kv, L, D] is read in place as S * kv sequences of L positions
    (cu_k: their starts), of which ``used`` are live; each sequence is attended by the G query
    heads of its kv head, handed to flash as G query positions of one head (cu_q: steps of G;
    non-causal: the G positions are one token). q [R, heads, D] -> [R, heads * D]."""
    R, heads, D = q.shape
    out = _flash_forward(q.reshape(-1, 1, D), k_cache.view(-1, 1, D), v_cache.view(-1, 1, D),
                         cu_q, cu_k, heads // k_cache.shape[1], max_k, scale, used)
    return out.view(R, heads * D)


@functools.cache
def _flex_attention():
    """flex_attention compiled once, with dynamic shapes (built on first use)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def _flex_decode(q, k, v, pos, scale: float):
    """q [R, heads, D] of one new token per row, the cache k/v [R, kv, Lb, D]; row b attends
    columns <= pos[b]. Returns [R, heads, D]."""
    def causal(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= pos[b], score, -float("inf"))

    out = _flex_attention()(q[:, :, None], k, v, score_mod=causal, enable_gqa=True, scale=scale)
    return out[:, :, 0]


def _scores_fp32(device, dtype) -> bool:
    """torch.bmm with ``out_dtype=float32`` from ``dtype`` inputs runs here (CUDA, torch >= 2.8,
    bf16/fp16 inputs; a wider dtype keeps its own scores)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        a = torch.zeros(1, 1, 8, dtype=dtype, device=device)
        return torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def _matmul_decode(q, k, v, mask, kv: int, scale: float, fp32_scores: bool):
    """q [R, heads, D] of one new token per row, the cache k/v [R, kv, Lb, D] (a slice: rows
    and kv heads merge into one batch without a copy), mask [R, 1, 1, Lb] additive. Query head
    h reads kv head h // G, as HF's repeat_kv. Returns [R, heads * D]."""
    R, heads, D = q.shape
    Lb = k.shape[2]
    qg = q.reshape(R * kv, heads // kv, D)
    kt = k.reshape(R * kv, Lb, D).transpose(1, 2)
    if fp32_scores:
        s = torch.bmm(qg, kt, out_dtype=torch.float32)
    else:  # float32 scores, or the model's own dtype where it is wider (a float64 reference)
        wide = torch.promote_types(q.dtype, torch.float32)
        s = torch.bmm(qg.to(wide), kt.to(wide))
    s = s.view(R, kv, heads // kv, Lb) * scale + mask
    p = torch.softmax(s, dim=-1).to(v.dtype).view(R * kv, heads // kv, Lb)
    return torch.bmm(p, v.reshape(R * kv, Lb, D)).view(R, heads * D)


def unsupported_reason(model) -> str | None:
    """Why the decode loop cannot serve ``model`` (None: it can)."""
    config = model.config
    if config.model_type not in SUPPORTED:
        return f"model_type {config.model_type!r} is not one of {SUPPORTED}"
    if getattr(config, "use_sliding_window", False) or (
            config.model_type == "mistral" and getattr(config, "sliding_window", None)):
        return "sliding-window attention is not supported"
    rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
            or {})
    if rope.get("rope_type", rope.get("type", "default")) in ("dynamic", "longrope"):
        return f"rope_type {rope.get('rope_type')!r} depends on the sequence length"
    if not hasattr(getattr(model, "model", None), "layers"):
        return "model has no .model.layers"
    # softcaps the loop's attention and head do not compute, wherever a config carries them
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            return f"{name} is not computed by the decode loop"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a float8 tensor's bytes (uint8, the same storage): indexed writes go through
    them, the same bits, on builds whose index_put has no float8 kernel."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotate_rolled(x, cos, sin_signed):
    """``_rotate`` bit for bit in four kernels instead of five: rotate_half(x) * sin equals
    roll(x) * sin_signed (sin with its first half negated) element by element, since IEEE
    products are symmetric in sign; the products and the sum round as HF's formula does."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


def _fusable(layers) -> bool:
    """Every layer's q, k, v projections are plain Linears, all with a bias or all without."""
    for layer in layers:
        attn = layer.self_attn
        mods = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if not all(type(m) is torch.nn.Linear for m in mods):
            return False
        if len({m.bias is None for m in mods}) != 1:
            return False
    return True


def _liger_add_norm(norms, device: torch.device):
    """Liger's fused residual add + RMSNorm forward (one kernel where the decode step runs an
    add and a norm) when every norm of the step is Liger's RMSNorm on CUDA, else None. It is
    that norm's own kernel with the add in front (the same row program, block, warps and casts),
    so the step's bits do not change; tests/e2e/test_decode_gpu.py holds it to that."""
    if device.type != "cuda":
        return None
    try:
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError:  # Liger without the fused op (before 0.6), or no Liger
        return None
    if not all(type(n) is LigerRMSNorm and n.weight is not None for n in norms):
        return None
    return fused_add_rms_norm_forward


class SlotModel:
    """The HF model's modules, run on the slot cache: prefill of whole prompts, one decode step."""

    def __init__(self, model, slots: int, max_len: int, attention: str = "auto",
                 compile: bool = False, rope_kv: str = "auto", share_prefix: bool = True,
                 add_norm: bool = True, kv_cache_dtype: str = "auto"):
        if attention not in ATTENTION:
            raise ValueError(f"attention: must be one of {ATTENTION}, got {attention!r}")
        if rope_kv not in ROPE_KV:
            raise ValueError(f"rope_kv: must be one of {ROPE_KV}, got {rope_kv!r}")
        # torch.compile of the decode step, dynamic shapes (one compile serves every bucket of
        # rows and length): inductor fuses the norms, rotary, residual adds, SwiGLU and the mask
        self.decode = torch.compile(self._decode, dynamic=True) if compile else self._decode
        cfg = model.config
        self.model, self.base = model, model.model
        self.layers = list(self.base.layers)
        attn = self.layers[0].self_attn
        self.head_dim = int(getattr(attn, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
        self.q_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.group = self.q_heads // self.kv_heads
        self.scaling = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        self.slots, self.max_len = slots, max_len
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.attention = resolve_attention(attention, self.device, self.dtype, self.head_dim)
        reason = attention_refusal(self.attention, self.device, self.dtype, self.head_dim)
        if reason:
            raise ValueError(f"attention: {reason}")
        self.fp32_scores = attention == "matmul" and _scores_fp32(self.device, self.dtype)
        reason = kv_cache_refusal(kv_cache_dtype, self.attention, self.device)
        if reason is None and compile and kv_cache_dtype != "auto":
            reason = f"{kv_cache_dtype!r} runs without decode_compile (the eager step's kernels)"
        if reason:
            raise ValueError(f"kv_cache_dtype: {reason}")
        self.kv_dtype = self.dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn
        # rope_kv="triton": each layer's rotary, q layout and KV writes in one kernel
        # (fsdpfn.rollout.rope_kernel), on the fused q/k/v buffers, without q/k norms;
        # "auto": that kernel where it runs, else the torch path (the same bits either way)
        reason = rope_kernel.refusal(self.device, self.dtype, self.head_dim)
        if reason is None and (compile or not _fusable(self.layers) or hasattr(attn, "q_norm")):
            reason = ("rope_kv='triton' runs without compile, on plain q/k/v Linears and "
                      "without per-head q/k norms")
        if rope_kv == "triton" and reason:
            raise ValueError(f"rope_kv: {reason}")
        self.rope_kv = "torch" if reason or rope_kv == "torch" else "triton"
        # add_norm: each residual add and the norm after it as one kernel (Liger's fused add +
        # RMSNorm) where the norms are Liger's and the step is not compiled; the same bits
        # (after[i]: the norm after layer i's MLP, the next layer's input norm or the final one)
        self.after = [layer.input_layernorm for layer in self.layers[1:]] + [self.base.norm]
        norms = [layer.post_attention_layernorm for layer in self.layers] + self.after
        self.add_norm = _liger_add_norm(norms, self.device) if add_norm and not compile \
            else None
        with torch.no_grad():  # rotary tables for every position, from the model's own module
            cos, sin = self.base.rotary_emb(torch.zeros((), dtype=self.dtype, device=self.device),
                                            torch.arange(max_len, device=self.device)[None])
        self.cos, self.sin = cos[0], sin[0]  # (L, D)
        half = self.head_dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
        # one q/k/v matmul a layer in the decode step: the three weights (and biases) copied
        # into one buffer, again whenever the weights change (refresh_weights; the buffers keep
        # their addresses, so captured graphs stay valid)
        self.qkv = None
        if _fusable(self.layers):
            width = (self.q_heads + 2 * self.kv_heads) * self.head_dim
            bias = self.layers[0].self_attn.q_proj.bias is not None
            self.qkv = [(torch.empty(width, cfg.hidden_size, dtype=self.dtype, device=self.device),
                         torch.empty(width, dtype=self.dtype, device=self.device) if bias else None)
                        for _ in self.layers]
            self.refresh_weights()
        shape = (slots, self.kv_heads, max_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                  for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                  for _ in self.layers]
        self.rows = torch.arange(slots, device=self.device)
        self.heads = torch.arange(self.kv_heads, device=self.device)
        self.cols = torch.arange(max_len, device=self.device)
        # flash: each (slot, kv head) is a sequence of max_len positions in the cache, attended
        # by G query positions (the kv head's query heads); slices of these serve every R
        seqs = torch.arange(slots * self.kv_heads + 1, dtype=torch.int32, device=self.device)
        self.cu_q, self.cu_k = seqs * self.group, seqs * max_len
        # share_prefix (with the Triton attention): rows whose caches begin with the same bits
        # (the samples of one prompt) read those positions from their group's first row's
        # cache, so the group reads them from HBM about once (set_shared); the tables keep
        # their addresses, so captured graphs read whatever set_shared wrote last
        self.share_prefix = bool(share_prefix) and self.attention == "triton"
        self.shared = attention_kernel.share_tables([], slots, self.device) \
            if self.share_prefix else None

    def set_shared(self, groups) -> int:
        """The sets of slots whose caches hold the same bits in their first positions, as
        (shared length, slots) pairs (see attention_kernel.share_tables), for the decode steps
        that follow. Returns what those steps pass as ``shared``: 1 when some set of two or
        more slots shares positions, else 0 (also where sharing is off)."""
        if self.shared is None:
            return 0
        tables = attention_kernel.share_tables(groups, self.slots, "cpu")
        for buf, new in zip(self.shared, tables):
            buf.copy_(new)
        return int(bool(tables[0].any()))

    @staticmethod
    def kv_bytes_per_slot(model, max_len: int, kv_cache_dtype: str = "auto") -> int:
        cfg = model.config
        head_dim = config_head_dim(cfg)
        itemsize = next(model.parameters()).element_size() if kv_cache_dtype == "auto" else 1
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * max_len * itemsize

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Copy the served q/k/v weights into the fused buffers (after any weight change)."""
        if self.qkv is None:
            return
        for layer, (w, b) in zip(self.layers, self.qkv):
            attn = layer.self_attn
            torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], out=w)
            if b is not None:
                torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias], out=b)

    def _decode_qkv(self, i, attn, a, cos, sin_signed, pos):
        """q [R, heads, D], k and v [R, kv, D] of one token per row, q and k rotated. With the
        fused buffers: one matmul, and q and k rotated together when no q/k norm sits between.
        With rope_kv="triton", k and v go straight into the cache: (q, None, None)."""
        if self.qkv is None:
            q, k, v = self._qkv(attn, a, (a.shape[0],))
            return _rotate_rolled(q, cos, sin_signed), _rotate_rolled(k, cos, sin_signed), v
        w, b = self.qkv[i]
        if self.rope_kv == "triton":
            q = rope_kernel.rope_kv(torch.nn.functional.linear(a, w, b), self.cos,
                                    self.sin_signed, pos, self.k[i], self.v[i], self.q_heads,
                                    self.kv_heads)
            return q, None, None
        qkv = torch.nn.functional.linear(a, w, b).view(a.shape[0], -1, self.head_dim)
        nq, nk = self.q_heads, self.kv_heads
        v = qkv[:, nq + nk:]
        if hasattr(attn, "q_norm"):  # qwen3: per-head norms before the rotary
            q, k = attn.q_norm(qkv[:, :nq]), attn.k_norm(qkv[:, nq:nq + nk])
            return _rotate_rolled(q, cos, sin_signed), _rotate_rolled(k, cos, sin_signed), v
        qk = _rotate_rolled(qkv[:, :nq + nk], cos, sin_signed)
        return qk[:, :nq].contiguous(), qk[:, nq:], v  # q in the layout attention always had

    def _qkv(self, attn, a, shape):
        q = attn.q_proj(a).view(*shape, self.q_heads, self.head_dim)
        k = attn.k_proj(a).view(*shape, self.kv_heads, self.head_dim)
        v = attn.v_proj(a).view(*shape, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def logits(self, hidden):
        """hidden[N, H] (before the final norm) -> logits[N, V] float32."""
        return self.model.get_output_embeddings()(self.base.norm(hidden)).float()

    def prefill(self, ids, lengths, slots, src):
        """ids[P, W] right-padded prompts, lengths[P]; the KV of prompt src[i] goes to slot
        slots[i] (columns [0, W); those past a prompt's length are rewritten before being read).
        Returns logits[P, V] at each prompt's last token."""
        P, W = ids.shape
        x = self.base.embed_tokens(ids)  # (P, W, H)
        cos, sin = self.cos[:W, None], self.sin[:W, None]  # (W, 1, D)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._qkv(attn, layer.input_layernorm(x), (P, W))  # (P, W, heads, D)
            q, k = _rotate(q, cos, sin).transpose(1, 2), _rotate(k, cos, sin).transpose(1, 2)
            v = v.transpose(1, 2)
            _bits(self.k[i])[slots, :, :W] = _bits(k[src].to(self.kv_dtype))  # float8: rounded
            _bits(self.v[i])[slots, :, :W] = _bits(v[src].to(self.kv_dtype))
            out = F.scaled_dot_product_attention(
                q, k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1),
                is_causal=True, scale=self.scaling)  # right padding: causal is enough
            x = x + attn.o_proj(out.transpose(1, 2).reshape(P, W, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = x[torch.arange(P, device=ids.device), lengths - 1]  # (P, H)
        return self.logits(last)

    def _decode(self, tok, pos, Lb: int, raw: bool = False, shared: int = 0):
        """tok[R], pos[R] of slots [0, R): writes their KV at pos, attends columns <= pos (of
        the first Lb), returns logits[R, V] float32 (``raw``: in the model's dtype). ``shared``:
        what the last set_shared returned (1: its groups read their shared positions from their
        first row's cache, Triton attention), or 0."""
        R = tok.shape[0]
        tables = self.shared if shared and self.shared is not None else None
        x = self.base.embed_tokens(tok)  # (R, H)
        cos, sin_signed = self.cos[pos][:, None], self.sin_signed[pos][:, None]  # (R, 1, D)
        if self.attention == "flash":  # each sequence's live length: pos + 1, per kv head
            n = R * self.kv_heads
            cu_q, cu_k = self.cu_q[:n + 1], self.cu_k[:n + 1]
            used = (pos + 1).to(torch.int32).repeat_interleave(self.kv_heads)
        elif self.attention == "triton":  # each row's live length
            used = (pos + 1).to(torch.int32)
        mask = None if self.attention in ("flex", "flash", "triton") else torch.zeros(
            (R, 1, 1, Lb), dtype=self.dtype, device=self.device).masked_fill(
            self.cols[None, None, None, :Lb] > pos[:, None, None, None], float("-inf"))
        where = (self.rows[:R, None], self.heads[None, :], pos[:, None])
        h = self.layers[0].input_layernorm(x)  # each layer's normed input, then the final norm
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = self._decode_qkv(i, attn, h, cos, sin_signed, pos)
            if k is not None:  # else written by the rope_kv kernel
                _bits(self.k[i]).index_put_(where, _bits(k.to(self.kv_dtype)))
                _bits(self.v[i]).index_put_(where, _bits(v.to(self.kv_dtype)))
            k_rows, v_rows = self.k[i][:R, :, :Lb], self.v[i][:R, :, :Lb]
            if self.attention == "flash":
                out = _flash_decode(q, self.k[i], self.v[i], cu_q, cu_k, used, Lb,
                                    self.scaling)
            elif self.attention == "triton":
                out = attention_kernel.decode(q, self.k[i], self.v[i], used, Lb, self.scaling,
                                              shared=tables)
            elif self.attention == "flex":
                out = _flex_decode(q.contiguous(), k_rows, v_rows, pos, self.scaling)
            elif self.attention == "matmul":
                out = _matmul_decode(q, k_rows, v_rows, mask, self.kv_heads, self.scaling,
                                     self.fp32_scores)
            else:
                out = F.scaled_dot_product_attention(
                    q.view(R, self.kv_heads, self.group, self.head_dim), k_rows, v_rows,
                    attn_mask=mask, scale=self.scaling)  # (R, kv, G, D)
            h, x = self._add_then_norm(attn.o_proj(out.reshape(R, -1)), x,
                                       layer.post_attention_layernorm)
            h, x = self._add_then_norm(layer.mlp(h), x, self.after[i])
        logits = self.model.get_output_embeddings()(h)  # h: base.norm(x)
        return logits if raw else logits.float()

    def _add_then_norm(self, delta, x, norm):
        """(norm(x + delta), x + delta): HF's residual add and the norm after it."""
        if self.add_norm is None:
            x = x + delta
            return norm(x), x
        y, s = self.add_norm(delta, x, norm.weight, norm.variance_epsilon, norm.offset,
                             norm.casting_mode)[:2]
        return y, s
