"""KahanAdamW: bf16 weights follow the float32 AdamW trajectory where plain bf16 AdamW stalls, as
multi-tensor work with no host synchronisation. PerLayerAdamW (one unit at a time, state in host
memory): equal to AdamW / KahanAdamW bit for bit, within its prefetch window, state dicts
round-trip."""

from __future__ import annotations

import pytest
import torch

from fsdpfn.engine.optim import KahanAdamW


def _run(opt_cls, dtype, lr=1e-4, steps=300, weight_decay=0.01):
    torch.manual_seed(0)
    target = torch.randn(64, 32)
    x = torch.randn(256, 32)
    w = torch.nn.Parameter((torch.randn(64, 32) + 4.0).to(dtype))  # |w| ~ 4: bf16 ulp ~ 0.03
    opt = opt_cls([w], lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        loss = ((x @ w.float().t() - x @ target.t()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach().float()


def test_kahan_bf16_tracks_float32_where_plain_bf16_stalls():
    start = (torch.manual_seed(0), torch.randn(64, 32), torch.randn(256, 32),
             torch.randn(64, 32) + 4.0)[3]
    ref = _run(torch.optim.AdamW, torch.float32)
    kahan = _run(KahanAdamW, torch.bfloat16)
    plain = _run(torch.optim.AdamW, torch.bfloat16)
    moved = (ref - start).abs().mean()
    assert moved > 0.02  # 300 steps of ~1e-4: the float32 weights moved by ~0.03
    # plain bf16: updates of 1e-4 are below half an ulp at |w| ~ 4 and vanish
    assert (plain - start.to(torch.bfloat16).float()).abs().mean() < 0.1 * moved
    # Kahan: within one bf16 ulp (2^-7 relative: 8 significant bits) of the float32 weights
    assert torch.all((kahan - ref).abs() <= 2 ** -7 * ref.abs() * 1.01)
    # on average at the level of rounding the stored value, well under one ulp (plain bf16 is
    # off by the whole movement, ~one ulp here)
    assert (kahan - ref).abs().mean() < 0.5 * (2 ** -7 * ref.abs()).mean()
    assert (plain - ref).abs().mean() > 0.8 * moved


def test_kahan_matches_adamw_in_float32():
    # with float32 parameters the compensation is ~0 and the update is AdamW's
    ref = _run(torch.optim.AdamW, torch.float32, lr=1e-2, steps=50)
    ours = _run(KahanAdamW, torch.float32, lr=1e-2, steps=50)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- multi-tensor Kahan


def test_kahan_step_never_reads_a_device_value_on_the_host(monkeypatch):
    # the step is device work only: .item() / float() of a tensor would synchronise with the host
    w = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16))
    opt = KahanAdamW([w], lr=1e-3, weight_decay=0.1)
    w.grad = torch.randn(8, 4, dtype=torch.bfloat16)

    def refuse(*_):
        raise AssertionError("host synchronisation in the optimizer step")

    for name in ("item", "__float__", "tolist", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    opt.step()
    opt.step()
    monkeypatch.undo()
    assert float(opt.state[w]["step"]) == 2.0


def test_kahan_chunks_give_the_same_result_as_one_chunk():
    # tensors cut into flat slices of 7 elements (one 8x4 tensor spans five chunks)
    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(*s).to(torch.bfloat16)) for s in ((8, 4), (3,), (5, 2))]
    copies = [torch.nn.Parameter(w.detach().clone()) for w in ws]
    whole = KahanAdamW(ws, lr=1e-2, weight_decay=0.1)
    cut = KahanAdamW(copies, lr=1e-2, weight_decay=0.1, chunk_numel=7)
    for _ in range(5):
        grads = [torch.randn_like(w) for w in ws]
        for w, c, g in zip(ws, copies, grads):
            w.grad, c.grad = g, g.clone()
        whole.step()
        cut.step()
    for w, c in zip(ws, copies):
        assert torch.equal(w, c)
        for k in ("exp_avg", "exp_avg_sq", "compensation"):
            assert torch.equal(whole.state[w][k], cut.state[c][k])


