"""RolloutStream's failures reach next_batch as errors, never as a wait: a score that returns
the wrong number of results or raises, a runner that answers too few or too many items, a
prompt_at that raises or returns what is not token ids, and next_batch after close(). The runner
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
                         **{"runner": _runner, **kwargs})


def _raising_prompt_at(i):
    return {}[i]


def _runner_off_by(k):
    def runner(url, first, prompts):
        return _runner(url, first, prompts + [None] * k if k > 0 else prompts[:k])
    return runner


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs,message", [
    ({"score": lambda groups: [1.0]},
     r"score: must return one result per group, got 1 for 2 groups"),
    ({"prompt_at": _raising_prompt_at}, r"prompt_at: must return prompt 0 .* raised KeyError: 0"),
    ({"runner": _runner_off_by(-1)}, r"runner: must return one output list per item, got 1 "
                                     r"for 2 items"),
    ({"runner": _runner_off_by(1)}, r"runner: must return one output list per item, got 3 "
                                    r"for 2 items"),
    ({"score": lambda groups: 1 / 0}, r"score: failed on the groups of prompts 0\.\.1: "
                                      r"ZeroDivisionError"),
], ids=["score-count", "prompt_at-raises", "runner-too-few", "runner-too-many",
        "score-raises"])
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


@pytest.mark.timeout(30)
@pytest.mark.parametrize("prompt", ["hello", [1.5, 2], [True, 2], [], [-1, 2]],
                         ids=["text", "floats", "bool", "empty", "negative"])
def test_a_prompt_that_is_not_token_ids_is_an_error_of_next_batch_not_a_hang(prompt):
    """The default runner sends token ids: anything else is named by next_batch, not truncated
    (1.5 sent as 1) and not a dead admission thread the trainer waits on for good."""
    stream = RolloutStream([URL], lambda i: prompt if i == 1 else [3, 4], group_size=1,
                           groups_per_step=2)  # the default runner: never reached
    try:
        with pytest.raises(ConfigError, match=r"prompt_at: must return prompt 1 as a non-empty "
                                              r"list of token ids"):
            stream.next_batch()  # no timeout: a hang fails the test's own
    finally:
        stream.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs,message", [
    ({"version": "x"}, r"version: must be an integer >= 0, got 'x'"),
    ({"version": -1}, r"version: must be an integer >= 0, got -1"),
    ({"seed": "abc"}, r"seed: must be an integer >= 0, got 'abc'"),
    ({"seed": 1.5}, r"seed: must be an integer >= 0, got 1.5"),
    ({"runner": 3}, r"runner: must be callable"),
    ({"group_size": 2.0}, r"group_size: must be an integer >= 1, got 2.0"),
    ({"max_staleness": -1}, r"max_staleness: must be an integer >= 0, got -1"),
    # sampling values by the server's own rules, when the stream is built, not at next_batch
    ({"sampling": {"max_new_tokens": -3}}, r"^sampling.max_new_tokens: must be an int >= 1, "
                                           r"got -3$"),
    ({"sampling": {"temperature": "hot"}}, r"^sampling.temperature: must be a finite number "
                                           r">= 0, got 'hot'$"),
    ({"sampling": {"top_p": 2}}, r"^sampling.top_p: must be in \(0, 1\], got 2$"),
    ({"sampling": {"timeout": 0}}, r"^sampling.timeout: must be a finite number of seconds > 0, "
                                   r"got 0$"),
])
def test_bad_constructor_values_are_refused_by_name(kwargs, message):
    kwargs = {"group_size": 1, "groups_per_step": 1, "runner": _runner, **kwargs}
    with pytest.raises(ConfigError, match=message):
        RolloutStream([URL], lambda i: [1], **kwargs)


@pytest.mark.timeout(30)
def test_numpy_and_torch_integers_are_counts_like_ints():
    np, torch = pytest.importorskip("numpy"), pytest.importorskip("torch")
    stream = RolloutStream([URL], lambda i: [3, 4], group_size=np.int64(2),
                           groups_per_step=torch.tensor(2), max_staleness=np.int32(1),
                           start=np.int64(3), runner=lambda url, first, prompts: [
                               _runner(url, first, prompts)[0] * 2 for _ in prompts])
    try:
        batch = stream.next_batch(timeout=20)
        assert [g.index for g in batch.groups] == [3, 4]
        assert all(len(g.outputs) == 2 for g in batch.groups)
        assert type(stream.G) is int and type(stream.N) is int
    finally:
        stream.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("version", ["6", 6.7, None, True],
                         ids=["string", "float", "none", "bool"])
def test_advance_takes_an_integer_version_and_a_refusal_changes_nothing(version):
    stream = _stream()
    try:
        stream.next_batch(timeout=20)
        with pytest.raises(ConfigError, match=r"version: must be an integer >= 0"):
            stream.advance(version)
        assert stream.version == 0 and stream.advances == 0
        stream.advance(1)
        assert stream.version == 1 and stream.advances == 1
    finally:
        stream.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("jump", [1, 3])
def test_staleness_is_kept_and_reported_in_pushes_whatever_a_push_moves_the_version_by(jump):
    """A loop whose pushes move the version on by 3 (two weight changes between pushes, or a
    resume) keeps the bound in pushes, and reports staleness in pushes too: never above the
    bound it keeps (it once reported 3 against a bound of 1)."""
    served = {"version": 10}

    def runner(url, first, prompts):  # every token sampled by what the servers serve now
        return [[{"output_ids": [1], "output_logprobs": [-0.5],
                  "weight_versions": [served["version"]]}] for _ in prompts]

    stream = RolloutStream([URL], lambda i: [3, 4], group_size=1, groups_per_step=2,
                           max_staleness=1, version=10, runner=runner)
    stats = []
    try:
        for _ in range(6):
            batch = stream.next_batch(timeout=20)
            oldest = min(g.oldest_version for g in batch.groups)
            stats.append((batch.stats["staleness_max"], (batch.version - oldest) // jump))
            served["version"] += jump
            stream.advance(served["version"])
    finally:
        stream.close()
    # in pushes: the version gap divided by what each push moved it on by
    assert [s for s, _ in stats] == [pushes for _, pushes in stats], stats
    assert all(s <= 1 for s, _ in stats) and stats[0][0] == 0, stats


@pytest.mark.timeout(60)
def test_an_advance_beyond_the_batches_handed_out_is_refused_and_a_missing_one_is_named():
    """advance() is once per step: a second one for the same batch (a loop that re-pushes
    unchanged weights) let admission run a step further each time, past max_staleness (a
    trainer at version 2 got tokens of version 1 at max_staleness=0). And a next_batch that
    times out because no advance came says so."""
    stream = _stream(max_staleness=0)
    try:
        with pytest.raises(ConfigError, match=r"advance: must be called once after each step's "
                                              r"push.*0 handed out, 0 advance\(s\) already"):
            stream.advance(1)   # before any batch: belongs in RolloutStream(version=...)
        assert stream.version == 0 and stream.advances == 0
        stream.next_batch(timeout=20)
        with pytest.raises(TimeoutError, match=r"wait for advance\(\): step 1 is past 0 "
                                               r"advance\(s\) \+ max_staleness=0"):
            stream.next_batch(timeout=0.5)
        stream.advance(1)
        with pytest.raises(ConfigError, match=r"1 handed out, 1 advance\(s\) already, got "
                                              r"another \(version 1\)"):
            stream.advance(1)   # the same push again
        assert stream.version == 1 and stream.advances == 1
        stream.next_batch(timeout=20)
        stream.advance(1)       # a step that left the weights as they were: same version
        assert stream.advances == 2
    finally:
        stream.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_staleness", [0, 2])
def test_nothing_past_the_last_of_steps_is_generated(max_staleness):
    """With steps=2 the stream runs no request for a third step, however far max_staleness
    lets it run ahead or however many advances came (a recipe's workflow was started on the
    rows after its last step and cut off at the end), and a third next_batch is StopIteration.
    """
    import threading
    import time

    started, lock = [], threading.Lock()

    def runner(url, first, prompts):
        with lock:
            started.extend(range(first, first + len(prompts)))
        return _runner(url, first, prompts)

    stream = _stream(max_staleness=max_staleness, runner=runner, steps=2, start=4)
    try:
        for _ in range(2):
            stream.next_batch(timeout=20)
            stream.advance(stream.version + 1)
        time.sleep(0.5)  # the admission thread has every chance to send a third step
        with pytest.raises(StopIteration, match=r"steps=2 batches were handed out"):
            stream.next_batch(timeout=5)
        with lock:
            assert sorted(started) == [4, 5, 6, 7], started
        assert stream.cursor == 8
    finally:
        stream.close()


@pytest.mark.parametrize("steps", [-1, 1.5, "2", True])
def test_a_bad_steps_is_refused_by_name(steps):
    with pytest.raises(ConfigError, match=r"steps: must be an integer >= 0, got "):
        _stream(steps=steps)


@pytest.mark.timeout(30)
def test_a_slow_prompt_at_never_holds_the_trainer_back():
    """prompt_at is the user's code (a dataset read, a tokenizer) and runs outside the stream's
    lock: while it is stuck, next_batch still times out on time, advance is refused by its own
    rule, and close() returns at once."""
    import threading
    import time

    release = threading.Event()

    def prompt_at(i):
        if i == 1:
            release.wait(20)  # stuck until the test lets it go (or 20 s: the old lock's wait)
        return [3, 4]

    stream = _stream(prompt_at=prompt_at)
    try:
        time.sleep(0.2)  # the admission thread is inside prompt_at(1)
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError, match=r"groups 0..1 not generated within 0.3 s"):
            stream.next_batch(timeout=0.3)
        with pytest.raises(ConfigError, match=r"advance: must be called once after each step"):
            stream.advance(1)
        stream.close()
        assert time.perf_counter() - t0 < 3, "the trainer's side waited for prompt_at"
    finally:
        release.set()
        stream.close()


@pytest.mark.timeout(30)
def test_a_huge_step_over_endless_data_is_admitted_in_rounds():
    """groups_per_step far beyond any server's batch over data that never ends: groups are
    admitted in rounds of ADMIT_GROUPS (one plan each), the first requests go out before the
    step's last prompt is read, and close() stops admission at the end of a round."""
    import threading
    import time

    from fsdpfn.rollout import stream as stream_mod

    sizes, lock, first_sent = [], threading.Lock(), threading.Event()
    reads = [0]

    def prompt_at(i):
        reads[0] += 1
        return [3, 4]

    def runner(url, first, prompts):
        with lock:
            sizes.append(len(prompts))
        first_sent.set()
        return _runner(url, first, prompts)

    stream = RolloutStream([URL], prompt_at, group_size=1, groups_per_step=10 ** 9,
                           runner=runner)
    try:
        assert first_sent.wait(10), "no request went out before the step's prompts were read"
        t0 = time.perf_counter()
        stream.close()
        assert time.perf_counter() - t0 < 1
        time.sleep(0.3)
        after = reads[0]
        time.sleep(0.3)
        assert reads[0] <= after + stream_mod.ADMIT_GROUPS, "admission went on after close()"
        with lock:
            assert sizes and max(sizes) <= stream_mod.ADMIT_GROUPS, sizes
    finally:
        stream.close()
