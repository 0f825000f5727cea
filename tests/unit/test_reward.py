"""The user's reward: spec loading (typed errors), the worker pool (exceptions, hangs, invalid
values, dead workers: reported per sample while the run goes on), and the built-in math reward."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn import serde
from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes import rewards
from fsdpfn.app.recipes.reward import (RewardConfig, RewardPool, build_reward_pool, load_reward)

# a user's reward package, written at test time into a directory that only sys.path names
_SCORES = '''
import math, os, time

def per_sample(prompt, completion, *, answer, sample, bonus=0.0):
    if completion == "raise":
        raise RuntimeError(f"cannot score {prompt}")
    if completion == "hang":
        time.sleep(60)
    if completion == "die":
        os._exit(3)
    if completion in INVALID:
        return INVALID[completion]
    return len(completion) + (answer == completion) + sample.get("weight", 0) + bonus

INVALID = {"nan": math.nan, "inf": math.inf, "str": "1.0", "none": None, "list": [1.0],
           "huge": 1e39}

def batched(prompts, completions, *, answers, samples, bonus=0.0):
    if "raise" in completions:
        raise ValueError("bad batch")
    if "hang" in completions:
        time.sleep(60)
    if "short" in completions:
        return [1.0]
    return [INVALID.get(c, len(prompts) * 100 + len(c) + bonus) for c in completions]

def flag(prompt, completion, *, answer, sample):
    if completion == "np":
        import numpy
        return numpy.bool_(True)
    return completion == "yes"

async def judged(prompt, completion, *, answer, sample, bonus=0.0):
    """An async reward (an LLM judge's async client, say)."""
    import asyncio
    await asyncio.sleep(0)
    if completion == "raise":
        raise RuntimeError(f"judge failed on {prompt}")
    if completion == "hang":
        await asyncio.sleep(60)
    return per_sample(prompt, completion, answer=answer, sample=sample, bonus=bonus)

async def judged_batch(prompts, completions, *, answers, samples, bonus=0.0):
    return batched(prompts, completions, answers=answers, samples=samples, bonus=bonus)

def yields(prompt, completion, *, answer, sample):
    yield 1.0

NOT_CALLABLE = 3

PREPARED = []

def _prepare():
    PREPARED.append(1)

def prepared(prompt, completion, *, answer, sample):
    return float(len(PREPARED))  # 1.0 once the worker ran the hook exactly once

prepared.prepare = _prepare
'''


@pytest.fixture(scope="module")
def user_pkg(tmp_path_factory):
    """'userrewards.scores' importable through sys.path only (not through PYTHONPATH)."""
    root = tmp_path_factory.mktemp("user")
    (root / "userrewards").mkdir()
    (root / "userrewards" / "__init__.py").write_text("")
    (root / "userrewards" / "scores.py").write_text(_SCORES)
    (root / "broken.py").write_text("raise ImportError('missing dependency foo')\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.startswith("userrewards")]:
        del sys.modules[name]


def _reference(prompt, completion, answer, sample, bonus=0.0):
    return float(len(completion) + (answer == completion) + sample.get("weight", 0) + bonus)


# ---------------------------------------------------------------- specs and config


@pytest.mark.parametrize("spec, fragment", [
    ("userrewards.scores", "must be 'package.module:function'"),
    ("userrewards.scores:", "must be 'package.module:function'"),
    ("no_such_pkg.mod:f", "cannot import 'no_such_pkg.mod' (ModuleNotFoundError"),
    ("broken:f", "cannot import 'broken' (ImportError: missing dependency foo)"),
    ("userrewards.scores:missing", "module 'userrewards.scores' has no attribute 'missing'"),
    ("userrewards.scores:NOT_CALLABLE", "'NOT_CALLABLE' in 'userrewards.scores' is not callable"),
    ("does/not/exist.py:f", "cannot import 'does/not/exist.py' (FileNotFoundError"),
])
def test_bad_spec_raises_config_error_naming_key_and_value(user_pkg, spec, fragment):
    with pytest.raises(ConfigError) as info:
        load_reward(spec)
    msg = str(info.value)
    assert msg.startswith("reward.fn: ") and fragment in msg and msg.endswith(f"got {spec!r}")
    with pytest.raises(ConfigError, match="reward.fn"):  # the pool checks before starting
        RewardPool(spec, workers=1)


def test_spec_by_module_and_by_file_path(user_pkg):
    from userrewards.scores import per_sample
    assert load_reward("userrewards.scores:per_sample") is per_sample
    by_file = load_reward(f"{user_pkg / 'userrewards' / 'scores.py'}:flag")
    assert by_file("p", "yes", answer=None, sample={}) is True


def test_config_validates_and_round_trips():
    cfg = RewardConfig(fn="a.b:c", batched=True, workers=0, timeout_s=2, kwargs={"k": [1, 2]})
    assert cfg.timeout_s == 2.0 and serde.from_yaml(serde.to_yaml(cfg), RewardConfig) == cfg
    assert RewardConfig(fn=None).fn is None
    for bad, fragment in [({"fn": "abc"}, "fn: must be 'package.module:function'"),
                          ({"workers": -1}, "workers: must be >= 0, got -1"),
                          ({"timeout_s": 0}, "timeout_s: must be > 0"),
                          ({"on_error": "nan"}, "on_error: must be a finite number"),
                          ({"kwargs": {1: 2}}, "kwargs: must be a mapping with string keys")]:
        with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
            serde.structure(bad, RewardConfig)


def test_build_pool_uses_default_for_none_and_rejects_no_reward():
    pool = build_reward_pool(RewardConfig(fn=None, workers=0), default=rewards.exact_match)
    assert pool.score(["p"], [" 7 "], answers=["7"]).rewards == [1.0]
    with pytest.raises(ConfigError, match="reward.fn: None means the task's built-in reward"):
        build_reward_pool(RewardConfig(fn=None))


def test_unimportable_callable_needs_workers_0():
    with pytest.raises(ConfigError, match="reward.fn: a callable run in worker processes"):
        RewardPool(lambda p, c, **_: 1.0, workers=2)
    pool = RewardPool(lambda p, c, *, answer, sample: len(c), workers=0)
    assert pool.score(["p", "q"], ["ab", ""]).rewards == [2.0, 0.0]


# ---------------------------------------------------------------- the pool


def _rows(completions):
    n = len(completions)
    prompts = [f"prompt {i}" for i in range(n)]
    answers = [c if i % 2 else None for i, c in enumerate(completions)]
    samples = [{"weight": i} for i in range(n)]
    return prompts, answers, samples


def _score(pool, completions):
    prompts, answers, samples = _rows(completions)
    return pool.score(prompts, completions, answers=answers, samples=samples)


@pytest.fixture(scope="module")
def pool(user_pkg):
    with RewardPool("userrewards.scores:per_sample", workers=2, timeout_s=1.0, on_error=-1.0,
                    kwargs={"bonus": 0.5}) as pool:
        yield pool


def test_workers_import_a_module_known_only_to_sys_path(pool, user_pkg):
    assert str(user_pkg) not in os.environ.get("PYTHONPATH", "")
    completions = ["a", "bb", "ccc", "", "dddd"]
    prompts, answers, samples = _rows(completions)
    result = pool.score(prompts, completions, answers=answers, samples=samples)
    want = [_reference(*row, bonus=0.5) for row in zip(prompts, completions, answers, samples)]
    assert result.rewards == want and result.errors == []
    assert result.counts == {"exception": 0, "timeout": 0, "invalid": 0}


def test_raising_sample_is_reported_and_the_others_scored(pool):
    result = _score(pool, ["ok", "raise", "fine"])
    assert result.rewards[1] == -1.0 and result.rewards[0] == _reference("", "ok", None, {}, 0.5)
    (err,) = result.errors
    assert (err.index, err.kind, err.prompt, err.completion) == (1, "exception", "prompt 1",
                                                                 "raise")
    assert "RuntimeError: cannot score prompt 1" in err.message and "scores.py" in err.message
    assert _score(pool, ["x"]).rewards == [1.5]  # still usable


def test_hanging_sample_times_out_fast_and_its_worker_is_replaced(pool):
    before = set(pool.pids)
    t0 = time.monotonic()
    result = _score(pool, ["a", "hang", "bb", "ccc", "dd", "e"])
    assert time.monotonic() - t0 < 5.0
    assert [e.index for e in result.errors] == [1] and result.errors[0].kind == "timeout"
    assert result.counts["timeout"] == 1 and result.rewards[1] == -1.0
    assert result.rewards[2] == _reference("", "bb", None, {"weight": 2}, 0.5)
    assert len(set(pool.pids) - before) == 1 and len(pool.pids) == 2
    (killed,) = before - set(pool.pids)
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left sleeping
        os.kill(killed, 0)
    assert _score(pool, ["a", "b", "c", "d"]).errors == []  # the pool works on afterwards
    assert len(pool.pids) == 2


def test_dead_worker_is_reported_and_replaced(pool):
    result = _score(pool, ["a", "die", "b"])
    assert [(e.index, e.kind) for e in result.errors] == [(1, "exception")]
    assert "exit code 3" in result.errors[0].message
    assert _score(pool, ["a", "b"]).errors == []


@pytest.mark.parametrize("workers", [0, 1])
def test_invalid_returns_are_errors_and_a_bool_counts_as_0_or_1(user_pkg, workers):
    bad = ["nan", "inf", "str", "none", "list", "huge"]
    with RewardPool("userrewards.scores:per_sample", workers=workers) as p:
        result = _score(p, bad + ["fine"])
    assert [e.index for e in result.errors] == list(range(6))
    assert {e.kind for e in result.errors} == {"invalid"} and result.rewards[:6] == [0.0] * 6
    assert "got nan (float)" in result.errors[0].message
    assert "got '1.0' (str)" in result.errors[2].message
    # finite in Python, inf in the float32 batch: it ended the run with a BatchError
    assert "within float32's range" in result.errors[5].message
    assert "got 1e+39 (float)" in result.errors[5].message
    with RewardPool("userrewards.scores:flag", workers=workers) as p:
        assert p.score(["p", "q", "r"], ["yes", "no", "np"]).rewards == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("workers", [0, 1])
def test_an_async_reward_is_awaited(user_pkg, workers):
    """An async def reward's coroutine was scored as 'must return a finite number, got
    <coroutine ...>' on every sample; it is now run to its result, its exceptions and hangs
    reported as a plain reward's are."""
    completions = ["a", "bb", "raise", "nan"]
    with RewardPool("userrewards.scores:judged", workers=workers, timeout_s=1.0,
                    kwargs={"bonus": 0.5}) as p:
        result = _score(p, completions)
        prompts, answers, samples = _rows(completions)
        assert result.rewards[:2] == [_reference(prompts[i], completions[i], answers[i],
                                                 samples[i], 0.5) for i in range(2)]
        assert [(e.index, e.kind) for e in result.errors] == [(2, "exception"), (3, "invalid")]
        assert "RuntimeError: judge failed on prompt 2" in result.errors[0].message
        if workers:
            t0 = time.monotonic()
            assert _score(p, ["hang"]).counts["timeout"] == 1
            assert time.monotonic() - t0 < 5.0
    with RewardPool("userrewards.scores:judged_batch", batched=True, workers=workers) as p:
        assert _score(p, ["a", "bb"]).rewards == [201.0, 202.0]


def test_a_generator_reward_is_refused_before_launch(user_pkg):
    from fsdpfn.app.recipes import default_config
    from fsdpfn.app.recipes.preflight import check_reward

    cfg = default_config("grpo", ["reward.fn=userrewards.scores:yields"])
    with pytest.raises(ConfigError, match=r"^reward\.fn: must return the reward, not yield it"):
        check_reward(cfg)
    check_reward(default_config("grpo", ["reward.fn=userrewards.scores:judged"]))


def test_long_prompt_and_completion_are_truncated_in_reports(user_pkg):
    with RewardPool("userrewards.scores:per_sample", workers=0) as p:
        result = p.score(["P" * 5000], ["raise"])
    assert len(result.errors[0].prompt) <= 200 and " ... " in result.errors[0].prompt


def test_batched_is_one_call_per_batch(user_pkg):
    with RewardPool("userrewards.scores:batched", batched=True, workers=2, timeout_s=1.0,
                    kwargs={"bonus": 0.25}) as p:
        assert len(p.pids) == 1
        ok = _score(p, ["a", "bb", "nan"])
        assert ok.rewards[:2] == [300 + 1.25, 300 + 2.25]  # 3 rows seen in one call
        assert [(e.index, e.kind) for e in ok.errors] == [(2, "invalid")]
        raised = _score(p, ["a", "raise"])
        assert [e.kind for e in raised.errors] == ["exception", "exception"]
        assert "ValueError: bad batch" in raised.errors[0].message
        short = _score(p, ["a", "short", "c"])
        assert short.counts["invalid"] == 3 and "list of 3 numbers" in short.errors[0].message
        t0 = time.monotonic()
        hung = _score(p, ["a", "hang"])
        assert time.monotonic() - t0 < 5.0 and hung.counts["timeout"] == 2
        assert _score(p, ["abc"]).rewards == [100 + 3.25]


def test_score_rejects_mismatched_lengths_and_accepts_empty(pool):
    with pytest.raises(ValueError, match="completions must have one entry per prompt"):
        pool.score(["a", "b"], ["x"])
    assert pool.score([], []).rewards == []


def test_closed_pool_refuses_and_leaves_no_process(user_pkg):
    p = RewardPool("userrewards.scores:per_sample", workers=2)
    p.start()
    procs = [w.proc for w in p._workers]
    p.close()
    assert all(proc.poll() is not None for proc in procs)
    with pytest.raises(RuntimeError, match="after close"):
        p.score(["a"], ["b"])


# ---------------------------------------------------------------- built-in rewards


@pytest.fixture(params=["math_verify", "fallback"])
def verifier(request, monkeypatch):
    if request.param == "math_verify":
        pytest.importorskip("math_verify", reason="the optional extra fsdpfn[math] is not "
                            "installed")
    else:
        monkeypatch.setitem(sys.modules, "math_verify", None)  # import raises ImportError
    return request.param


@pytest.mark.parametrize("completion, answer, want", [
    (r"so the answer is \boxed{42}.", "42", 1.0),
    (r"first \boxed{1}, then \boxed{7}", "7", 1.0),
    ("3 apples and 4 pears make 7 fruits", "7", 1.0),
    ("the total is 1,000.", "1000", 1.0),
    ("x = 3/4", "0.75", 1.0),
    ("5-3 gives 2", "2", 1.0),
    (r"\boxed{41}", "42", 0.0),
    ("it is 42 or 43", "42", 0.0),
    ("no number here", "42", 0.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\frac{1}{2}} then \boxed{3", r"\frac{1}{2}", 1.0),  # last balanced box
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
])
def test_math_reward(verifier, completion, answer, want):
    assert rewards.math("q", completion, answer=answer, sample={}) == want


def test_math_reward_symbolic_with_math_verify(verifier):
    if verifier == "fallback":  # strings differ: the fallback does not know x^{2} is x^2
        assert rewards.math("q", r"\boxed{x^{2}}", answer="x^{2}") == 1.0
    else:
        assert rewards.math("q", r"\boxed{x^{2}}", answer="x^2") == 1.0


def test_math_reward_needs_an_answer():
    with pytest.raises(ValueError, match="needs each row's reference 'answer'"):
        rewards.math("q", "1", answer=None)


def test_exact_match():
    assert rewards.exact_match("q", "  Paris\n", answer="Paris ") == 1.0
    assert rewards.exact_match("q", "paris", answer="Paris") == 0.0


def test_default_math_reward_runs_in_a_worker(user_pkg):
    with RewardPool("fsdpfn.app.recipes.rewards:math", workers=1, timeout_s=30.0) as p:
        result = p.score(["q", "q", "q"], [r"\boxed{6}", "5", r"\boxed{1}"],
                         answers=["6", "5", "2"])
    assert result.rewards == [1.0, 1.0, 0.0] and result.errors == []


_braces = st.recursive(st.text("ab1 ", max_size=3),
                       lambda inner: st.tuples(inner, inner).map(lambda t: "{" + t[0] + "}"
                                                                 + t[1]), max_leaves=6)


@settings(max_examples=60, deadline=None)
@given(inside=_braces, before=st.text("xy {}", max_size=5), after=st.text("xy ", max_size=5))
def test_last_boxed_takes_balanced_nested_content(inside, before, after):
    text = f"{before}\\boxed{{{inside}}}{after}"
    assert rewards.last_boxed(text) == inside.strip()


@settings(max_examples=60, deadline=None)
@given(num=st.integers(-10**6, 10**6), den=st.integers(1, 1000))
def test_fallback_compares_numbers_exactly(num, den):
    value = Fraction(num, den)
    assert rewards.fallback_equal(str(value), f"{num}/{den}")
    assert rewards.fallback_equal(f"{num:,}", str(num))
    assert not rewards.fallback_equal(str(value), str(value + Fraction(1, 1001)))


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.text("abc xyz", max_size=4), max_size=3), n=st.integers(0, 10**9))
def test_last_number_is_the_last_one_written(words, n):
    assert rewards.last_number(f"1 {' '.join(words)} {n} {' '.join(words)}") == str(n)


def test_a_rewards_prepare_hook_runs_once_per_worker_before_its_calls(user_pkg):
    """``fn.prepare()`` (math's import of math-verify) runs when a worker loads the reward, once,
    before any timed call; the built-in math reward no longer imports it at module import."""
    with RewardPool("userrewards.scores:prepared", workers=2, timeout_s=5.0) as pool:
        result = pool.score(["p"] * 6, ["c"] * 6)
    assert result.rewards == [1.0] * 6 and not result.errors
    from fsdpfn.app.recipes import rewards
    assert rewards.math.prepare is rewards._math_verify
    code = ("import sys; import fsdpfn.app.recipes.rewards; "
            "print('math_verify' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
