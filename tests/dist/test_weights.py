"""push_weights end to end: CPU trainer ranks (gloo) push to a real rollout server subprocess
(``python -m fsdpfn.rollout`` on a free 127.0.0.1 port, killed in a finally).

References: the trainer's own logits (``sharded_logits``, the HF model run inside the FSDP root)
and ``forward_logp`` for the same weights and tokens. Every trainer trains first (sft_step, lr
1e-2), so its weights differ from the server's and a push that did nothing would fail.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn.rollout import launch_server
from fsdpfn.testing import save_tiny_model, sharded_logits, tiny_qwen2_config
from fsdpfn.weights import DiskTarget, PushConfig, PushReceipt, RolloutTarget, push_weights
from fsdpfn.wire.http import call
from fsdpfn.wire.protocol import MANIFEST, read_manifest

pytestmark = pytest.mark.dist

# float32 on both sides, and the server holds bit-identical weights (its weights checksum is
# compared with the pushed one). What remains is the order of float32 sums: the server runs the
# plain HF model, the trainer the same model inside FSDP (dp=2: identical code, differences are 0
# in practice) or split over tp=2 ranks (two partial sums of 32 products instead of one of 64, a
# few ulps per op); two 64-wide layers stay below 1e-5, the bound test_shard uses.
LOGITS_TOL = 1e-5
# behav_logp against forward_logp: HF generate (KV cache, left padding) against fsdpfn's packed
# forward with chunked log-softmax; same weights, same float32 math in another order.
LOGP_TOL = 1e-5
PROBE = [[3, 5, 7, 9, 11, 13, 17, 19]]


# ---------------------------------------------------------------- fixtures and rank helpers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("weights") / "tiny",
                               tiny_qwen2_config(), seed=0))


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    """Two rollout servers of the tiny model, started side by side, killed at the end."""
    logs = tmp_path_factory.mktemp("logs")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(launch_server, model_dir, log_dir=logs, health_timeout=120)
                   for _ in range(2)]
    procs = []
    try:
        for f in futures:
            procs.append(f.result())
        yield procs
    finally:
        for f in futures:  # also those whose sibling failed to start
            if f.exception() is None:
                f.result().close()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def _batch(seed: int, B: int = 4, T: int = 12) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.bool)
    loss = attn.clone()
    loss[:, :2] = False
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                      batch_size=[B])


def _trained(path_or_config, tp: int, steps: int, seed: int = 0):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=tp), device_type="cpu")
    source = ({"model_path": path_or_config} if isinstance(path_or_config, str)
              else {"model_config": path_or_config})
    state = ff.shard_model(ff.EngineConfig(dtype="float32", optimizer=ff.OptimizerConfig(lr=1e-2),
                                           **source), mesh)
    for i in range(steps):
        state, _ = ff.sft_step(state, _batch(seed + i), ff.SFTConfig())
    return state


def _probe(url: str) -> tuple[int, torch.Tensor]:
    answer = call(url, "/forward", {"input_ids": PROBE, "return_logits": True}, timeout=30)
    return answer["weight_version"], torch.tensor(answer["logits"])


def _on_rank0(fn):
    """fn() on rank 0, its value on every rank."""
    box = [fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _catch(fn):
    try:
        fn()
        return None
    except ff.WeightSyncError as exc:
        return str(exc)


# ---------------------------------------------------------------- a push lands, exactly


def push_and_compare(path, urls, tp, transport, root, steps):
    state = _trained(path, tp, steps, seed=10 * steps)
    before = _on_rank0(lambda: [_probe(url) for url in urls])
    target = RolloutTarget(urls, config=PushConfig(transport=transport, disk_root=root,
                                                   timeout_s=30, bucket_bytes=96 * 1024))
    receipt = push_weights(state, target)
    group = target._servers.group.live  # noqa: SLF001 - rank 0 holds it; None elsewhere, disk
    again = push_weights(state, target)  # the group is reused, not rebuilt
    reused = target._servers.group.live is group  # noqa: SLF001
    ours = sharded_logits(state, torch.tensor(PROBE))
    after = _on_rank0(lambda: [_probe(url) for url in urls])
    target.close()
    return receipt, again, reused, state.version, before, after, ours


def _tensors_and_bytes(model_dir) -> tuple[int, int]:
    """What a push of the model at ``model_dir`` carries, from the HF model itself: each
    distinct tensor once (a tied head is its embedding), at 4 bytes (float32)."""
    from transformers import AutoModelForCausalLM

    params = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())
    return len(params), sum(p.numel() * 4 for p in params.values())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,transport,steps,n_servers",
                         [(1, "broadcast", 1, 2), (1, "disk", 2, 2), (2, "broadcast", 3, 1),
                          (2, "disk", 4, 1)],
                         ids=["dp2-broadcast-2servers", "dp2-disk-2servers", "tp2-broadcast",
                              "tp2-disk"])
def test_push_lands_and_server_logits_equal_trainer(spmd2, servers, model_dir, tmp_path, tp,
                                                   transport, steps, n_servers):
    """Over the update channel and from disk, to one or two servers, from dp or tp ranks."""
    urls = [s.url for s in servers[:n_servers]]
    results = spmd2.run(push_and_compare, args=(model_dir, urls, tp, transport,
                                                str(tmp_path / "push"), steps),
                        timeout=180)
    receipts = [r[0] for r in results] + [r[1] for r in results]
    receipt, _, reused, version, before, after, ours = results[0]
    assert isinstance(receipt, PushReceipt)
    assert {(r.version, r.n_tensors, r.n_bytes) for r in receipts} == \
        {(version, *_tensors_and_bytes(model_dir))}
    assert reused
    assert version == steps
    if transport == "broadcast":  # the servers' own seconds, within the push's (rank 0)
        assert all(0 <= r.apply_s <= r.seconds for r in results[0][:2])
    for (v_before, l_before), (v_after, l_after) in zip(before, after):
        assert v_before != version and v_after == receipt.version  # moved to the pushed version
        assert float((l_before - ours).abs().max()) > 1e-3  # the push had something to change
        torch.testing.assert_close(l_after, ours, atol=LOGITS_TOL, rtol=LOGITS_TOL)
    if transport == "disk":  # keep_last=2 rotation of the published versions
        assert sorted(p.name for p in (tmp_path / "push").iterdir()) == [f"v{version}"]


# ---------------------------------------------------------------- the update channel


def push_over_channel(path, url, plain_url):
    """Pushes that make no HTTP request; a server that dropped the group; a server without a
    channel (SGLang's protocol, then its probe)."""
    import sys

    from fsdpfn.wire import http

    state = _trained(path, 1, 1, seed=3)
    target = RolloutTarget(url, config=PushConfig(timeout_s=30))
    push_weights(state, target)  # sets up: /get_model_info, the group, the channel
    counted = []
    real_call = http.call
    # every module of the push that makes requests (each holds its own reference to call)
    callers = [m for name, m in list(sys.modules.items())
               if name.startswith("fsdpfn.weights.") and getattr(m, "call", None) is real_call]
    assert len(callers) >= 3, callers  # servers, update_group, senders at least
    for m in callers:
        m.call = lambda *a, **k: (counted.append(a[1]), real_call(*a, **k))[1]
    try:
        fast = [push_weights(state, target).version for _ in range(2)]
        over_channel = bool(target._servers.channels)  # noqa: SLF001 - rank 0 only
        requests = list(counted)
        # the server drops the group: its channel closes, the next push sets up again
        _on_rank0(lambda: call(url, "/destroy_weights_update_group",
                               {"group_name": target.config.group_name}, timeout=10))
        again = push_weights(state, target).version
        recovered = list(counted[len(requests):])
    finally:
        for m in callers:
            m.call = real_call
    plain = RolloutTarget(plain_url, config=PushConfig(timeout_s=30))
    via_sglang = push_weights(state, plain).version
    plain_channels = len(plain._servers.channels)  # noqa: SLF001
    after = [_on_rank0(lambda: _probe(u)) for u in (url, plain_url)]
    ours = sharded_logits(state, torch.tensor(PROBE))
    target.close()
    plain.close()
    return (fast, over_channel, requests, again, recovered, via_sglang, plain_channels,
            state.version, after, ours)


@pytest.mark.timeout(240)
def test_channel_pushes_make_no_http_request_and_recover(spmd2, servers, model_dir, tmp_path):
    plain = launch_server(model_dir, log_dir=tmp_path, health_timeout=120,
                          extra_args=("--no-channel",))
    try:
        results = spmd2.run(push_over_channel, args=(model_dir, servers[0].url, plain.url),
                            timeout=180)
    finally:
        plain.close()
    (fast, over_channel, requests, again, recovered, via_sglang, plain_channels, version,
     after, ours) = results[0]
    assert fast == [version, version] and again == version == via_sglang
    assert over_channel and requests == []  # no HTTP request at all on the fast path
    assert "/get_model_info" in recovered and "/init_weights_update_group" in recovered
    assert plain_channels == 0  # --no-channel: the push in SGLang's protocol
    for v, logits in after:
        assert v == version
        torch.testing.assert_close(logits, ours, atol=LOGITS_TOL, rtol=LOGITS_TOL)


# ---------------------------------------------------------------- behaviour log-probs


def generate_and_score(path, url, temperature):
    state = _trained(path, 1, 1, seed=77)
    push_weights(state, RolloutTarget(url, config=PushConfig(timeout_s=30)))
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]]
    out = _on_rank0(lambda: call(url, "/generate", {"input_ids": prompts, "sampling_params": {
        "temperature": temperature, "top_p": 0.9, "max_new_tokens": 8, "n": 2, "seed": 5},
        "return_format": "fsdpfn"},
        timeout=60))
    rows = [prompts[o["prompt_index"]] + o["output_ids"] for o in out["outputs"]]
    T = max(map(len, rows))
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.bool)
    behav = torch.zeros(len(rows), T)
    for i, (row, o) in enumerate(zip(rows, out["outputs"])):
        ids[i, :len(row)] = torch.tensor(row)
        attn[i, :len(row)] = True
        behav[i, len(row) - len(o["output_ids"]):len(row)] = torch.tensor(o["output_logprobs"])
    loss = attn & (behav != 0)
    batch = TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                       batch_size=[len(rows)])
    logp = ff.forward_logp(state, batch, temperature=temperature)["logp"]
    return out["weight_version"], state.version, loss, behav, logp


