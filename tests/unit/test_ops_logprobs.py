"""fsdpfn.ops.logprobs against float64 references written the naive way.

Tolerances: the ops compute in float32, the references in float64 on the same (float32-representable)
inputs. log-softmax of O(10) logits has absolute float32 error ~ a few ulp of the largest logit
(~1e-6 .. 1e-5); matmuls over H <= 16 add ~H ulp. We use rtol=1e-5, atol=1e-5 (scaled by the logit
magnitude where it can be large) for values and gradients.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.ops import chunked_logprobs, token_entropy, token_logprobs

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None)


# --------------------------------------------------------------------------------------------
# naive float64 references
# --------------------------------------------------------------------------------------------

def ref_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Row by row: logp = z_t - log sum exp z, H = -sum p log p; logits[N, V] float64."""
    logp, ent = [], []
    for z_row, t in zip(logits / temperature, targets.tolist()):
        m = z_row.max()
        log_z = m + torch.log(torch.exp(z_row - m).sum())
        log_p = z_row - log_z
        logp.append(log_p[t])
        ent.append(-(log_p.exp() * log_p).sum())
    if not logp:
        return logits.new_zeros(0), logits.new_zeros(0)
    return torch.stack(logp), torch.stack(ent)


def assert_close(actual, expected, *, rtol=1e-5, atol=1e-5, what=""):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------------------------
# token_logprobs / token_entropy
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(lead=st.lists(st.integers(0, 4), min_size=0, max_size=2), vocab=st.integers(1, 40),
       scale=st.sampled_from([0.1, 1.0, 10.0]), temperature=st.sampled_from([1.0, 0.5, 1.7]),
       seed=st.integers(0, 2**16))
def test_token_logprobs_and_entropy_match_reference(lead, vocab, scale, temperature, seed):
    torch.manual_seed(seed)
    logits = torch.randn(*lead, vocab) * scale
    targets = torch.randint(0, vocab, tuple(lead))
    logp = token_logprobs(logits, targets, temperature=temperature)
    ent = token_entropy(logits, temperature=temperature)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert logp.shape == tuple(lead) and ent.shape == tuple(lead)
    ref_lp, ref_h = ref_logprobs_entropy(logits.double().reshape(-1, vocab), targets.reshape(-1), temperature)
    tol = 1e-5 * max(1.0, scale / temperature)  # error scales with the logit magnitude
    assert_close(logp.reshape(-1), ref_lp, atol=tol, what="logp")
    assert_close(ent.reshape(-1), ref_h, atol=tol, what="entropy")


def test_token_logprobs_upcasts_bf16_and_gradients_flow():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11).bfloat16().requires_grad_()
    targets = torch.randint(0, 11, (3, 5))
    logp = token_logprobs(logits, targets)
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    # d sum logp / d z = onehot - softmax: rows sum to 0
    assert logits.grad.float().sum(-1).abs().max() < 2e-2  # bf16 grad: 8 mantissa bits


def test_token_entropy_handles_minus_inf_logits():
    logits = torch.tensor([[0.0, 0.0, float("-inf")]])
    assert torch.allclose(token_entropy(logits), torch.tensor([math.log(2.0)]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_entropy_gradient_with_minus_inf_logits_matches_float64(temperature):
    # logits masked to -inf (a vocabulary restricted by the user) must not poison the gradient:
    # dH/dz_i = -p_i (log p_i + H) on the finite entries, 0 on the masked ones
    torch.manual_seed(0)
    logits = torch.randn(3, 7)
    logits[0, 2] = logits[1, 0] = logits[1, 5] = float("-inf")
    x = logits.clone().requires_grad_(True)
    weights = torch.tensor([0.5, -1.0, 2.0])
    (token_entropy(x, temperature=temperature) * weights).sum().backward()
    z = logits.double() / temperature
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    h = -plogp.sum(-1, keepdim=True)
    ref = -torch.where(p > 0, p * (logp + h), torch.zeros_like(p)) / temperature
    ref = ref * weights.double()[:, None]
    assert torch.isfinite(x.grad).all(), x.grad
    assert (x.grad.double() - ref).abs().max() < 1e-6


def test_bad_arguments_raise():
    logits, targets = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ConfigError, match="temperature"):
        token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(BatchError, match="targets"):
        token_logprobs(logits, torch.zeros(3, dtype=torch.long))
    hidden, weight = torch.zeros(4, 2), torch.zeros(3, 2)
    tgt = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ConfigError, match="chunk_size.*0"):
        chunked_logprobs(hidden, weight, tgt, chunk_size=0)
    with pytest.raises(ConfigError, match="temperature.*-1"):
        chunked_logprobs(hidden, weight, tgt, temperature=-1.0)
    with pytest.raises(BatchError, match="hidden"):
        chunked_logprobs(torch.zeros(4, 5), weight, tgt)
    with pytest.raises(BatchError, match="targets"):
        chunked_logprobs(hidden, weight, torch.zeros(5, dtype=torch.long))
    with pytest.raises(BatchError, match="targets.*dtype"):
        chunked_logprobs(hidden, weight, torch.zeros(4))


