"""episode_rows: every sampled token trained exactly once, nothing else, in rows built from the
server's ids alone (properties over random episodes of extending and fresh turns)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn.rollout.episode import Turn, episode_rows

ids = st.lists(st.integers(0, 50), min_size=1, max_size=6)


@st.composite
def episodes(draw):
    """Turns where each either extends the previous context (plus framing tokens) or starts
    fresh; returns the turns and, per turn, whether it extends the one before."""
    turns, extends = [], []
    for i in range(draw(st.integers(1, 6))):
        extend = bool(turns) and draw(st.booleans())
        prompt = (turns[-1].context + draw(st.lists(st.integers(0, 50), max_size=4))
                  if extend else [100 + i] + draw(ids))  # a fresh prompt never extends
        out = draw(st.lists(st.integers(0, 50), max_size=5))
        turns.append(Turn(prompt, out, [-0.5 - 0.1 * k for k in range(len(out))],
                          [i] * len(out)))
        extends.append(extend)
    return turns, extends


@settings(max_examples=200, deadline=None)
@given(episodes())
def test_every_sampled_token_is_trained_once_with_its_own_logprob_and_version(episode):
    turns, extends = episode
    rows = episode_rows(turns)
    # a chain starts at every turn that does not extend its predecessor
    chains, current = [], []
    for turn, ext in zip(turns, extends):
        if not ext and current:
            chains.append(current)
            current = []
        current.append(turn)
    chains.append(current)
    expected = [c for c in chains if any(t.output_ids for t in c)]
    assert len(rows) == len(expected)
    for row, chain in zip(rows, expected):
        assert row.input_ids == chain[-1].context
        assert [t for t, m in zip(row.input_ids, row.loss_mask) if m] == \
            [t for turn in chain for t in turn.output_ids]
        assert [lp for lp, m in zip(row.behav_logp, row.loss_mask) if m] == \
            [lp for turn in chain for lp in turn.logprobs]
        assert [v for v, m in zip(row.versions, row.loss_mask) if m] == \
            [v for turn in chain for v in turn.versions]
        assert all(lp == 0.0 and v == -1 for lp, v, m in
                   zip(row.behav_logp, row.versions, row.loss_mask) if not m)
        assert not row.loss_mask[0]
        if row.oldest_version is not None:
            assert row.oldest_version == min(v for t in chain for v in t.versions)


def test_a_turn_extends_the_longest_open_row_and_branches_start_their_own():
    a = Turn([1, 2], [3], [-1.0], [0])
    b = Turn([1, 2], [4, 5], [-1.0, -2.0], [0, 0])        # a second sample of the same prompt
    c = Turn([1, 2, 4, 5, 9], [6], [-3.0], [1])           # continues b, not a
    rows = episode_rows([a, b, c])
    assert [r.turns for r in rows] == [(0,), (1, 2)]
    assert rows[1].loss_mask == [False, False, True, True, False, True]
    assert rows[1].versions == [-1, -1, 0, 0, -1, 1] and rows[1].oldest_version == 0


def test_a_turn_needs_one_logprob_and_version_per_sampled_token():
    with pytest.raises(ValueError, match="one per output token"):
        Turn([1], [2, 3], [-1.0], [0, 0])
    with pytest.raises(ValueError, match="prompt_ids"):
        Turn([], [2], [-1.0], [0])


def _result(index, reward, turns):
    from fsdpfn.app.recipes.workflow import EpisodeResult
    return EpisodeResult(index, turns, reward, None, 0.0)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_each_row_carries_its_episodes_group_advantage(estimator):
    """Two data rows x 3 episodes; one episode splits into two rows. Every row's advantage is
    its episode's, from the episodes of its data row alone (float64 reference)."""
    import torch

    from fsdpfn import keys as K
    from fsdpfn.app.recipes.workflow import episodes_batch

    def t(prompt, out, v=0):
        return Turn(prompt, out, [-1.0] * len(out), [v] * len(out))

    results = [_result(0, 1.0, [t([1, 2], [3])]),
               _result(0, 0.0, [t([1, 2], [4, 5]), t([9], [6])]),   # two rows
               _result(0, 0.5, [t([1, 2], [7])]),
               _result(1, 2.0, [t([8], [3, 3])]),
               _result(1, 2.0, [t([8], [4])]),
               _result(1, -1.0, [t([8], [5])])]
    batch, stats = episodes_batch(results, 3, max_tokens=100, estimator=estimator)
    assert stats["episode_rows"] == 7 and batch[K.GROUP_ID].tolist() == [0, 0, 0, 0, 1, 1, 1]
    rewards = torch.tensor([r.reward for r in results], dtype=torch.float64).view(2, 3)
    if estimator == "rloo":
        ref = rewards - (rewards.sum(1, keepdim=True) - rewards) / 2
    else:
        ref = rewards - rewards.mean(1, keepdim=True)
        if estimator == "grpo":
            ref = ref / (rewards.std(1, keepdim=True) + 1e-6)
    per_episode = ref.flatten()
    owners = [0, 1, 1, 2, 3, 4, 5]
    mask = batch[K.LOSS_MASK]
    for b, k in enumerate(owners):
        assert batch[K.REWARDS][b] == results[k].reward
        adv = batch[K.ADVANTAGES][b]
        assert torch.allclose(adv[mask[b]].double(), per_episode[k].expand(int(mask[b].sum())),
                              atol=1e-6)
        assert (adv[~mask[b]] == 0).all()


