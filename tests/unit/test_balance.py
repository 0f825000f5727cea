"""Requests over several rollout servers (fsdpfn.rollout.balance): a group (the n samples of one
prompt) stays whole on one server, the least loaded servers take the work, the servers' requests
run at once, and the answers come back in prompt order; RolloutStream follows the same rule.
The servers are stand-ins for ``generate`` (no HTTP)."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.rollout import balance
from fsdpfn.rollout.balance import Balancer, generate_balanced, split_by_load
from fsdpfn.rollout.sampling import prompt_seed
from fsdpfn.rollout.stream import RolloutStream

A, B, C = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"


class FakeServers:
    """``generate`` as a server would answer it: every sample names its prompt (its first
    token) and the server; each request takes ``delay`` seconds."""

    def __init__(self, delay: float = 0.0, versions=None, fail=(), meet: int = 0):
        self.calls, self.delay, self.versions, self.fail = [], delay, versions or {}, fail
        self.lock = threading.Lock()
        # meet > 0: each request waits until that many are in flight at once (a barrier that
        # breaks after 10 s, failing the request, when they run one after the other)
        self.barrier = threading.Barrier(meet, timeout=10) if meet else None

    def __call__(self, url, prompts, *, n, seed=None, **sampling):
        with self.lock:
            self.calls.append((url, [p[0] for p in prompts], seed, time.perf_counter()))
        if self.barrier is not None:
            self.barrier.wait()
        time.sleep(self.delay)
        if url in self.fail:
            raise WeightSyncError(f"server {url}: /generate failed")
        outputs = [{"prompt_index": i, "output_ids": [p[0], j], "output_logprobs": [-0.5, -0.5],
                    "weight_versions": [self.versions.get(url, 3)] * 2, "server": url}
                   for i, p in enumerate(prompts) for j in range(n)]
        return {"weight_version": self.versions.get(url, 3), "outputs": outputs}


@pytest.fixture
def servers(monkeypatch):
    fake = FakeServers(delay=0.3)
    monkeypatch.setattr(balance, "generate", fake)
    return fake


def test_groups_stay_whole_on_one_server_run_at_once_and_come_back_in_prompt_order(
        monkeypatch):
    servers = FakeServers(meet=2)  # the two servers' requests must be in flight together
    monkeypatch.setattr(balance, "generate", servers)
    prompts = [[100 + i, 7, 7] for i in range(10)]
    answer = generate_balanced([A, B], prompts, n=4, max_new_tokens=8, seed=11)
    outputs = answer["outputs"]
    assert [o["output_ids"][0] for o in outputs] == [100 + i for i in range(10) for _ in range(4)]
    assert [o["prompt_index"] for o in outputs] == [i for i in range(10) for _ in range(4)]
    for i in range(10):  # the group of prompt i: its 4 samples from one server, the one named
        group = outputs[4 * i:4 * i + 4]
        assert {o["server"] for o in group} == {answer["servers"][i]}
    # equal loads: an even cut, contiguous, each server one request, seeds never shared
    assert sorted((u, firsts) for u, firsts, _, _ in servers.calls) == \
        [(A, [100, 101, 102, 103, 104]), (B, [105, 106, 107, 108, 109])]
    seeds = {u: s for u, _, s, _ in servers.calls}  # each prompt's seed as in one request
    assert seeds[A] == 11 and seeds[B] == prompt_seed(11, 5)
    assert answer["weight_version"] == 3


def test_the_least_loaded_server_takes_the_work(servers):
    bal = Balancer([A, B, C])
    held = bal.plan([500.0])  # work outstanding on one server (another caller's request)
    assert [(u, w) for u, _, _, w in held] == [(A, 500.0)]
    answer = generate_balanced(bal, [[1, 2], [3, 4]], n=2, max_new_tokens=8)
    assert set(answer["servers"]) == {B, C}  # A still holds 500 tokens of work
    assert bal.loads() == {A: 500.0, B: 0.0, C: 0.0}  # answered work is no longer outstanding
    bal.done(A, 500.0)
    # one prompt, three idle servers: one request to the idle server given the least work so
    # far (B and C took 20 tokens each, A 500: the first of B and C)
    assert generate_balanced(bal, [[5, 6]], n=3, max_new_tokens=8)["servers"] == [B]


def test_one_server_is_one_request_with_the_callers_seed_and_its_answer(servers):
    answer = generate_balanced(A, [[1], [2], [3]], n=2, max_new_tokens=4, seed=5)
    assert [(u, firsts, seed) for u, firsts, seed, _ in servers.calls] == [(A, [1, 2, 3], 5)]
    assert answer["servers"] == [A, A, A] and len(answer["outputs"]) == 6


def test_the_oldest_version_is_reported_and_a_failure_is_raised_after_every_request(monkeypatch):
    fake = FakeServers(versions={A: 4, B: 5})
    monkeypatch.setattr(balance, "generate", fake)
    assert generate_balanced([A, B], [[1], [2]], n=1)["weight_version"] == 4
    bal = Balancer([A, B])
    monkeypatch.setattr(balance, "generate", FakeServers(delay=0.1, fail={B}))
    with pytest.raises(WeightSyncError, match=f"server {B}"):
        generate_balanced(bal, [[1], [2]], n=1)
    assert bal.loads() == {A: 0.0, B: 0.0}  # the failed request's work is released too


def test_split_by_load_fills_the_least_loaded_first_up_to_a_common_level():
    assert split_by_load([0, 0], [1] * 8) == [(0, 0, 4), (1, 4, 8)]
    assert split_by_load([6, 0], [1] * 8) == [(1, 0, 7), (0, 7, 8)]
    assert split_by_load([10, 0], [1] * 4) == [(1, 0, 4)]
    assert split_by_load([0, 0, 0], [5, 1, 1, 1, 1, 1]) == [(0, 0, 1), (1, 1, 4), (2, 4, 6)]
    assert split_by_load([0], []) == []
    with pytest.raises(ConfigError, match="loads: must name at least one server"):
        split_by_load([], [1])


@settings(derandomize=True, database=None, max_examples=200, deadline=None)
@given(loads=st.lists(st.integers(0, 50), min_size=1, max_size=5),
       works=st.lists(st.integers(1, 20), min_size=1, max_size=30))
def test_split_by_load_is_a_cut_in_order_and_no_server_ends_far_above_the_level(loads, works):
    runs = split_by_load(loads, works)
    assert [i for _, start, stop in runs for i in range(start, stop)] == list(range(len(works)))
    assert len({s for s, _, _ in runs}) == len(runs)  # one run per server at most
    final = list(loads)
    for s, start, stop in runs:
        final[s] += sum(works[start:stop])
    # every server that received work ends within one group of the best possible maximum
    # (or holds a single group); servers that got none were the most loaded
    best = max(max(loads), -(-(sum(loads) + sum(works)) // len(loads)))
    for s, start, stop in runs:
        assert final[s] <= best + max(works) or stop - start == 1, (loads, works, runs)
    idle = [s for s in range(len(loads)) if s not in {r[0] for r in runs}]
    busy = [s for s, _, _ in runs]
    assert all(loads[i] >= min(loads[b] for b in busy) for i in idle)


def test_the_stream_cuts_its_groups_by_the_same_rule():
    calls = []
    lock = threading.Lock()

    def runner(url, first, items):
        with lock:
            calls.append((url, first, len(items)))
        time.sleep(0.05)
        return [[{"output_ids": [1], "weight_versions": [0]}] * 2 for _ in items]

    stream = RolloutStream([A, B], lambda i: [5, 6, 7], group_size=2, groups_per_step=8,
                           max_staleness=0, runner=runner, sampling={"max_new_tokens": 4})
    try:
        got = stream.next_batch(timeout=10)
    finally:
        stream.close()
    assert sorted(calls) == [(A, 0, 4), (B, 4, 4)]  # one step, cut in two equal runs
    assert [g.index for g in got.groups] == list(range(8))
    assert [g.server for g in got.groups] == [A] * 4 + [B] * 4
    assert stream.balancer.loads() == {A: 0.0, B: 0.0}


def test_small_batches_take_turns_over_idle_servers(servers):
    """One group a call on idle servers: each call goes to the server given the least work so
    far, so the spare work moves round instead of always landing on the first server."""
    bal = Balancer([A, B, C])
    where = [generate_balanced(bal, [[1, 2]], n=2, max_new_tokens=4)["servers"][0]
             for _ in range(6)]
    assert where == [A, B, C, A, B, C]


def test_errors_name_the_callers_prompt_index_on_every_server(monkeypatch):
    def refuse_bad(url, prompts, **kw):  # a server numbering the prompts of its own share
        bad = [i for i, p in enumerate(prompts) if p[0] == 99]
        if bad:
            raise WeightSyncError(f"server {url}: /generate answered HTTP 400: "
                                  f"input_ids[{bad[0]}]: must be token ids below 128, got 99")
        return FakeServers()(url, prompts, **kw)

    monkeypatch.setattr(balance, "generate", refuse_bad)
    prompts = [[1, 2]] * 5 + [[99, 2]]
    with pytest.raises(WeightSyncError, match=r"input_ids\[5\]: must be token ids"):
        generate_balanced([A, B], prompts, n=1, max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"^prompts\[5\]: must be a non-empty list"):
        generate_balanced([A, B], [[1, 2]] * 5 + [[]], n=1)
    with pytest.raises(ConfigError, match=r"^prompts\[0\]: must be a non-empty list of token "
                                          r"ids \(ints >= 0; text is tokenized by the caller\)"):
        generate_balanced([A, B], ["hello", "world"], n=1)
    with pytest.raises(ConfigError, match=r"^prompts\[1\]: must be a list of token ids"):
        generate_balanced([A, B], [[1], [2, -3]], n=1)


@pytest.mark.parametrize("urls", [None, 5, [], [A, A + "/"], [" " + A], [A + "?x=1"], [A, None]])
def test_bad_server_lists_are_config_errors_naming_urls(urls):
    with pytest.raises(ConfigError, match=r"^urls: must"):
        Balancer(urls)
    with pytest.raises(ConfigError, match=r"^urls: must"):
        generate_balanced(urls, [[1]], n=1)