# --------------------------------------------------------------------------------------------
# chunked_logprobs: values and gradients equal the full-logits computation
# --------------------------------------------------------------------------------------------

def _ref_chunked(hidden, weight, targets, temperature, g_logp, g_ent):
    """float64 values and grads (hidden, weight) of sum(g_logp * logp + g_ent * H) via full logits."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logp, ent = ref_logprobs_entropy(h @ w.t(), targets, temperature)
    obj = (logp * g_logp.double()).sum() + (ent * g_ent.double()).sum() if g_ent is not None \
        else (logp * g_logp.double()).sum()
    if obj.requires_grad:
        obj.backward()
        gh, gw = h.grad, w.grad
    else:  # N = 0
        gh, gw = torch.zeros_like(h), torch.zeros_like(w)
    return logp.detach(), ent.detach(), gh, gw


@SETTINGS
@given(n=st.integers(0, 23), hdim=st.integers(1, 12), vocab=st.integers(1, 30),
       chunk_size=st.integers(1, 30), temperature=st.sampled_from([1.0, 0.6, 1.5]),
       with_entropy=st.booleans(), seed=st.integers(0, 2**16))
def test_chunked_matches_full_logits_values_and_grads(n, hdim, vocab, chunk_size, temperature,
                                                      with_entropy, seed):
    torch.manual_seed(seed)
    hidden = torch.randn(n, hdim, requires_grad=True)
    weight = torch.randn(vocab, hdim, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    g_logp, g_ent = torch.randn(n), (torch.randn(n) if with_entropy else None)

    logp, ent = chunked_logprobs(hidden, weight, targets, chunk_size=chunk_size,
                                 temperature=temperature, with_entropy=with_entropy)
    assert logp.shape == (n,) and logp.dtype == torch.float32
    assert (ent is None) == (not with_entropy)
    obj = (logp * g_logp).sum() + ((ent * g_ent).sum() if with_entropy else 0.0)
    obj.backward()

    ref_lp, ref_h, ref_gh, ref_gw = _ref_chunked(hidden, weight, targets, temperature, g_logp, g_ent)
    # logits are sums of hdim products of N(0,1) numbers: |z| ~ sqrt(hdim) * 3 / temperature
    tol = 1e-5 * max(1.0, 3.0 * math.sqrt(hdim) / temperature)
    assert_close(logp, ref_lp, atol=tol, what="logp")
    if with_entropy:
        assert_close(ent, ref_h, atol=tol, what="entropy")
    assert_close(hidden.grad, ref_gh, atol=tol, what="grad hidden")
    assert_close(weight.grad, ref_gw, atol=tol, what="grad weight")

    # and the float32 full-logits ops of this module agree too
    if n:
        full = hidden.detach() @ weight.detach().t()
        assert_close(logp, token_logprobs(full, targets, temperature=temperature), atol=tol)
        if with_entropy:
            assert_close(ent, token_entropy(full, temperature=temperature), atol=tol)


@SETTINGS
@given(chunk_a=st.integers(1, 20), chunk_b=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_chunked_is_independent_of_chunk_size(chunk_a, chunk_b, seed):
    torch.manual_seed(seed)
    hidden, weight = torch.randn(17, 6), torch.randn(9, 6)
    targets = torch.randint(0, 9, (17,))
    a = chunked_logprobs(hidden, weight, targets, chunk_size=chunk_a, with_entropy=True)
    b = chunked_logprobs(hidden, weight, targets, chunk_size=chunk_b, with_entropy=True)
    # same float32 ops per row whatever the chunking, up to matmul blocking: a few ulp
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_chunked_entropy_only_gradient():
    torch.manual_seed(3)
    hidden = torch.randn(7, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    targets = torch.randint(0, 5, (7,))
    _, ent = chunked_logprobs(hidden, weight, targets, chunk_size=3, with_entropy=True, temperature=0.8)
    ent.sum().backward()
    g_ent = torch.ones(7)
    _, _, ref_gh, ref_gw = _ref_chunked(hidden, weight, targets, 0.8, torch.zeros(7), g_ent)
    assert_close(hidden.grad, ref_gh, what="grad hidden")
    assert_close(weight.grad, ref_gw, what="grad weight")


def test_chunked_leading_dims_and_no_grad_inputs():
    torch.manual_seed(4)
    hidden = torch.randn(2, 3, 4, requires_grad=True)
    weight = torch.randn(6, 4)  # frozen lm_head: only hidden gets a grad
    targets = torch.randint(0, 6, (2, 3))
    logp, ent = chunked_logprobs(hidden, weight, targets, chunk_size=4, with_entropy=True)
    assert logp.shape == (2, 3) and ent.shape == (2, 3)
    logp.sum().backward()
    ref_lp, _, ref_gh, _ = _ref_chunked(hidden.reshape(6, 4), weight, targets.reshape(6), 1.0,
                                        torch.ones(6), None)
    assert_close(logp.reshape(-1), ref_lp)
    assert_close(hidden.grad.reshape(6, 4), ref_gh)
    assert weight.grad is None


def test_chunked_bf16_inputs_fp32_math_grads_in_input_dtype():
    torch.manual_seed(5)
    hidden = torch.randn(10, 8).bfloat16().requires_grad_()
    weight = torch.randn(12, 8).bfloat16().requires_grad_()
    targets = torch.randint(0, 12, (10,))
    logp, ent = chunked_logprobs(hidden, weight, targets, chunk_size=3, with_entropy=True)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    (logp.sum() + ent.sum()).backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    # the inputs are exactly representable in float64: fp32 math keeps float32 accuracy on values
    ref_lp, ref_h, ref_gh, ref_gw = _ref_chunked(hidden, weight, targets, 1.0, torch.ones(10), torch.ones(10))
    assert_close(logp, ref_lp, atol=1e-4, what="logp")
    assert_close(ent, ref_h, atol=1e-4, what="entropy")
    # the grads themselves are rounded to bf16 on return: 2^-8 relative
    assert_close(hidden.grad, ref_gh, rtol=1e-2, atol=1e-2, what="grad hidden")
    assert_close(weight.grad, ref_gw, rtol=1e-2, atol=1e-2, what="grad weight")


# --------------------------------------------------------------------------------------------
# memory: peak extra grows with chunk_size, not with N
# --------------------------------------------------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch
    from fsdpfn.ops import chunked_logprobs, token_logprobs
    torch.set_num_threads(1)
    V, H = 32000, 16
    page = resource.getpagesize()

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    def hwm():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

    def peak_extra(mode, n, chunk):
        # the peak RSS (VmHWM) is reset to the current RSS before the run ("5" to clear_refs),
        # so the measurement is this run's alone; ru_maxrss would also carry the peak of the
        # parent this process was forked from
        torch.manual_seed(0)
        hidden = torch.randn(n, H, requires_grad=True)
        weight = torch.randn(V, H, requires_grad=True)
        targets = torch.randint(0, V, (n,))
        before = rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        if mode == "full":
            logp = token_logprobs(hidden @ weight.t(), targets)
        else:
            logp, _ = chunked_logprobs(hidden, weight, targets, chunk_size=chunk, with_entropy=True)
        logp.sum().backward()
        return hwm() - before

    peak_extra("chunked", 64, 16)  # warm-up: thread pools, kernels
    runs = [tuple(a.split(",")) for a in sys.argv[1:]]
    print(json.dumps([peak_extra(m, int(n), int(c)) for m, n, c in runs]))
""")