@pytest.mark.timeout(180)
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_generation_logprobs_match_trainer_forward_logp(spmd2, server, model_dir, temperature):
    results = spmd2.run(generate_and_score, args=(model_dir, server.url, temperature),
                        timeout=150)
    served_version, version, loss, behav, logp = results[0]
    assert served_version == version
    assert int(loss.sum()) == 4 * 8  # 4 samples of 8 tokens (no stop tokens)
    torch.testing.assert_close(behav[loss], logp[loss], atol=LOGP_TOL, rtol=0)


# ---------------------------------------------------------------- mismatches are refused


def push_mismatched(url, root):
    names = _trained(tiny_qwen2_config(num_hidden_layers=3).to_dict(), 1, 1)
    shapes = _trained(tiny_qwen2_config(intermediate_size=96).to_dict(), 1, 1)
    before = _on_rank0(lambda: _probe(url))
    errors = {
        # the server's own validation (the trainer does not look first)
        "names-broadcast": _catch(lambda: push_weights(names, RolloutTarget(
            url, config=PushConfig(precheck=False, timeout_s=30)))),
        "shapes-broadcast": _catch(lambda: push_weights(shapes, RolloutTarget(
            url, config=PushConfig(precheck=False, timeout_s=30)))),
        "shapes-disk": _catch(lambda: push_weights(shapes, RolloutTarget(url, config=PushConfig(
            transport="disk", disk_root=root, precheck=False, timeout_s=30)))),
        # the trainer's precheck, before any byte is sent
        "names-precheck": _catch(lambda: push_weights(names, RolloutTarget(
            url, config=PushConfig(timeout_s=30)))),
    }
    after = _on_rank0(lambda: _probe(url))
    info = _on_rank0(lambda: call(url, "/get_model_info", timeout=10))
    return errors, before, after, info


