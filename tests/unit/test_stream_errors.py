"""RolloutStream's failures reach next_batch as errors, never as a wait: a score that returns
the wrong number of results, a prompt_at that raises, and next_batch after close(). The runner
stands in for the servers (the stream's own hook for custom generation)."""

from __future__ import annotations

import pytest

from fsdpfn.errors import ConfigError
from fsdpfn.rollout.stream import RolloutStream

URL = "http://127.0.0.1:9"  # never contacted: the runner answers


def _runner(url, first, prompts):
    """One fake sample per prompt: two tokens of version 0."""
    return [[{"output_ids": [1, 2], "output_logprobs": [-0.5, -0.5],
              "weight_versions": [0, 0]}] for _ in prompts]


def _stream(**kwargs):
    kwargs = {"prompt_at": lambda i: [3, 4, i % 50], **kwargs}
    return RolloutStream([URL], kwargs.pop("prompt_at"), group_size=1, groups_per_step=2,
                         runner=_runner, **kwargs)


def _raising_prompt_at(i):
    return {}[i]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs,message", [
    ({"score": lambda groups: [1.0]},
     r"score: must return one result per group, got 1 for 2 groups"),
    ({"prompt_at": _raising_prompt_at}, r"prompt_at: must return prompt 0 .* raised KeyError: 0"),
], ids=["score-count", "prompt_at-raises"])
def test_a_callable_that_fails_is_an_error_of_next_batch(kwargs, message):
    stream = _stream(**kwargs)
    try:
        with pytest.raises(ConfigError, match=message):
            stream.next_batch(timeout=20)
    finally:
        stream.close()


@pytest.mark.timeout(30)
def test_next_batch_after_close_raises_and_a_good_stream_still_works():
    stream = _stream(score=lambda groups: [len(g.outputs) for g in groups])
    batch = stream.next_batch(timeout=20)
    assert [g.index for g in batch.groups] == [0, 1] and [g.score for g in batch.groups] == [1, 1]
    stream.close()
    with pytest.raises(ConfigError, match=r"next_batch: the stream is closed .* "
                                          r"start=stream.cursor"):
        stream.next_batch(timeout=5)