def _peak_extra_bytes(*runs: tuple[str, int, int]) -> list[int]:
    """Peak extra RSS of each (mode, N, chunk_size) run, each in a fresh process (so no run's
    heap fragmentation shows up in another's measurement)."""
    # glibc's dynamic mmap threshold would serve freed 16 MiB chunks from the heap, whose RSS then
    # grows with fragmentation (allocator noise, not the algorithm): pin the threshold at 1 MiB
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20), "OMP_NUM_THREADS": "1"}
    peaks = []
    for m, n, c in runs:
        out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, f"{m},{n},{c}"],
                             capture_output=True, text=True, timeout=120, check=True, env=env)
        peaks.append(json.loads(out.stdout.strip().splitlines()[-1])[0])
    return peaks


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest number of elements of any tensor an op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_never_creates_more_than_a_chunk_of_logits(with_entropy):
    n, v, h, chunk = 1000, 5000, 8, 64
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    with _LargestTensor() as mode:
        logp, ent = chunked_logprobs(hidden, weight, targets, chunk_size=chunk,
                                     with_entropy=with_entropy)
        (logp.sum() + (ent.sum() if with_entropy else 0)).backward()
    # forward and backward: nothing larger than one chunk of logits or the weight (its grad)
    assert mode.largest <= max(chunk * v, v * h), mode.largest
    with _LargestTensor() as full:
        token_logprobs(hidden @ weight.t(), targets).sum().backward()
    assert full.largest >= n * v  # the instrument sees a full [N, V] when there is one


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm and KiB ru_maxrss")
@pytest.mark.timeout(120)
def test_chunked_peak_memory_grows_with_chunk_size_not_n():
    mib, v, chunk = 2**20, 32000, 128
    # ascending peaks, so each measurement is exact (see the script)
    n_small, n_big, big_chunk, full = _peak_extra_bytes(
        ("chunked", 4096, chunk), ("chunked", 8192, chunk), ("chunked", 2048, 4 * chunk), ("full", 1024, 0))
    # the instrument sees logits: full logits of 1024 rows (125 MiB) show up in the peak
    assert full >= 1024 * v * 4, f"full-logits run measured only {full / mib:.0f} MiB"
    # chunked: 8192 rows would be 1000 MiB of float32 logits; a chunk is 128 x V x 4 = 16 MiB
    assert n_big < 8192 * v * 4 / 10, f"chunked peak {n_big / mib:.0f} MiB"
    # doubling N adds 500 MiB of logits to a full computation; chunked it adds only N x H buffers
    # (< 1 MiB); 16 MiB slack for allocator noise
    assert n_big < n_small + 16 * mib, \
        f"peak grew from {n_small / mib:.0f} MiB to {n_big / mib:.0f} MiB when N doubled"
    # 4x the chunk size: 4x the chunk buffers (2 x 16 MiB -> 2 x 62 MiB), with a quarter of the rows
    assert big_chunk > 2 * n_small, \
        f"chunk_size {4 * chunk} peaked at {big_chunk / mib:.0f} MiB, chunk_size {chunk} at {n_small / mib:.0f} MiB"


