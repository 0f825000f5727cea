"""Rollout workflows against a real rollout server: episodes recorded through the openai
package's clients, joined into rows exactly, failures scored and described.

References: the server's own answers (token ids it returned, the prompt ids it rendered, checked
against the tokenizer's chat template) and the Hugging Face model's own forward for behav_logp.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.batch import validate_batch
from fsdpfn.app.recipes.workflow import episodes_batch, load_workflow, run_episodes
from fsdpfn.rollout import launch_server
from fsdpfn.rollout.episode import episode_rows
from fsdpfn.testing import write_tiny_hf_dir
from fsdpfn.testing.hf_dir import TOOLS_CHAT_TEMPLATE

pytestmark = pytest.mark.dist
WF = str(Path(__file__).with_name("workflows_for_tests.py"))
TEXTS = ["what is two plus two", "the answer is four", "wrong, try again", "again please",
         "a tool returned seven"] * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_dir(tmp_path_factory.mktemp("wf") / "tiny", texts=TEXTS, seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    proc = launch_server(model_dir, log_dir=tmp_path_factory.mktemp("logs"), health_timeout=120)
    try:
        yield proc
    finally:
        proc.close()


def _hf_logp(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.timeout(180)
def test_a_retry_episode_joins_into_one_row_with_loss_on_sampled_tokens_only(server, model_dir,
                                                                            tok):
    row = {"prompt_ids": tok.encode("what is two plus two"),
           "feedback_ids": tok.encode(" wrong, try again: ")}
    results = run_episodes(server.url, load_workflow(f"{WF}:retry"), [row], 2, timeout_s=60)
    assert [r.error for r in results] == [None, None] and [r.index for r in results] == [0, 0]
    for result in results:
        first, second = result.turns
        assert first.prompt_ids == row["prompt_ids"]  # the ids sent, as the server saw them
        assert second.prompt_ids == first.context + row["feedback_ids"]
        (joined,) = episode_rows(result.turns)
        assert joined.input_ids == second.context
        sampled = [t for t, m in zip(joined.input_ids, joined.loss_mask) if m]
        assert sampled == first.output_ids + second.output_ids  # nothing else has loss
        mask = torch.tensor(joined.loss_mask)
        assert not mask[:len(first.prompt_ids)].any()
        assert not mask[len(first.context):len(second.prompt_ids)].any()  # the feedback
        # behav_logp is the sampling distribution: the HF model's own log-probs (temperature 1)
        ref = _hf_logp(model_dir, joined.input_ids)
        behav = torch.tensor(joined.behav_logp, dtype=torch.float64)[1:]
        assert torch.allclose(behav[mask[1:]], ref[mask[1:]], atol=1e-5), (behav, ref)
        assert result.reward == float(len(second.output_ids) > 0)  # per-turn rewards summed
    batch, stats = episodes_batch(results, 2, max_tokens=1024)
    assert batch[K.LOSS_MASK].sum() == sum(len(t.output_ids) for r in results for t in r.turns)
    assert stats["episode_rows"] == 2 and stats["episode_errors"] == 0
    validate_batch(batch, require=(K.LOSS_MASK, K.BEHAV_LOGP, K.ADVANTAGES))


@pytest.mark.timeout(180)
def test_the_openai_package_drives_the_server_and_every_turn_is_recorded(server, tok):
    rows = [{"question": "what is two plus two"}, {"question": "a tool returned seven"}]
    results = run_episodes(server.url, load_workflow(f"{WF}:chat_twice"), rows, 2, timeout_s=60)
    assert [r.index for r in results] == [0, 0, 1, 1] and all(r.error is None for r in results)
    for result in results:
        first, second = result.turns
        rendered = tok.apply_chat_template([{"role": "user", "content": rows[result.index]
                                             ["question"]}], add_generation_prompt=True,
                                           tokenize=False)
        assert first.prompt_ids == tok.encode(rendered)  # the server's own rendering
        rows_of = episode_rows(result.turns)
        joined = second.prompt_ids[:len(first.context)] == first.context
        assert len(rows_of) == (1 if joined else 2)  # joined exactly when the context extends


@pytest.mark.timeout(180)
def test_seeded_episodes_draw_again_what_they_drew_wherever_they_run(server, tok):
    """run_episodes(seed=s): episode j of data row d draws from row_seed(s, d, j), its k-th
    call from call_seed(that, k), whichever request carries the row; a call's own seed is sent
    as it is."""
    from fsdpfn.rollout.agent import EpisodeClient, call_seed
    from fsdpfn.rollout.device_sampling import row_seed

    rows = [{"question": "what is two plus two"}, {"question": "a tool returned seven"}]
    wf = load_workflow(f"{WF}:chat_twice")

    def drawn(results):
        return [[t.output_ids for t in r.turns] for r in results]
    first, again, other = (drawn(run_episodes(server.url, wf, rows, 2, timeout_s=60, seed=s))
                           for s in (5, 5, 6))
    assert first == again and first != other
    assert first[0] != first[1]  # the two episodes of a row draw from their own seeds
    assert drawn(run_episodes(server.url, wf, rows[1:], 2, first=1, timeout_s=60,
                              seed=5)) == first[2:]  # the row alone, in a request of its own
    ids = tok.encode("the answer is")
    seeded, plain = EpisodeClient(server.url, seed=9), EpisodeClient(server.url)
    try:
        for _ in range(2):  # calls 0 and 1 of the seeded episode, then one with its own seed
            seeded.completions.create(model="policy", prompt=ids, max_tokens=8)
        seeded.completions.create(model="policy", prompt=ids, max_tokens=8, seed=123)
        for s in (call_seed(9, 0), call_seed(9, 1), 123):
            plain.completions.create(model="policy", prompt=ids, max_tokens=8, seed=s)
    finally:
        seeded.close(), plain.close()
    assert [t.output_ids for t in seeded.turns] == [t.output_ids for t in plain.turns]
    assert seeded.turns[0].output_ids != seeded.turns[1].output_ids
    assert row_seed(5, 1, 0) != row_seed(5, 0, 1)
    with pytest.raises(ff.ConfigError,
                       match=r"seed: must be an int in \[0, 2\*\*63\) or None, got -1"):
        EpisodeClient(server.url, seed=-1)


@pytest.mark.timeout(180)
def test_a_turn_that_does_not_extend_the_context_becomes_its_own_row(server, tok):
    row = {"prompt_ids": tok.encode("what is two plus two"),
           "other_ids": tok.encode("a tool returned seven")}
    (result,) = run_episodes(server.url, load_workflow(f"{WF}:summarise"), [row], 1)
    rows = episode_rows(result.turns)
    assert [r.turns for r in rows] == [(0,), (1,)]
    assert [r.input_ids for r in rows] == [t.context for t in result.turns]


@pytest.mark.timeout(180)
def test_failing_workflows_score_on_error_are_described_and_keep_their_turns(server, tok):
    row = {"prompt_ids": tok.encode("what is two plus two")}
    for name, is_timeout, words in (("raises", False, "raised RuntimeError: tool crashed"),
                                    ("hangs", True, "timeout: no result within 2.0 s"),
                                    ("sleeps", True, "timeout: no result within 2.0 s"),
                                    ("not_a_reward", False, "must return a finite number")):
        (result,) = run_episodes(server.url, load_workflow(f"{WF}:{name}"), [row], 1,
                                 timeout_s=2.0, on_error=-1.0)
        assert result.reward == -1.0 and words in result.error, (name, result.error)
        assert result.seconds < 10
    (raised,) = run_episodes(server.url, load_workflow(f"{WF}:raises"), [row], 1, on_error=-1.0)
    batch, stats = episodes_batch([raised], 1, max_tokens=1024)
    assert stats["episode_errors"] == 1 and batch[K.REWARDS].tolist() == [-1.0]
    assert episodes_batch([raised], 1, max_tokens=3)[1]["episode_rows_dropped"] == 1


@pytest.mark.timeout(180)
def test_a_later_turn_past_the_decode_loops_positions_names_the_key_that_sizes_them(model_dir,
                                                                                      tok):
    """A second turn's prompt holds the first turn: past the loop's --decode-max-len the
    call is refused, and the episode's error names rollout.max_episode_tokens (which the
    launcher passes as the servers' --decode-max-len); within it, both turns run."""
    row = {"prompt_ids": tok.encode("what is two plus two"),
           "feedback_ids": tok.encode("wrong, try again")}
    prompt, feedback = len(row["prompt_ids"]), len(row["feedback_ids"])
    assert feedback + 3 >= 5  # the first call (5 new tokens) fits where the second cannot
    # too short for the second call however short the first answer (it may end early), and
    # long enough for any first answer
    for positions, fails in ((prompt + feedback + 3, True), (prompt + 5 + feedback + 4, False)):
        proc = launch_server(model_dir, health_timeout=120, extra_args=(
            "--decode", "loop", "--decode-rows", "8", "--decode-max-len", str(positions)))
        try:
            (result,) = run_episodes(proc.url, load_workflow(f"{WF}:retry"), [row], 1,
                                     on_error=-1.0)
        finally:
            proc.close()
        if fails:
            assert result.reward == -1.0 and len(result.turns) == 1
            assert f"decode max length {positions} (--decode-max-len)" in result.error
            assert result.error.endswith("set rollout.max_episode_tokens to the longest "
                                         "episode (the servers fsdpfn run starts take it as "
                                         "their --decode-max-len)"), result.error
        else:
            assert result.error is None and len(result.turns) == 2, result.error