def _long_run(opt_cls, dtype, steps=1000, lr=1e-3):
    """A noisy quadratic (least squares with fresh minibatches), |w| ~ 2: a long toy run."""
    gen = torch.Generator().manual_seed(1)
    target = torch.randn(32, 16, generator=gen) + 2.0
    w = torch.nn.Parameter((target + 0.5 * torch.randn(32, 16, generator=gen)).to(dtype))
    opt = opt_cls([w], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        x = torch.randn(64, 16, generator=gen)
        loss = ((x @ w.float().t() - x @ target.t()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach().float(), target


def test_kahan_tracks_the_float32_trajectory_on_a_long_run():
    ref, target = _long_run(torch.optim.AdamW, torch.float32)
    kahan, _ = _long_run(KahanAdamW, torch.bfloat16)
    plain, _ = _long_run(torch.optim.AdamW, torch.bfloat16)
    kahan_err = (kahan - ref).abs().mean().item()
    plain_err = (plain - ref).abs().mean().item()
    # measured (mean |.| over the weights): fp32 ends 0.060 from the target, Kahan bf16 0.005
    # from fp32 (a bf16 ulp at |w| ~ 2 is 0.016), plain bf16 0.34 from fp32: once the updates
    # shrink below half an ulp they vanish and it stalls
    assert (ref - target).abs().mean() < 0.1
    assert kahan_err < 0.01
    assert plain_err > 0.2
    assert kahan_err < plain_err / 20


# ---------------------------------------------------------------- per-layer optimizer step

from hypothesis import given, settings, strategies as st  # noqa: E402

from fsdpfn.errors import ConfigError  # noqa: E402
from fsdpfn.engine.optim_offload import PerLayerAdamW  # noqa: E402


def _layers(dtype=torch.float32, n=4):
    torch.manual_seed(0)
    return [torch.nn.Linear(6, 6).to(dtype) for _ in range(n)]


def _groups(layers, weight_decay=0.1):
    """Two groups like build_optimizer's: matrices decayed, biases not."""
    params = [p for layer in layers for p in layer.parameters()]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _train(layers, opt, steps, seed=0, lr_decay=None):
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x = torch.randn(5, 6, generator=gen)
        for layer in layers:
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        opt.zero_grad()
        x.float().pow(2).sum().backward()
        if lr_decay is not None:  # what an LR scheduler does between steps
            for group in opt.param_groups:
                group["lr"] *= lr_decay
        opt.step()


def _assert_same(a_layers, b_layers, a_opt, b_opt, names):
    for la, lb in zip(a_layers, b_layers):
        for pa, pb in zip(la.parameters(), lb.parameters()):
            assert torch.equal(pa, pb)
            for name in names:
                assert torch.equal(a_opt.state[pa][name], b_opt.state[pb][name]), name


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(prefetch=st.integers(0, 5), split=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_per_layer_step_equals_adamw_exactly(prefetch, split):
    ref_layers, layers = _layers(), _layers()
    ref = torch.optim.AdamW(_groups(ref_layers), lr=1e-2)
    # units of `split` layers each; layers left over form the optimizer's last unit
    units, start = [], 0
    for size in split:
        units.append([p for layer in layers[start:start + size] for p in layer.parameters()])
        start += size
    ours = PerLayerAdamW(_groups(layers), units=units, device="cpu", lr=1e-2,
                         prefetch_layers=prefetch)
    _train(ref_layers, ref, 6, lr_decay=0.9)
    _train(layers, ours, 6, lr_decay=0.9)
    _assert_same(ref_layers, layers, ref, ours, ("exp_avg", "exp_avg_sq", "step"))


def test_per_layer_kahan_equals_kahan_adamw_exactly():
    """The host reserve is left uninitialised at build (zeroing 45 GB of a 7B model's state
    took seconds there): poisoned with NaN here, the first step must still start from zeros."""
    ref_layers, layers = _layers(torch.bfloat16), _layers(torch.bfloat16)
    ref = KahanAdamW(_groups(ref_layers), lr=1e-2)
    ours = PerLayerAdamW(_groups(layers), units=[list(m.parameters()) for m in layers],
                         device="cpu", lr=1e-2, kahan=True)
    for reserve in ours._reserved.values():  # noqa: SLF001
        for tensor in reserve.values():
            tensor.fill_(float("nan"))
    _train(ref_layers, ref, 6)
    _train(layers, ours, 6)
    _assert_same(ref_layers, layers, ref, ours, ("exp_avg", "exp_avg_sq", "compensation", "step"))


@pytest.mark.parametrize("prefetch", [0, 1, 2, 10])
def test_per_layer_holds_at_most_the_prefetch_window(prefetch, monkeypatch):
    layers = _layers(n=6)
    ours = PerLayerAdamW(_groups(layers), units=[list(m.parameters()) for m in layers],
                         device="cpu", lr=1e-2, prefetch_layers=prefetch)
    live, peak, order = [0], [0], []
    load, release = PerLayerAdamW._load, PerLayerAdamW._release

    def counting_load(self, unit):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        order.append(unit[0][1][0])
        return load(self, unit)

    def counting_release(self, unit):
        live[0] -= 1
        return release(self, unit)

    monkeypatch.setattr(PerLayerAdamW, "_load", counting_load)
    monkeypatch.setattr(PerLayerAdamW, "_release", counting_release)
    _train(layers, ours, 1)
    assert peak[0] == min(1 + prefetch, 6) and live[0] == 0
    assert order == [m.weight for m in layers]  # the units in order, each once


def test_per_layer_state_dict_round_trip_continues_identically():
    a_layers, b_layers = _layers(), _layers()
    units = lambda ls: [list(m.parameters()) for m in ls]  # noqa: E731
    a = PerLayerAdamW(_groups(a_layers), units=units(a_layers), device="cpu", lr=1e-2)
    _train(a_layers, a, 3)
    for la, lb in zip(a_layers, b_layers):
        lb.load_state_dict(la.state_dict())
    b = PerLayerAdamW(_groups(b_layers), units=units(b_layers), device="cpu", lr=5.0)
    b.load_state_dict(a.state_dict())
    assert b.param_groups[0]["lr"] == 1e-2
    state = b.state[b_layers[0].weight]
    assert state["exp_avg"].device.type == "cpu"
    assert state["exp_avg"].data_ptr() != a.state[a_layers[0].weight]["exp_avg"].data_ptr()
    _train(a_layers, a, 2, seed=1)
    _train(b_layers, b, 2, seed=1)
    _assert_same(a_layers, b_layers, a, b, ("exp_avg", "exp_avg_sq", "step"))


def test_per_layer_refuses_a_negative_prefetch():
    with pytest.raises(ConfigError, match=r"optim_step_prefetch_layers.*>= 0.*-1"):
        PerLayerAdamW(_groups(_layers()), units=[], device="cpu", prefetch_layers=-1)


def test_prefetch_without_the_per_layer_step_names_both():
    import fsdpfn as ff

    with pytest.raises(ConfigError) as info:
        ff.FSDPConfig(optim_step_prefetch_layers=2)
    message = str(info.value)
    assert message.startswith("optim_step_prefetch_layers: ") and "got 2" in message
    assert "per_layer_optim_step=False" in message
    assert ff.FSDPConfig(per_layer_optim_step=True, optim_step_prefetch_layers=2)
    assert ff.FSDPConfig(per_layer_optim_step=True, optim_step_prefetch_layers=0)


def test_per_layer_state_is_carved_from_power_of_two_blocks():
    """Host state sits in a few blocks whose sizes are powers of two (torch's pinned allocator
    rounds each request up to a power of two: state pinned tensor by tensor took up to twice its
    bytes, 1.9x for the 7B shape); largest first, first fit, so the blocks hold the state with
    little to spare, and no two state tensors overlap."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1000, 600)] + [torch.nn.Linear(300, 301) for _ in range(5)]
    ours = PerLayerAdamW(_groups(layers), units=[list(m.parameters()) for m in layers],
                         device="cpu", lr=1e-2)
    for p in (p for layer in layers for p in layer.parameters()):
        p.grad = torch.randn_like(p)
    ours.step()
    tensors = [v for s in ours.state.values() for k, v in s.items() if k != "step"]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    used = sum(t.numel() * t.element_size() for t in tensors)
    rounded = sum(1 << (t.numel() * t.element_size() - 1).bit_length() for t in tensors)
    assert len(storages) < len(tensors) and all(n & (n - 1) == 0 for n in storages.values())
    assert sum(storages.values()) < 1.15 * used < 0.8 * rounded, (storages, used, rounded)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_pinned_state_is_laid_end_to_end_in_one_registered_mapping(monkeypatch):
    """Pinned, the per-layer state is one huge-page mapping registered with the driver once
    (here a recording stand-in for cudaHostRegister: this machine has no CUDA): every tensor has
    its shape and dtype, is 512-byte aligned, writable, inside the registered range and apart
    from the others. Where the mapping cannot be had (the driver refuses, or it is larger than
    the host's available memory) none is made and torch's pinned allocator is the fallback."""
    from fsdpfn.engine import optim_offload

    calls = []

    def register(ptr, nbytes):
        calls.append((ptr, nbytes))
        return True

    requests = [(torch.Size([1000, 600]), torch.float32), (torch.Size([7]), torch.bfloat16),
                (torch.Size([0]), torch.float32), (torch.Size([301, 3]), torch.bfloat16)]
    tensors, registered = optim_offload._carve(requests, True, register)  # noqa: SLF001
    assert len(calls) == 1 and registered == [calls[0][0]]
    start, nbytes = calls[0]
    assert nbytes % (2 << 20) == 0 and nbytes >= 1000 * 600 * 4 + 3 * 512
    spans = []
    for t, (shape, dtype) in zip(tensors, requests):
        assert t.shape == shape and t.dtype == dtype and t.data_ptr() % 512 == 0
        if not t.numel():  # an empty view has no address
            continue
        t.fill_(1)
        end = t.data_ptr() + t.numel() * t.element_size()
        assert start <= t.data_ptr() and end <= start + nbytes
        spans.append((t.data_ptr(), end))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert optim_offload._pinned_mapping(1 << 20, lambda p, n: False) is None  # noqa: SLF001
    monkeypatch.setattr(optim_offload, "available_host_memory", lambda: 1 << 20)
    assert optim_offload._pinned_mapping(4 << 20, register) is None  # noqa: SLF001
    assert len(calls) == 1


def test_fast_pinning_sets_the_register_path_unless_the_user_chose(monkeypatch):
    """The per-layer step pins its host state through torch's register path (threaded page
    touching, then cudaHostRegister): the setting handed to torch names both keys, with one
    thread per core up to 16; a PYTORCH_CUDA_ALLOC_CONF that names a pinned setting is the
    user's choice and is left alone; a torch that refuses the setting keeps its default."""
    import os

    from fsdpfn.engine import optim_offload

    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append,
                        raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    optim_offload._fast_pinning()  # noqa: SLF001
    assert calls == ["pinned_use_cuda_host_register:True,pinned_num_register_threads:16"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_num_register_threads:4")
    optim_offload._fast_pinning()  # noqa: SLF001
    assert len(calls) == 1

    def refuse(setting):
        raise RuntimeError("unknown key")

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse, raising=False)
    optim_offload._fast_pinning()  # noqa: SLF001 - no error escapes