@pytest.mark.timeout(240)
def test_mismatched_push_fails_on_every_rank_and_server_keeps_serving(spmd2, server, tmp_path):
    results = spmd2.run(push_mismatched, args=(server.url, str(tmp_path / "push")), timeout=180)
    url = server.url
    for rank, (errors, *_rest) in enumerate(results):
        for case, message in errors.items():
            assert message is not None, f"rank {rank}, {case}: no WeightSyncError"
            assert url in message, (case, message)
            if rank > 0:
                assert message.startswith("(raised on rank 0)"), message
        assert "tensor 'model.layers.2." in errors["names-broadcast"]
        assert "name must be a parameter of the served model" in errors["names-broadcast"]
        # over the update channel the server refuses before any byte is sent
        assert "answered 400: update refused before any byte was sent" in \
            errors["names-broadcast"]
        assert ("tensor 'model.layers.0.mlp.gate_proj.weight': shape must equal the served "
                "[128, 64], got [96, 64]") in errors["shapes-broadcast"]
        assert "shape must equal the served [128, 64], got [96, 64]" in errors["shapes-disk"]
        assert "name must be a parameter of the served model" in errors["names-precheck"]
        assert "HTTP" not in errors["names-precheck"]  # refused before sending anything
    errors, before, after, info = results[0]
    assert after[0] == before[0] and info["version"] == before[0]
    assert torch.equal(after[1], before[1])  # the previous weights, bit for bit


def _fail_at_last(index: int, n_buckets: int) -> None:
    if index == n_buckets - 1:
        raise RuntimeError("the trainer fails once its last bucket is out")


