"""GPU: windowed and softcapped families on the CUDA fast paths equal the model's own forward.

- torch's flash varlen attention with a sliding window equals a float64 windowed softmax (and is
  far from the unwindowed one); a softcapped layer leaves the flash path for the exact
  per-sequence attention and says so in the log.
- forward_logp on CUDA (bf16: flash varlen, Liger kernels where installed, the chunked head) of
  mistral, qwen2 with its window, gemma2 (softcaps, alternating windows) and gemma3_text is close
  to the model's own float32 eager forward, and several times closer than to the same model with
  its windows and softcaps removed; in float32 it equals it to 2e-5 for every family.
- the same with compiled decoder blocks (EngineConfig.compile).

Skipped without CUDA.

    python -m pytest -q tests/e2e/test_families_gpu.py
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.engine.attention import packed_attention, varlen_available, varlen_honours
from fsdpfn.testing.models import (hf_config_of, hf_reference_logp, save_family_model,
                                   tiny_family_configs)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA")]

FAMILIES = tiny_family_configs()
GPU_FAMILIES = ("mistral", "qwen2-sliding", "gemma2", "gemma3_text")
LENGTHS = (64, 41, 53, 47)
# what each family's options are, removed: the "wrong" model a dropped option would compute
WITHOUT = {"mistral": dict(sliding_window=4096),
           "qwen2-sliding": dict(use_sliding_window=False),
           "gemma2": dict(sliding_window=4096, attn_logit_softcapping=None,
                          final_logit_softcapping=None),
           "gemma3_text": dict(sliding_window=4096)}


def _reference(q, k, v, lens, scale, window, softcap):
    """float64, sequence by sequence: [1, Hq, N, D] -> [1, N, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (x[0, :, start:start + n].double() for x in (q, k, v))
        s = qs @ ks.transpose(-1, -2) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        i = torch.arange(n, device=q.device)
        ok = (i[None] <= i[:, None]) & (i[:, None] - i[None] < (window or n))
        out.append(torch.softmax(s.masked_fill(~ok, float("-inf")), -1) @ vs)
        start += n
    return torch.cat(out, 1).transpose(0, 1)[None]


def _qkv(lens, hq=8, hkv=2, d=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    n = sum(lens)
    return [torch.randn(1, h, n, d, generator=g, device="cuda").bfloat16() for h in (hq, hkv, hkv)]


@pytest.mark.timeout(120)
def test_flash_varlen_honours_the_sliding_window():
    lens, window = [300, 77, 512], 64
    q, k, v = _qkv(lens)
    assert varlen_available(q.device, q.dtype) and varlen_honours(window, None), \
        "this torch's flash varlen attention has no window_size: the window is not on flash"
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    scale = 1 / math.sqrt(64)
    out, _ = packed_attention(None, q, k, v, None, scaling=scale, cu_seq_lens_q=cu,
                              max_length_q=max(lens), sliding_window=window)
    right = _reference(q, k, v, lens, scale, window, None)
    wrong = _reference(q, k, v, lens, scale, None, None)
    gap = float((out.double() - right).abs().max())
    assert gap < 2e-2, gap
    assert float((out.double() - wrong).abs().max()) > 10 * gap


@pytest.mark.timeout(120)
def test_softcapped_layers_leave_the_flash_path_exactly_and_say_so(caplog):
    lens, window, softcap = [200, 90], 32, 5.0
    q, k, v = _qkv(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    class SoftcappedProbeAttention(torch.nn.Module):  # a class of its own: logged once per class
        pass

    with caplog.at_level(logging.INFO, logger="fsdpfn"):
        out, _ = packed_attention(SoftcappedProbeAttention(), q, k, v, None, scaling=0.125,
                                  cu_seq_lens_q=cu, max_length_q=max(lens),
                                  sliding_window=window, softcap=softcap)
    right = _reference(q, k, v, lens, 0.125, window, softcap)
    assert float((out.double() - right).abs().max()) < 2e-2
    assert any("SoftcappedProbeAttention" in r.getMessage() and "softcapping" in r.getMessage()
               for r in caplog.records)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families_gpu")
    return {name: str(save_family_model(root / name, FAMILIES[name], seed=3))
            for name in FAMILIES}


def _batch(seed=0):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    attn = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    ids = torch.where(attn, torch.randint(0, 131, (len(LENGTHS), T), generator=g), 0)
    loss = attn.clone()
    loss[:, 0] = False
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss},
                      batch_size=[len(LENGTHS)])


def _hf_logp(model_dir, batch, **overrides):
    from transformers import AutoModelForCausalLM

    config = hf_config_of({**FAMILIES[model_dir.rsplit("/", 1)[1]], **overrides})
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                                 attn_implementation="eager").cuda()
    with torch.no_grad():
        logp, _ = hf_reference_logp(model, batch[K.INPUT_IDS].cuda(),
                                    batch[K.ATTENTION_MASK].cuda())
    return logp.cpu()