def test_turns_at_another_temperature_than_the_trainers_stop_the_run_by_name():
    from fsdpfn.app.recipes.workflow import check_episodes
    from fsdpfn.errors import ConfigError

    def at(temperature):
        return _result(3, 1.0, [Turn([1, 2], [3, 4], [-0.5, -0.7], [0, 0], temperature)])

    check_episodes([at(1.0), at(None)], "agents:solve", 1.0)  # None: the server did not say
    check_episodes([at(0.7)], "agents:solve", 0.7)
    with pytest.raises(ConfigError, match=r"rollout.workflow: agents:solve sampled a turn at "
                       r"temperature 0.3 for data row 3, but ppo.temperature is 1"):
        check_episodes([at(1.0), at(0.3)], "agents:solve", 1.0)
    with pytest.raises(ConfigError, match=r"sampled a turn greedily \(temperature 0\)"):
        check_episodes([at(0.0)], "agents:solve", 1.0)


def test_messages_name_the_row_of_the_data_files_beside_its_position():
    """A message named the episode's position in the shuffled data order (3) as "data row 3",
    where the row a user can look up in train_files is its own index (12)."""
    import attrs

    from fsdpfn.app.recipes.workflow import check_episodes
    from fsdpfn.errors import ConfigError

    turn = Turn([1, 2], [3, 4], [-0.5, -0.7], [0, 0], 0.3)
    filed = attrs.evolve(_result(3, 1.0, [turn]), row_index=12)
    assert filed.where == "data row 12 (position 3 of the run's data order)"
    assert attrs.evolve(filed, row_index=3).where == "data row 3"  # the same: said once
    assert attrs.evolve(filed, row_index=None).where == "data row 3"  # no index of its own
    with pytest.raises(ConfigError, match=r"for data row 12 \(position 3 of the run's data "
                                          r"order\), but ppo.temperature"):
        check_episodes([filed], "agents:solve", 1.0)


def test_a_step_whose_every_episode_failed_stops_the_run():
    import attrs

    from fsdpfn.app.recipes.workflow import check_episodes
    from fsdpfn.errors import ConfigError

    ok = _result(0, 1.0, [Turn([1], [2], [-0.1], [0], 1.0)])
    failed = attrs.evolve(ok, error="raised RuntimeError: tool crashed")
    check_episodes([ok, failed], "agents:solve", 1.0)
    with pytest.raises(ConfigError, match=r"every episode of the step failed \(2\); "
                       r"agents:solve on data row 0: raised RuntimeError: tool crashed"):
        check_episodes([failed, failed], "agents:solve", 1.0)


def test_rewards_a_workflow_may_return():
    import numpy as np
    import torch

    from fsdpfn.app.recipes.workflow import to_reward

    for value, want in ((1, 1.0), (True, 1.0), (np.float32(0.25), 0.25), (torch.tensor(0.75), 0.75),
                        (np.array(-2.0), -2.0), ([0.5, torch.tensor(0.25)], 0.75)):
        assert to_reward(value, 2 if isinstance(value, list) else 1) == want
    for bad in (None, "great", float("nan"), torch.tensor([1.0, 2.0]), torch.tensor(float("inf"))):
        with pytest.raises(ValueError, match="must return a finite number"):
            to_reward(bad, 1)
    with pytest.raises(ValueError, match="returned 1 rewards for 2 turns"):
        to_reward([1.0], 2)
    # finite in Python, inf in the float32 batch (which refused it, ending the run)
    with pytest.raises(ValueError, match=r"within float32's range .* got 1e\+39 \(float\)"):
        to_reward(1e39, 1)
    with pytest.raises(ValueError, match=r"per-turn rewards summing to 4e\+38, past float32"):
        to_reward([2e38, 2e38], 2)
    assert to_reward(3e38, 1) == 3e38