def push_failing_after_the_last_bucket(path, url, bucket_bytes):
    # version 6: no other test of the module pushes it (they push 1 to 4), so the server can
    # never be serving it already, whichever tests a worker ran first
    state = _trained(path, 1, 6, seed=7)
    before = _on_rank0(lambda: _probe(url))
    message = _catch(lambda: push_weights(state, RolloutTarget(url, config=PushConfig(
        timeout_s=30, bucket_bytes=bucket_bytes, on_bucket=_fail_at_last))))
    after = _on_rank0(lambda: _probe(url))
    return message, before, after, state.version


@pytest.mark.timeout(240)
@pytest.mark.parametrize("bucket_bytes", [1 << 30, 32 * 1024], ids=["one-bucket", "buckets"])
def test_a_push_failing_after_its_last_bucket_leaves_the_server_as_it_was(spmd2, server,
                                                                          model_dir, bucket_bytes):
    """Every byte went out, then the trainer fails: the server, which swaps only on the
    trainer's commit after its "ready", keeps the weights and version it served."""
    results = spmd2.run(push_failing_after_the_last_bucket,
                        args=(model_dir, server.url, bucket_bytes), timeout=200)
    for message, *_ in results:
        assert message is not None and "the trainer fails once its last bucket is out" in \
            message, message
    _, before, after, version = results[0]
    assert after[0] == before[0] != version
    assert torch.equal(after[1], before[1])  # the previous weights, bit for bit


# ---------------------------------------------------------------- a server dies mid-push


def _signal_at(pid: int, sig: int, at: int, index: int, n_buckets: int) -> None:
    if index == at:
        os.kill(pid, sig)


def push_to_dying(path, url, pid, sig, timeout_s):
    state = _trained(path, 1, 1)
    hook = functools.partial(_signal_at, pid, sig, 2)
    target = RolloutTarget(url, config=PushConfig(timeout_s=timeout_s, init_timeout_s=60,
                                                  bucket_bytes=32 * 1024, on_bucket=hook))
    start = time.monotonic()
    message = _catch(lambda: push_weights(state, target))
    return message, time.monotonic() - start


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_server_dying_mid_push_raises_within_timeout(spmd2, model_dir, tmp_path, sig):
    timeout_s = 4.0
    proc = launch_server(model_dir, log_dir=tmp_path, health_timeout=120)
    try:
        results = spmd2.run(push_to_dying, args=(model_dir, proc.url, proc.pid, int(sig),
                                                 timeout_s), timeout=120)
    finally:
        proc.close()  # SIGKILL also ends a stopped process
    for rank, (message, seconds) in enumerate(results):
        assert message is not None, f"rank {rank}: the push succeeded against a dead server"
        assert proc.url in message, message
        # the group set-up and first buckets take well under a second: what remains is the
        # bounded wait for the dead server plus one verdict
        assert seconds < timeout_s + 10, (rank, seconds, message)


# ---------------------------------------------------------------- DiskTarget


def push_to_disk(root, blocked):
    state = _trained(tiny_qwen2_config().to_dict(), 1, 1)
    receipts = []
    for i in range(3):
        receipts.append(push_weights(state, DiskTarget(root, keep_last=2,
                                                       bucket_bytes=64 * 1024)))
        if i < 2:
            state, _ = ff.sft_step(state, _batch(100 + i), ff.SFTConfig())
    logits = sharded_logits(state, torch.tensor(PROBE))
    error = _catch(lambda: push_weights(state, DiskTarget(blocked)))
    return receipts, state.version, logits, error


@pytest.mark.timeout(180)
def test_disk_target_publishes_atomically_and_rotates(spmd2, tmp_path):
    from transformers import AutoModelForCausalLM

    root = tmp_path / "push"
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    results = spmd2.run(push_to_disk, args=(str(root), str(blocked / "sub")), timeout=150)
    receipts, version, logits, error = results[0]
    assert [r.version for r in receipts] == [1, 2, 3] and version == 3
    assert sorted(p.name for p in root.iterdir()) == ["v2", "v3"]  # no temp dirs left
    manifest = read_manifest(root / "v3")
    assert manifest["version"] == 3 and len(manifest["names"]) == 27
    assert {e["dtype"] for e in manifest["tensors"].values()} == {"float32"}
    files = sorted(p.name for p in (root / "v3").glob("*.safetensors"))
    assert len(files) > 1 and (root / "v3" / "model.safetensors.index.json").is_file()
    assert (root / "v3" / MANIFEST).is_file()
    model = AutoModelForCausalLM.from_pretrained(str(root / "v3"), dtype=torch.float32)
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(PROBE)).logits
    torch.testing.assert_close(theirs, logits, atol=LOGITS_TOL, rtol=LOGITS_TOL)
    for rank, (*_r, err) in enumerate(results):
        assert err is not None and "a_file" in err, (rank, err)