@pytest.mark.parametrize("bad", [7, 9, -1])
def test_a_target_outside_the_vocabulary_is_a_batch_error_naming_it(bad):
    """chunked_logprobs read a target past its V rows as another vocabulary shard's row and
    returned a finite log-prob for a token that does not exist; token_logprobs raised torch's
    index error (a device assert on CUDA). Both name the target and V now."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 5, generator=g), torch.randn(7, 5, generator=g)
    targets = torch.tensor([0, bad, 1])
    with pytest.raises(BatchError, match=rf"^targets: must be token ids in \[0, V\) with V = "
                                         rf"weight.shape\[0\] = 7, got {bad} at index \[1\]"):
        chunked_logprobs(hidden, weight, targets, chunk_size=2)
    with pytest.raises(BatchError, match=rf"^targets: .* = 7, got {bad} at index \[1\]"):
        token_logprobs(hidden @ weight.T, targets)


@pytest.mark.parametrize("targets", [torch.tensor([1.7]), torch.tensor([True])])
def test_token_logprobs_refuses_targets_that_are_not_integers(targets):
    # a float id was truncated (1.7 read as 1) and a bool read as 1; chunked_logprobs refused both
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    with pytest.raises(BatchError, match="targets must be an integer tensor, got dtype"):
        token_logprobs(logits, targets)


def test_an_infinite_temperature_is_refused():
    with pytest.raises(ConfigError, match="temperature: must be a finite number >= 1e-06"):
        token_entropy(torch.zeros(2, 5), temperature=float("inf"))
