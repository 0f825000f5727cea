"""fsdpfn.rollout_batch: a rollout server's answers laid out as the public batch."""

from __future__ import annotations

import pytest
import torch

from fsdpfn import keys as K
from fsdpfn.batch import validate_batch
from fsdpfn.errors import BatchError
from fsdpfn import rollout_batch

PROMPTS = [[5, 6, 7], [8]]
OUTPUTS = [  # two samples of each prompt, prompt-major, as generate() returns them
    {"prompt_index": 0, "output_ids": [1, 2], "output_logprobs": [-0.5, -1.5],
     "finish_reason": "stop", "weight_versions": [3, 3]},
    {"prompt_index": 0, "output_ids": [3], "output_logprobs": [-0.25],
     "finish_reason": "length", "weight_versions": [3]},
    {"prompt_index": 1, "output_ids": [9, 9, 4], "output_logprobs": [-1.0, -2.0, -3.0],
     "finish_reason": "stop", "weight_versions": [3, 3, 4]},
    {"prompt_index": 1, "output_ids": [], "output_logprobs": [],
     "finish_reason": "stop", "weight_versions": []},
]


@pytest.mark.parametrize("whole_answer", [False, True])
def test_rows_are_the_prompt_then_the_sample_with_its_logprobs_at_their_positions(whole_answer):
    outputs = {"weight_version": 3, "outputs": OUTPUTS} if whole_answer else OUTPUTS
    batch = rollout_batch(PROMPTS, outputs, 2, [1.0, 0.0, 0.5, 0.25])
    validate_batch(batch)
    assert torch.equal(batch[K.INPUT_IDS], torch.tensor(
        [[5, 6, 7, 1, 2], [5, 6, 7, 3, 0], [8, 9, 9, 4, 0], [8, 0, 0, 0, 0]]))
    lengths = torch.tensor([5, 4, 4, 1])
    assert torch.equal(batch[K.ATTENTION_MASK], torch.arange(5)[None] < lengths[:, None])
    assert torch.equal(batch[K.LOSS_MASK], torch.tensor(
        [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]]).bool())
    assert torch.equal(batch[K.BEHAV_LOGP], torch.tensor(
        [[0, 0, 0, -0.5, -1.5], [0, 0, 0, -0.25, 0], [0, -1.0, -2.0, -3.0, 0], [0, 0, 0, 0, 0]]))
    assert torch.equal(batch[K.REWARDS], torch.tensor([1.0, 0.0, 0.5, 0.25]))
    assert torch.equal(batch[K.GROUP_ID], torch.tensor([0, 0, 1, 1]))
    assert batch[K.BEHAV_LOGP].dtype == batch[K.REWARDS].dtype == torch.float32


@pytest.mark.parametrize("change, match", [
    (dict(group_size=3), r"outputs: must hold group_size x len\(prompts\) = 3 x 2 = 6 .*got 4"),
    (dict(group_size=0), r"group_size: must be an int >= 1, got 0"),
    (dict(rewards=[1.0, 0.0, 0.5]), r"rewards: must hold one reward per answer \(4\), got 3"),
    (dict(outputs={"text": "x"}), r"outputs: must be generate\(\)'s answer .*\['text'\]"),
    (dict(outputs=[{"output_ids": [1]}] * 4), r"outputs\[0\]: must hold output_ids and "
                                              r"output_logprobs"),
    (dict(outputs=[{"output_ids": [1], "output_logprobs": []}] * 4),
     r"outputs\[0\].output_logprobs: must hold one log-prob per output id \(1\), got 0"),
    (dict(prompts=[[5], []]), r"prompts\[1\]: must hold at least one token"),
])
def test_a_count_or_length_that_does_not_fit_is_a_batch_error_naming_it(change, match):
    args = dict(prompts=PROMPTS, outputs=OUTPUTS, group_size=2, rewards=[1.0, 0.0, 0.5, 0.25])
    args.update(change)
    with pytest.raises(BatchError, match=match):
        rollout_batch(args["prompts"], args["outputs"], args["group_size"], args["rewards"])