def test_workflows_that_cannot_be_called_are_refused_before_launch():
    for spec, words in (("no_such_module_here:fn", "cannot import"),
                        (f"{WF}:missing", "has no attribute"),
                        (f"{WF}:wrong_signature", "fn(client, row)"),
                        (f"{WF}:yields_reward", "not yield it"),
                        (f"{WF}:async_yields_reward", "not yield it"),
                        (f"{WF}:yielding_agent", "not yield it"),
                        ("not a spec", "rollout.workflow")):
        with pytest.raises(ff.ConfigError, match="rollout.workflow") as info:
            load_workflow(spec)
        assert words in str(info.value), (spec, str(info.value))


@pytest.mark.timeout(180)
def test_an_object_with_an_async_call_is_awaited_with_the_async_client(server, tok):
    row = {"prompt_ids": tok.encode("what is two plus two")}
    workflow = load_workflow(f"{WF}:async_agent")
    assert workflow.is_async
    results = run_episodes(server.url, workflow, [row], 2, timeout_s=60)
    for result in results:
        assert result.error is None and result.reward == 1.0, result.error
        (turn,) = result.turns
        assert 1 <= len(turn.output_ids) <= 3 and len(turn.logprobs) == len(turn.output_ids)


@pytest.mark.timeout(180)
def test_a_plain_workflow_returning_a_coroutine_is_told_to_be_async(server, tok):
    import warnings
    row = {"prompt_ids": tok.encode("what is two plus two"), "question": "two plus two"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the coroutine is closed, not leaked
        (result,) = run_episodes(server.url, load_workflow(f"{WF}:returns_a_coroutine"), [row],
                                 1, timeout_s=30, on_error=-1.0)
    assert result.reward == -1.0 and "async def" in result.error, result.error


# ---------------------------------------------------------------- the examples


EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples" / "workflows.py")


@pytest.mark.timeout(180)
def test_check_and_retry_on_the_embedded_task_trains_both_answers(tmp_path):
    from fsdpfn.app.recipes.data import AdditionSource
    from fsdpfn.app.recipes.task import AdditionTask, CharTokenizer, TinyModel, save_initial_model

    tok, task = CharTokenizer(), AdditionTask(digits=1)
    save_initial_model(tmp_path / "m", TinyModel(), tok)
    rows = AdditionSource(task, tok, seed=0).take(0, 4)
    with launch_server(tmp_path / "m", log_dir=tmp_path) as srv:
        results = run_episodes(srv.url, load_workflow(f"{EXAMPLES}:check_and_retry"), rows, 4,
                               timeout_s=60)
    assert all(r.error is None for r in results), [r.error for r in results]
    for r in results:
        first_right = tok.decode(r.turns[0].output_ids).strip() == rows[r.index]["answer"]
        assert len(r.turns) == (1 if first_right else 2)
        assert r.reward == 1.0 if first_right else r.reward in (0.0, 0.5)
        (row,) = episode_rows(r.turns)  # the retry extends the first answer: one row
        assert row.input_ids[:len(rows[r.index]["prompt_ids"])] == rows[r.index]["prompt_ids"]
    assert any(len(r.turns) == 2 for r in results)  # an untrained model is wrong somewhere
    batch, stats = episodes_batch(results, 4, max_tokens=64)
    assert stats["episode_rows"] == 16 and batch.batch_size[0] == 16


@pytest.mark.timeout(180)
def test_calculator_and_chat_examples_run_on_a_chat_model(tmp_path):
    model = write_tiny_hf_dir(tmp_path / "tools", texts=TEXTS, seed=0)
    (model / "chat_template.jinja").write_text(TOOLS_CHAT_TEMPLATE)
    rows = [{"prompt": "what is two plus two", "answer": "4"}]
    with launch_server(model, log_dir=tmp_path) as srv:
        for name in ("calculator", "chat_answer"):
            results = run_episodes(srv.url, load_workflow(f"{EXAMPLES}:{name}"), rows, 2,
                                   timeout_s=60)
            assert all(r.error is None and r.turns for r in results), [r.error for r in results]
            assert all(r.reward in (0.0, 1.0) for r in results)


@pytest.mark.timeout(120)
def test_a_streamed_chat_reaches_the_openai_package_and_is_recorded(server, tok):
    import asyncio

    from fsdpfn.rollout.agent import AsyncEpisodeClient, EpisodeClient

    client = EpisodeClient(server.url)
    stream = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "what is two plus two"}],
        max_tokens=5, stream=True, stream_options={"include_usage": True}, seed=1)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (turn,) = client.turns
    assert text == tok.decode(turn.output_ids, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(turn.output_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")

    async def streamed():
        aclient = AsyncEpisodeClient(server.url)
        got = await aclient.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "again please"}],
            max_tokens=4, stream=True)
        parts = [c async for c in got]
        await aclient.close()
        return parts, aclient.turns

    parts, turns = asyncio.run(streamed())
    assert len(turns) == 1 and len(turns[0].output_ids) == len(turns[0].logprobs) > 0
    assert parts[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.timeout(300)
def test_a_workflow_step_without_a_trainable_row_lets_the_run_go_on(tmp_path):
    """Every episode's row over max_episode_tokens: the step trains nothing, says so, and the
    stream still admits the next step's episodes (the run used to wait for them for good); a
    step that evaluates keeps its greedy accuracy in its row (it once crashed the run on a
    KeyError instead). No episode starts past the last step: the stream started a further
    step's episodes after the last push and cut them off at the end (a workflow's side effects
    on rows no step trains)."""
    import os
    import subprocess
    import sys

    config = tmp_path / "small.yaml"
    config.write_text(
        "recipe: grpo\nsteps: 2\nprompts_per_step: 4\ntask: {digits: 1}\n"
        "model: {hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, "
        "num_kv_heads: 1}\nwarmup: {steps: 3, batch_size: 16}\nadvantage: {group_size: 4}\n"
        "ppo: {n_minibatches: 1, kl_coef: 0.0}\neval: {every: 1, n_prompts: 4}\n"
        "checkpoint: {every: 0}\n"
        "launch: {nproc: 1}\nlog: {plot: false, progress: false}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "fsdpfn", "run", str(config), f"run_dir={tmp_path / 'run'}",
         f"rollout.workflow={WF}:logged_retry", "rollout.max_episode_tokens=2"],
        capture_output=True, text=True, timeout=280,
        env={**os.environ, "FSDPFN_TEST_WF_LOG": str(tmp_path / "episodes.jsonl")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    started = (tmp_path / "episodes.jsonl").read_text().splitlines()
    assert len(started) == 2 * 4 * 4, len(started)  # steps x prompts_per_step x group_size
    assert len(set(started)) <= 8  # the two steps' prompts, each group_size times
    assert proc.stderr.count("no trainable row") == 2, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in rows if r.get("phase") == "grpo"]
    assert len(steps) == 2 and all(0 <= r["greedy_accuracy"] <= 1 for r in steps), steps


@pytest.mark.timeout(60)
def test_a_workflow_that_never_calls_its_client_is_an_error(server, tok):
    row = {"prompt_ids": tok.encode("what is two plus two")}
    (result,) = run_episodes(server.url, load_workflow(f"{WF}:never_calls"), [row], 1,
                             on_error=-1.0)
    assert result.turns == [] and result.reward == -1.0
    assert "made no request through the client it was given" in result.error


@pytest.mark.timeout(600)
def test_the_recipe_stops_on_another_temperature_and_caps_minibatches_at_the_rows(tmp_path):
    """A workflow sampling at 0.3 against ppo.temperature 1 stops the run in one line before
    anything trains; a step of 8 episodes, half of them without a call (errors), leaves 4 rows
    and takes 4 minibatches where ppo.n_minibatches is 8."""
    import json
    import subprocess
    import sys

    config = tmp_path / "small.yaml"
    config.write_text(
        "recipe: grpo\nsteps: 1\nprompts_per_step: 4\ntask: {digits: 1}\n"
        "model: {hidden_size: 32, intermediate_size: 64, num_layers: 1, num_heads: 2, "
        "num_kv_heads: 1}\nwarmup: {steps: 0}\nadvantage: {group_size: 2}\n"
        "ppo: {n_minibatches: 8, kl_coef: 0.0}\neval: {every: 0}\ncheckpoint: {every: 0}\n"
        "launch: {nproc: 1}\nlog: {plot: false, progress: false}\n")

    def run(name, workflow):
        return subprocess.run(
            [sys.executable, "-m", "fsdpfn", "run", str(config), f"run_dir={tmp_path / name}",
             f"rollout.workflow={workflow}"], capture_output=True, text=True, timeout=280)

    hot = run("hot", f"{WF}:low_temperature")
    assert hot.returncode != 0
    assert "low_temperature sampled a turn at temperature 0.3 for data row" in hot.stderr
    assert "but ppo.temperature is 1" in hot.stderr
    capped = run("capped", f"{WF}:every_other")
    assert capped.returncode == 0, capped.stderr[-2000:]
    (row,) = [json.loads(line) for line in (tmp_path / "capped" / "metrics.jsonl").open()
              if '"phase": "grpo"' in line]
    assert row["episode_rows"] == 4 and row["n_minibatches"] == 4, row
    assert row["episode_errors"] == 4 and "made no request through the client" in capped.stderr
    assert "4 rows for ppo.n_minibatches=8" in capped.stderr


@pytest.mark.timeout(600)
def test_episodes_carry_their_data_row_over_several_servers_and_ranks(tmp_path):
    """A step's rows run as one request a server, and each request numbered its episodes from
    0: with two servers two data rows shared a group_id, so a two-rank run counted one
    trainable data row and skipped every step (the version stayed 0), and a failed episode
    was described with its place in the request, not its row in the data."""
    from cli_runs import fsdpfn, grpo_rows  # tests/cli_runs.py

    run_dir = tmp_path / "r"
    done = fsdpfn("demo", f"run_dir={run_dir}", f"rollout.workflow={WF}:first_fails",
                  "steps=2", "prompts_per_step=2", "advantage.group_size=2",
                  "ppo.n_minibatches=2", "launch.nproc=2", "rollout.servers=2",
                  "warmup.steps=5", "warmup.target_reward=null", "eval.every=0", "log.every=1",
                  "log.plot=false", "checkpoint.every=0", timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = grpo_rows(run_dir)
    assert [(r["data_first"], r["data_last"]) for r in rows] == [(0, 1), (2, 3)], rows
    assert rows[-1]["version"] == 2, rows[-1]
    log = (run_dir / "trainer.log").read_text()
    assert "fewer than the 2 data-parallel ranks" not in log
    named = sorted(int(line.split("episode of data row ")[1].split(":")[0])
                   for line in log.splitlines() if "step 2:" in line and "episode of data row"
                   in line)
    assert named == [2, 3], log[-3000:]
