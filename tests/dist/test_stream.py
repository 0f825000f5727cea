"""RolloutStream against a real rollout server subprocess: admission within the staleness bound,
groups in data order, a trainer that trains and pushes between batches.

The bound is checked from the server's own per-token weight versions, not from the stream's
bookkeeping: every sample's staleness (the version trained minus its oldest token's version)
must stay <= max_staleness.
"""

from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.rollout import launch_server
from fsdpfn.rollout.stream import RolloutStream
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config
from fsdpfn.weights import RolloutTarget, push_weights

pytestmark = pytest.mark.dist

PROMPTS = [[3 + i, 5, 7 + i % 5, 9] for i in range(40)]
SAMPLING = {"max_new_tokens": 6, "temperature": 1.0, "timeout": 120.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("stream") / "tiny", tiny_qwen2_config(),
                               seed=0))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc = launch_server(model_dir, log_dir=tmp_path_factory.mktemp("logs"), health_timeout=120)
    try:
        yield proc
    finally:
        proc.close()


def _prompt_at(i):
    return PROMPTS[i]


@pytest.mark.timeout(120)
def test_generation_runs_at_most_max_staleness_steps_ahead(server):
    with RolloutStream(server.url, _prompt_at, group_size=2, groups_per_step=3, max_staleness=1,
                       sampling=SAMPLING, seed=1) as stream:
        first, second = stream.next_batch(timeout=60), stream.next_batch(timeout=60)
        assert [g.index for g in first.groups + second.groups] == list(range(6))
        assert all(len(g.outputs) == 2 and g.prompt_ids == PROMPTS[g.index]
                   for g in first.groups + second.groups)
        with pytest.raises(TimeoutError, match="groups 6..8"):  # step 3 waits for a push
            stream.next_batch(timeout=2)
        assert stream.next_index == 6 and stream.cursor == 6
        stream.advance(1)
        third = stream.next_batch(timeout=60)
        assert [g.index for g in third.groups] == [6, 7, 8] and third.version == 1
        assert third.stats["rollout_wait_seconds"] >= 1.5  # held back through the timeout
        # the span of the step's own requests, not the trainer's wait for them: the groups were
        # generated while the test slept, so the span is positive and covers every group's request
        for batch in (first, second, third):
            span = batch.stats["generation_span_seconds"]
            assert all(g.sent is not None and g.answered >= g.sent for g in batch.groups)
            assert span >= max(g.answered - g.sent for g in batch.groups) > 0


@pytest.mark.timeout(120)
def test_staleness_zero_is_the_synchronous_schedule_and_the_data_end_is_said(server):
    with RolloutStream([server.url], lambda i: PROMPTS[i] if i < 5 else None, group_size=1,
                       groups_per_step=2, max_staleness=0, sampling=SAMPLING, start=1) as stream:
        assert [g.index for g in stream.next_batch(timeout=60).groups] == [1, 2]
        with pytest.raises(TimeoutError):
            stream.next_batch(timeout=1.5)
        stream.advance(1)
        assert [g.index for g in stream.next_batch(timeout=60).groups] == [3, 4]
        stream.advance(2)
        t0 = time.monotonic()
        with pytest.raises(StopIteration, match="prompt 5"):
            stream.next_batch(timeout=60)
        assert time.monotonic() - t0 < 10  # said when known, not at the timeout


def test_bad_arguments_are_refused_by_name():
    for kwargs, field in (({"max_staleness": -1}, "max_staleness"),
                          ({"max_staleness": 1.5}, "max_staleness"),
                          ({"groups_per_step": 0}, "groups_per_step"),
                          ({"sampling": {"max_tokens": 4}}, "sampling")):
        args = {"group_size": 2, "groups_per_step": 2, **kwargs}
        with pytest.raises(ff.ConfigError, match=field):
            RolloutStream("http://127.0.0.1:1", _prompt_at, **args)


def _rows(groups) -> TensorDict:
    """The groups' prompt + answer tokens as an SFT batch (right padded)."""
    rows = [(g.prompt_ids, o["output_ids"]) for g in groups for o in g.outputs]
    T = max(len(p) + len(a) for p, a in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.bool)
    for r, (p, a) in enumerate(rows):
        ids[r, :len(p) + len(a)] = torch.tensor(p + a)
        attn[r, :len(p) + len(a)] = True
    loss = attn.clone()
    loss[:, :len(groups[0].prompt_ids)] = False
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss},
                      batch_size=[len(rows)])


def train_and_push_under_the_bound(model_dir, url, max_staleness, steps):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="float32",
                                           optimizer=ff.OptimizerConfig(lr=1e-2)), mesh)
    target = RolloutTarget(url)
    state_version = push_weights(state, target).version
    seen, versions = [], []
    with RolloutStream(url, _prompt_at, group_size=2, groups_per_step=3,
                       max_staleness=max_staleness, sampling=SAMPLING, seed=3,
                       version=state_version) as stream:
        for _ in range(steps):
            batch = stream.next_batch(timeout=90)
            seen += [g.index for g in batch.groups]
            # the bound, from the server's own token versions
            versions.append((state.version, batch.version,
                             [min(o["weight_versions"]) for g in batch.groups
                              for o in g.outputs if o["weight_versions"]],
                             batch.stats["staleness_max"]))
            state, _ = ff.sft_step(state, _rows(batch.groups), ff.SFTConfig())
            stream.advance(push_weights(state, target).version)
    target.close()
    return seen, versions


@pytest.mark.timeout(240)
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_no_trained_sample_is_staler_than_the_bound(spmd1, server, model_dir, max_staleness):
    seen, versions = spmd1.run(train_and_push_under_the_bound,
                               args=(model_dir, server.url, max_staleness, 4), timeout=200)[0]
    assert seen == list(range(12))  # data order, nothing skipped or repeated
    for trained, reported, oldest, stat in versions:
        assert trained == reported  # the batch names the version it is trained at
        assert oldest and all(trained - v <= max_staleness for v in oldest), (trained, oldest)
        assert stat == max(trained - v for v in oldest)
    # generation ran ahead: some step trained on samples of an older version
    assert any(max(trained - v for v in oldest) >= 1 for trained, _, oldest, _ in versions)


@pytest.mark.timeout(120)
def test_a_servers_refusal_names_the_prompt_of_the_data_order(server):
    """The server numbers the prompts of its own request: a stream's error named input_ids[1]
    for data prompt 3 (the second of the request of prompts 2..3). It names the data index."""
    vocab = tiny_qwen2_config().vocab_size
    bad = 3

    def prompt_at(i):
        return [3, 5, vocab + 7] if i == bad else PROMPTS[i]

    with RolloutStream(server.url, prompt_at, group_size=1, groups_per_step=2, max_staleness=0,
                       sampling=SAMPLING) as stream:
        stream.next_batch(timeout=60)
        stream.advance(0)
        with pytest.raises(ff.WeightSyncError) as info:
            stream.next_batch(timeout=60)
    assert f"input_ids[{bad}]" in str(info.value), str(info.value)
    assert "input_ids[1]" not in str(info.value), str(info.value)