def _engine_logp(model_dir, batch, dtype, **kwargs):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cuda")
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype=dtype, optimizer=None,
                                           **kwargs), mesh)
    return ff.forward_logp(state, batch)[K.LOGP]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_bf16_fast_paths_equal_the_models_own_forward(family, dirs):
    batch = _batch()
    mask = batch[K.ATTENTION_MASK].clone()
    mask[:, 0] = False
    got = _engine_logp(dirs[family], batch, "bfloat16")
    right = (got - _hf_logp(dirs[family], batch))[mask].abs()
    wrong = (got - _hf_logp(dirs[family], batch, **WITHOUT[family]))[mask].abs()
    assert float(right.mean()) < 3e-2 and float(right.max()) < 0.2, (family, right.mean(),
                                                                      right.max())
    assert float(wrong.mean()) > 4 * float(right.mean()), (family, wrong.mean(), right.mean())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_on_cuda_equals_the_models_own_forward(family, dirs):
    batch = _batch(seed=1)
    got = _engine_logp(dirs[family], batch, "float32")
    gap = float((got - _hf_logp(dirs[family], batch)).abs().max())
    assert gap <= 2e-5, f"{family}: {gap:.3g}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["qwen3", "qwen2-sliding", "gemma2", "llama-rope-yarn"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_blocks_on_cuda_equal_the_models_own_forward(family, dtype, dirs):
    """EngineConfig.compile on CUDA (inductor's kernels for the blocks, flash varlen attention
    outside the graph in bf16): float32 equals the model's own forward as the eager engine does;
    bf16 is as close as the eager fast path is required to be."""
    batch = _batch(seed=2)
    mask = batch[K.ATTENTION_MASK].clone()
    mask[:, 0] = False
    got = _engine_logp(dirs[family], batch, dtype, compile=True)
    gap = (got - _hf_logp(dirs[family], batch))[mask].abs()
    if dtype == "float32":
        assert float(gap.max()) <= 2e-5, f"{family}: {float(gap.max()):.3g}"
    else:
        assert float(gap.mean()) < 3e-2 and float(gap.max()) < 0.2, (family, gap.mean(),
                                                                     gap.max())


# families whose model or layers do not pass the pack's keywords on to the attention
KEYWORD_DROPPING = {"stablelm": dict(model_type="stablelm", qk_layernorm=True, pad_token_id=0),
                    "falcon-40b": dict(model_type="falcon", new_decoder_architecture=True,
                                       num_kv_heads=2)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", sorted(KEYWORD_DROPPING))
def test_families_that_drop_the_packed_keywords_train_exactly_on_cuda(family, tmp_path):
    """The flash varlen path reads the pack's boundaries from the running pack, and activation
    checkpointing's recomputation (in the autograd engine's CUDA thread) reads them again: in
    float32 the log-probs, loss and update of one sft_step equal the model's own; in bf16
    the log-probs are as close as the other families' fast paths. On a transformers release
    before the family computes exactly on a pack (EXACT_SINCE), it is refused by name."""
    from fsdpfn.testing.models import (REFERENCE_STEP, _common, assert_update_matches,
                                       engine_update, exact_here, hf_reference_update)

    spec = _common({"vocab_size": 131, **KEYWORD_DROPPING[family]})
    path = str(save_family_model(tmp_path / family, spec, seed=4))
    batch = _batch(seed=3)
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cuda")
    config = ff.EngineConfig(
        model_path=path, dtype="float32", gradient_checkpointing=True,
        optimizer=ff.OptimizerConfig(**REFERENCE_STEP))
    if not exact_here(spec["model_type"]):  # an older transformers: refused by name
        with pytest.raises(ff.errors.ConfigError, match=repr(spec["model_type"])):
            ff.shard_model(config, mesh)
        return
    state = ff.shard_model(config, mesh)
    logp, loss, deltas = engine_update(state, batch, mesh)
    got = (logp.cpu(), loss, {k: v.cpu() for k, v in deltas.items()})
    assert_update_matches(f"{family} cuda float32", got, hf_reference_update(path, batch))
    mask = batch[K.ATTENTION_MASK].clone()
    mask[:, 0] = False
    bf16 = ff.forward_logp(ff.shard_model(ff.EngineConfig(model_path=path, dtype="bfloat16",
                                                          optimizer=None), mesh), batch)[K.LOGP]
    gap = (bf16.cpu() - got[0])[mask].abs()
    assert float(gap.mean()) < 3e-2 and float(gap.max()) < 0.2, (family, gap.mean(), gap.max())
