"""push_weights to a stock SGLang server: CPU trainer ranks (gloo) push to a stand-in written from
SGLang's request dataclasses and its group set-up (tests/sglang_standin.py, not fsdpfn's server).

What it must show: the group forms as SGLang forms it (init_custom_process_group's rendezvous
and prefixes, on the server's side torch's own helper); the tensors arrive bit-exact in SGLang's
packed layout; every request is valid for SGLang's schemas; generation is paused before the first
bucket and resumed after the last (and after a failure); the version is read back with
/get_weight_version; a server that holds something else fails the log-prob probe with a
WeightSyncError on every rank; the disk path speaks /update_weights_from_disk's fields.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

import fsdpfn as ff
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config
from fsdpfn.weights import PushConfig, RolloutTarget, push_weights
from fsdpfn.weights.gather import weight_params

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("sglang") / "tiny", tiny_qwen2_config(),
                               seed=0))


@pytest.fixture()
def standin(model_dir):
    from sglang_standin import serve

    state, server, url = serve(model_dir)
    try:
        yield state, url
    finally:
        server.shutdown()
        server.server_close()


def _trained(path, steps, seed):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=path, dtype="float32",
                                           optimizer=ff.OptimizerConfig(lr=1e-2)), mesh)
    for i in range(steps):
        g = torch.Generator().manual_seed(seed + i)
        ids = torch.randint(0, 128, (4, 12), generator=g)
        attn = torch.ones(4, 12, dtype=torch.bool)
        loss = attn.clone()
        loss[:, :2] = False
        batch = TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                           batch_size=[4])
        state, _ = ff.sft_step(state, batch, ff.SFTConfig())
    return state


def _full_weights(state) -> dict[str, torch.Tensor]:
    """Every rank: the whole weights (a collective per sharded parameter); rank 0 keeps them."""
    out = {}
    for name, p in weight_params(state):
        whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        out[name] = whole.detach().clone()
    return out if dist.get_rank() == 0 else {}


def _catch(fn):
    try:
        return fn(), None
    except ff.WeightSyncError as exc:
        return None, str(exc)


def push_to_standin(path, url, root):
    state = _trained(path, 2, seed=5)
    target = RolloutTarget(url, config=PushConfig(timeout_s=30, bucket_bytes=64 * 1024,
                                                  edge_bucket_bytes=None, disk_root=root))
    receipt = push_weights(state, target)
    group = target._servers.group.live  # noqa: SLF001 - rank 0 holds it
    again = push_weights(state, target)
    reused = group is not None and target._servers.group.live is group  # noqa: SLF001
    weights = _full_weights(state)
    disk = RolloutTarget(url, config=PushConfig(transport="disk", disk_root=root, timeout_s=30))
    on_disk = push_weights(state, disk).version
    return receipt, again.version, reused, state.version, weights, on_disk


@pytest.mark.timeout(240)
def test_push_to_sglang_lands_bit_exact_in_its_protocol(spmd2, standin, model_dir, tmp_path):
    server, url = standin
    results = spmd2.run(push_to_standin, args=(model_dir, url, str(tmp_path / "disk")),
                        timeout=200)
    receipt, again, reused, version, weights, on_disk = results[0]
    assert receipt.version == again == on_disk == version == 2 and reused
    assert server.weight_version == str(version)
    # bit-exact: every tensor the trainer holds arrived, byte for byte (the disk push last)
    assert sorted(server.received) == sorted(weights)
    for name, t in weights.items():
        assert torch.equal(server.received[name], t), name
    served = dict(server.model.named_parameters())
    for name, t in weights.items():
        assert torch.equal(served[name].detach(), t), name
    # every request valid for SGLang's schemas
    assert server.invalid == []
    paths = [e["path"] for e in server.log]
    assert paths.count("/init_weights_update_group") == 1  # the group was reused
    init = next(e["body"] for e in server.log if e["path"] == "/init_weights_update_group")
    assert init["world_size"] == 2 and init["rank_offset"] == 1
    # each push: pause, its buckets (all while paused, the version on the last only), continue,
    # the version read back, then the probe; never a /generate while paused
    updates = [i for i, p in enumerate(paths) if p == "/update_weights_from_distributed"]
    assert len(updates) >= 4 and all(server.log[i]["paused"] for i in updates)
    pauses = [i for i, p in enumerate(paths) if p == "/pause_generation"]
    continues = [i for i, p in enumerate(paths) if p == "/continue_generation"]
    assert len(pauses) == len(continues) == 3  # two broadcast pushes and one from disk
    per_push = len(updates) // 2
    for k in range(2):
        mine = updates[k * per_push:(k + 1) * per_push]
        assert pauses[k] < mine[0] and mine[-1] < continues[k]
        versions = [server.log[i]["body"].get("weight_version") for i in mine]
        assert versions == [None] * (per_push - 1) + [str(version)]
        flushes = [server.log[i]["body"]["flush_cache"] for i in mine]
        assert flushes == [False] * (per_push - 1) + [True]
        assert all(server.log[i]["body"]["load_format"] == "flattened_bucket" for i in mine)
    assert all(not e["paused"] for e in server.log if e["path"] == "/generate")
    assert paths.count("/generate") == 3 and paths.count("/get_weight_version") == 3
    disk = next(e["body"] for e in server.log if e["path"] == "/update_weights_from_disk")
    assert disk["weight_version"] == str(version) and "verify_checksums" not in disk


def push_to_mangling_server(path, url):
    state = _trained(path, 1, seed=9)
    target = RolloutTarget(url, config=PushConfig(timeout_s=30))
    return _catch(lambda: push_weights(state, target))


@pytest.mark.timeout(180)
def test_probe_mismatch_is_a_weight_sync_error_on_every_rank(spmd2, standin, model_dir):
    server, url = standin
    server.corrupt = True  # it loads every tensor reversed: the version moves, the weights lie
    results = spmd2.run(push_to_mangling_server, args=(model_dir, url), timeout=150)
    for value, error in results:
        assert value is None and error is not None
        assert "probe" in error and "forward_logp" in error
    assert not server.paused  # generation resumed before the probe
    assert server.invalid == []
