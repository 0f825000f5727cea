"""`fsdpfn run` on a user's own model directory, data files and reward module (CPU).

The model directory is complete and local: a byte-level BPE tokenizer trained with `tokenizers`
(ChatML chat template) and a tiny Qwen2 sized to it. Train and eval data are JSONL files; the
reward is a module in a temporary package the launcher and the reward workers import from
PYTHONPATH. Every recipe runs a few steps from YAML through the CLI; a resumed run continues the
data cursor exactly; bad inputs fail before any rank starts with a typed one-line error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdpfn.app.cli import main
from fsdpfn.app.recipes.data import DataConfig, prepare_files
from fsdpfn.app.recipes.model import HFTokenizer
from fsdpfn.errors import ConfigError
from fsdpfn.testing.hf_dir import write_tiny_hf_dir

pytestmark = pytest.mark.dist

REWARD_MODULE = '''
def score(prompt, completion, *, answer, sample, **kwargs):
    """1 when the answer appears in the completion; raises on rows marked boom."""
    if sample.get("boom"):
        raise RuntimeError("boom row " + prompt)
    return float(str(answer) in completion)
'''


def _rows(n: int, offset: int = 0) -> list[dict]:
    rows = []
    for i in range(offset, offset + n):
        a, b = i % 7, i % 5
        rows.append({"prompt": f"What is {a}+{b}?", "answer": str(a + b),
                     "response": f"{a + b}", "chosen": f"{a + b}", "rejected": f"{a + b + 1}",
                     "boom": i % 2 == 1})
    return rows


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("userdata")
    train = _rows(40) + [{"prompt": "What is " + "1+" * 200 + "1?", "answer": "201",
                          "response": "201", "chosen": "201", "rejected": "200", "boom": False}]
    texts = [f"{r['prompt']} {r['response']}" for r in train]
    model = write_tiny_hf_dir(root / "model", texts=texts, vocab_size=300)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", _rows(6, 100))):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "myrewards").mkdir()
    (root / "myrewards" / "__init__.py").write_text(REWARD_MODULE)
    common = {"model": {"path": str(model)},
              "data": {"train_files": [str(root / "train.jsonl")],
                       "eval_files": [str(root / "eval.jsonl")],
                       "max_prompt_tokens": 64, "max_response_tokens": 8},
              "launch": {"nproc": 1}, "engine": {"mb_spec": {"max_tokens_per_mb": 2048}}}
    configs = {
        "grpo": {"recipe": "grpo", "steps": 2, "prompts_per_step": 4,
                 "reward": {"fn": "myrewards:score", "workers": 2, "timeout_s": 20},
                 "eval": {"every": 2, "n_prompts": 4}, "log": {"tensorboard": True}},
        "ppo": {"recipe": "ppo", "steps": 2, "prompts_per_step": 4,
                "reward": {"fn": "myrewards:score", "workers": 1}},
        "sft": {"recipe": "sft", "steps": 4, "batch_size": 8, "eval_every": 2,
                "checkpoint": {"every": 2}},
        "rw": {"recipe": "rw", "steps": 2, "pairs_per_step": 4},
        "dpo": {"recipe": "dpo", "steps": 2, "pairs_per_step": 4},
    }
    for name, cfg in configs.items():
        data = {**common, **cfg}
        data["log"] = {**data.get("log", {}), "plot": False}  # the plot is test_demo's
        (root / f"{name}.yaml").write_text(yaml.safe_dump(data))
    return root


def _env(ws: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ws), os.environ.get("PYTHONPATH", "")])}


def _run(ws: Path, recipe: str, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return _run_config(ws, ws / f"{recipe}.yaml", run_dir, f"run_dir={run_dir}", *args)


def _run_config(ws: Path, config: Path, run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``fsdpfn run CONFIG ARGS`` with the workspace importable; it must succeed."""
    proc = subprocess.run([sys.executable, "-m", "fsdpfn", "run", str(config), *args],
                          capture_output=True, text=True, timeout=200, env=_env(ws))
    log = run_dir / "rollout.log"
    assert proc.returncode == 0, (proc.stderr[-5000:] + "\n--- rollout.log ---\n"
                                  + (log.read_text()[-2000:] if log.is_file() else "(none)"))
    return proc


def _metrics(run_dir: Path, phase: str) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == phase]


STAGES = ("generate_seconds", "reward_seconds", "ref_logp_seconds", "old_logp_seconds",
          "train_seconds", "push_seconds")


@pytest.mark.timeout(240)
def test_grpo_on_user_model_data_and_reward(ws, tmp_path):
    run_dir = tmp_path / "grpo"
    proc = _run(ws, "grpo", run_dir)
    assert "data (train): 40 of 41 samples; dropped 1: 1 prompt over max_prompt_tokens" \
        in proc.stderr
    rows = _metrics(run_dir, "grpo")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in (*STAGES, "tokens_per_s", "response_len_mean", "response_len_max",
                    "response_clip_frac", "reward_mean", "reward_std", "reward_errors"):
            assert isinstance(r[key], (int, float)), (key, r)
        assert sum(r[k] for k in STAGES) <= r["seconds"] + 1e-6
        assert 1 <= r["response_len_max"] <= 8 and 0 <= r["response_clip_frac"] <= 1
    # odd rows raise in the reward: reported with their sample, counted, and the run went on
    errors = [json.loads(x) for x in (run_dir / "reward_errors.jsonl").read_text().splitlines()]
    assert sum(r["reward_errors"] for r in rows) == len(errors) > 0
    assert all(e["kind"] == "exception" and "boom row What is" in e["message"] for e in errors)
    assert "greedy_accuracy" in rows[-1]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert rows[-1]["data_cursor"] == 8


@pytest.mark.timeout(240)
def test_rollout_server_args_reach_the_server(ws, tmp_path):
    """rollout.server_args from the command line reach the server fsdpfn run starts: on the
    CPU its default is HF generate, and [--decode, loop, --decode-rows, 16] runs the decode
    loop with 16 rows instead of the launcher's sizing (4 prompts x 8 samples: 32), which the
    server's log states. rollout.sampling reaches the streamed rollout (max_staleness 1) and
    the server; a parameter the loop does not serve fails the run in one line, by name."""
    run_dir = tmp_path / "grpo"
    _run(ws, "grpo", run_dir, "steps=1", "eval.every=0", "rollout.max_staleness=1",
         "rollout.server_args=[--decode, loop, --decode-rows, 16]",
         "rollout.sampling={top_k: 2, stop: ['</answer>']}")
    assert "decode loop on: 16 rows x" in (run_dir / "rollout.log").read_text()
    assert [r["step"] for r in _metrics(run_dir, "grpo")] == [1]
    # a parameter the loop does not serve reaches it and is refused in one line, by name
    run_dir = tmp_path / "min_p"
    proc = subprocess.run([sys.executable, "-m", "fsdpfn", "run", str(ws / "grpo.yaml"),
                           f"run_dir={run_dir}", "steps=1", "eval.every=0",
                           "rollout.server_args=[--decode, loop]", "rollout.sampling={min_p: 0.1}"],
                          capture_output=True, text=True, timeout=200, env=_env(ws))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fsdpfn: error:")]
    assert proc.returncode not in (0, 2) and len(errors) == 1, proc.stderr[-3000:]
    assert "min_p" in errors[0] and "--decode hf" in errors[0], errors[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("recipe", ["rw", "dpo"])
def test_other_recipes_on_user_model_and_data(ws, tmp_path, recipe):
    run_dir = tmp_path / recipe
    _run(ws, recipe, run_dir)
    rows = _metrics(run_dir, recipe)
    assert [r["step"] for r in rows] == [1, 2]
    # the held-out pairs' loss at each evaluation (eval_every null: a fifth of the run, here
    # every step), as recipes.md says of eval_every; dpo logged only eval_p_correct
    evals = [r for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text()
                         .splitlines()) if "eval_loss" in r]
    assert len(evals) >= 2, evals
    accuracy = "eval_accuracy" if recipe == "rw" else "eval_reward_accuracy"
    for r in evals:
        assert r["eval_loss"] > 0 and 0 <= r[accuracy] <= 1, r


@pytest.mark.timeout(240)
def test_ppo_from_random_init_draws_on_the_trainer_and_the_server_starts_on_placeholders(
        ws, tmp_path):
    """PPO on the user's model and data with model.random_init: the launcher writes no weights
    (run_dir/model0 holds the config and the tokenizer), the trainer draws actor, reference and
    critic on its devices, the server starts on placeholders and serves the trainer's weights
    from the first push on."""
    run_dir = tmp_path / "ppo"
    _run(ws, "ppo", run_dir, "model.random_init=true")
    model0 = run_dir / "model0"
    assert (model0 / "config.json").is_file() and (model0 / "tokenizer.json").is_file()
    assert not list(model0.glob("*.safetensors"))
    assert "placeholder weights until the first push" in (run_dir / "rollout.log").read_text()
    rows = _metrics(run_dir, "ppo")
    assert [r["step"] for r in rows] == [1, 2]
    # the served log-probs are the trainer's: the pushed weights replaced the placeholders
    assert all(r["behav_gap"] <= 1e-4 for r in rows), [r["behav_gap"] for r in rows]
    # every stat of the critic's step reaches the line, under the prefix critic_
    for row in rows:
        assert {"critic_loss", "value_mean", "critic_vf_clip_frac", "critic_returns_mean",
                "critic_grad_norm", "critic_steps"} <= set(row), sorted(row)
        assert 0.0 <= row["critic_vf_clip_frac"] <= 1.0


@pytest.mark.timeout(300)
def test_sft_exports_with_tokenizer_and_resume_continues_the_data_cursor(ws, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    _run(ws, "sft", whole)
    export = whole / "model"
    assert (export / "config.json").is_file() and HFTokenizer(export).vocab_size == \
        HFTokenizer(ws / "model").vocab_size
    _run(ws, "sft", split, "steps=2")
    # resumed as a user resumes: from the run's own recorded config, an override after the flag
    second = _run_config(ws, split / "config.yaml", split, "--resume", "steps=4")
    assert "resumed from" in second.stderr
    a, b = _metrics(whole, "sft"), _metrics(split, "sft")
    assert [r["data_cursor"] for r in a] == [r["data_cursor"] for r in b] == [8, 16, 24, 32]
    # the trained tokens: the responses, fewer than the rows' tokens, the same on resume
    assert [r["loss_tokens"] for r in a] == [r["loss_tokens"] for r in b]
    assert all(0 < r["loss_tokens"] < r["tokens"] for r in a), a
    # the same examples in the same order: the same losses (a different sample would differ)
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5, abs=1e-6)


def _fails(ws: Path, tmp_path: Path, capsys, recipe: str, *overrides: str) -> str:
    run_dir = tmp_path / "bad"
    capsys.readouterr()
    old = os.environ.get("PYTHONPATH")
    sys.path.insert(0, str(ws))
    try:
        rc = main(["run", str(ws / f"{recipe}.yaml"), f"run_dir={run_dir}", *overrides])
    finally:
        sys.path.remove(str(ws))
        assert os.environ.get("PYTHONPATH") == old
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("fsdpfn: error: "), err
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))  # nothing left
    return err


@pytest.mark.timeout(120)
def test_bad_inputs_fail_before_training_naming_key_and_value(ws, tmp_path, capsys):
    missing = str(ws / "nope.jsonl")
    assert f"data.train_files: file does not exist, got '{missing}'" in _fails(
        ws, tmp_path, capsys, "grpo", f"data.train_files=[{missing}]")
    assert "data.prompt_key: column 'question' is not in train_files" in _fails(
        ws, tmp_path, capsys, "grpo", "data.prompt_key=question")
    err = _fails(ws, tmp_path, capsys, "grpo", "reward.fn=nosuchpkg.rewards:score")
    assert "reward.fn:" in err and "'nosuchpkg.rewards:score'" in err
    bare = tmp_path / "bare"
    write_tiny_hf_dir(bare, texts=["a b c"])
    for f in bare.glob("tokenizer*"):
        f.unlink()
    assert "model.path: must hold a tokenizer" in _fails(
        ws, tmp_path, capsys, "sft", f"model.path={bare}")
    plain = tmp_path / "plain"  # a base model's tokenizer: no chat template
    write_tiny_hf_dir(plain, texts=["a b c"])
    (plain / "chat_template.jinja").unlink()
    err = _fails(ws, tmp_path, capsys, "sft", f"model.path={plain}", "data.chat_template=true")
    assert "data: chat messages (and data.chat_template: true) need the tokenizer's chat " \
           f"template, and the tokenizer in {str(plain)!r} has none" in err, err
    assert "data.max_response_tokens: must be >= 1, got 0" in _fails(
        ws, tmp_path, capsys, "grpo", "data.max_response_tokens=0")


@pytest.mark.timeout(120)
def test_a_refused_run_into_a_directory_of_the_users_leaves_it_as_it_was(ws, tmp_path, capsys):
    """The run_dir exists and holds the user's own file: a run refused while it prepares the
    data keeps that file and leaves no data/ behind (a fresh run_dir is not left at all, as
    _fails holds)."""
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("kept")
    sys.path.insert(0, str(ws))
    try:
        rc = main(["run", str(ws / "sft.yaml"), f"run_dir={run_dir}", "data.max_prompt_tokens=1"])
    finally:
        sys.path.remove(str(ws))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("fsdpfn: error: data.train_files: no sample fits the "
                                      "limits (max_prompt_tokens=1"), err
    assert sorted(p.name for p in run_dir.rglob("*")) == ["notes.txt"]


@pytest.mark.timeout(60)
def test_chat_sft_puts_loss_on_assistant_turns_only(ws, tmp_path):
    conv = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "3"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": conv}) + "\n")
    tok = HFTokenizer(ws / "model")
    cfg = DataConfig(train_files=(str(tmp_path / "chat.jsonl"),))
    report = prepare_files(cfg, tok, "sft", tmp_path / "out")
    assert report["train"]["kept"] == 1
    ex = json.loads((tmp_path / "out" / "train.jsonl").read_text())
    ids, loss = ex["ids"], ex["loss"]
    trained = tok.tok.decode([t for t, m in zip(ids, loss) if m])
    # each turn's content and its end-of-turn token; the newline after it is framing
    assert trained == "3<|im_end|>4<|im_end|>", trained
    assert ids == tok.chat_ids(conv, generation_prompt=False)


# a template that puts a default system turn before a conversation without one (as Qwen2.5's)
DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _trained(tok, ex):
    return tok.tok.decode([t for t, m in zip(ex["ids"], ex["loss"]) if m])


@pytest.mark.timeout(60)
def test_a_conversation_opened_by_the_assistant_trains_its_turns_only(ws, tmp_path):
    conv = [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "3"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": conv}) + "\n")
    tok = HFTokenizer(ws / "model")
    tok.tok.chat_template = DEFAULT_SYSTEM
    prepare_files(DataConfig(train_files=(str(tmp_path / "chat.jsonl"),)), tok, "sft",
                  tmp_path / "out")
    ex = json.loads((tmp_path / "out" / "train.jsonl").read_text())
    assert _trained(tok, ex) == "Hello<|im_end|>3<|im_end|>"  # no system turn, no header
    assert ex["ids"] == tok.chat_ids(conv, generation_prompt=False)


@pytest.mark.timeout(60)
def test_templated_prompt_and_response_rows_end_their_turn_as_chat_rows_do(ws, tmp_path):
    """chat_template: true: the response is the assistant turn of the rendered conversation,
    closed by the template's end-of-turn token, for sft and for both sides of a dpo pair."""
    row = {"prompt": "1+2?", "response": "3", "chosen": "3", "rejected": "4"}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    tok = HFTokenizer(ws / "model")
    cfg = DataConfig(train_files=(str(tmp_path / "rows.jsonl"),), chat_template=True,
                     system_prompt="Add.")
    prepare_files(cfg, tok, "sft", tmp_path / "sft")
    ex = json.loads((tmp_path / "sft" / "train.jsonl").read_text())
    conv = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "3"}]
    assert ex["ids"] == tok.chat_ids(conv, generation_prompt=False)
    assert _trained(tok, ex) == "3<|im_end|>"
    prepare_files(cfg, tok, "dpo", tmp_path / "dpo")
    pair = json.loads((tmp_path / "dpo" / "train.jsonl").read_text())
    head = tok.chat_ids(conv[:2], generation_prompt=True)
    for side, text in (("chosen", "3"), ("rejected", "4")):
        ids, loss = pair[side]
        assert ids[:len(head)] == head and not any(loss[:len(head)])
        assert tok.tok.decode([t for t, m in zip(ids, loss) if m]) == f"{text}<|im_end|>"


@pytest.mark.timeout(60)
def test_a_system_prompt_for_untemplated_string_prompts_is_refused(ws, tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "Hi", "response": "yo"}) + "\n")
    cfg = DataConfig(train_files=(str(tmp_path / "rows.jsonl"),), system_prompt="Be brief.")
    with pytest.raises(ConfigError, match="data.system_prompt: goes into chat prompts, and "
                       "string prompts are chat prompts only with data.chat_template: true"):
        prepare_files(cfg, HFTokenizer(ws / "model"), "sft", tmp_path / "out")


@pytest.mark.timeout(60)
def test_a_split_no_file_feeds_now_is_not_left_behind(ws, tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "Hi", "response": "yo"}) + "\n")
    out = tmp_path / "out"
    files = (str(tmp_path / "rows.jsonl"),)
    prepare_files(DataConfig(train_files=files, eval_files=files), HFTokenizer(ws / "model"),
                  "sft", out)
    assert (out / "eval.jsonl").is_file()
    prepare_files(DataConfig(train_files=files), HFTokenizer(ws / "model"), "sft", out)
    assert not (out / "eval.jsonl").exists()  # an earlier run's held-out rows are not used


def _dry_run(ws, capsys, recipe: str, *overrides: str) -> tuple[int, str]:
    """``fsdpfn run <ws>/<recipe>.yaml ... --dry-run`` in this process: (status, stderr)."""
    capsys.readouterr()
    sys.path.insert(0, str(ws))
    try:
        rc = main(["run", str(ws / f"{recipe}.yaml"), *overrides, "--dry-run"])
    finally:
        sys.path.remove(str(ws))
    return rc, capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_dry_run_tokenizes_the_data_and_says_what_a_run_would_keep(ws, tmp_path, capsys):
    run_dir = tmp_path / "dry"
    rc, err = _dry_run(ws, capsys, "sft", f"run_dir={run_dir}")
    assert rc == 0, err
    # the long prompt of the workspace's train file is over the limit, as in a real run
    assert "data (train): 40 of 41 samples; dropped 1: 1 prompt over max_prompt_tokens" in err
    assert "data (eval): 6 of 6 samples" in err
    assert "each step takes every sample" not in err  # the workspace's batch fits its data
    assert not run_dir.exists()  # nothing written
    # the workspace's model is the user's: the rate its file leaves unset is the fine-tuning
    # default, and the run says so (its checkpoint.every is written, so it is not named)
    line = [x for x in err.splitlines() if "names a pretrained model" in x]
    assert line == ["[fsdpfn] model.path names a pretrained model: optimizer.lr=2e-05 (the "
                    "fine-tuning defaults, where the config sets none; docs/recipes.md)"], err
    rc, err = _dry_run(ws, capsys, "sft", f"run_dir={run_dir}", "optimizer.lr=1e-4")
    assert rc == 0 and "pretrained model" not in err, err
    # a step larger than the data is said, with how often each sample comes back a step
    rc, err = _dry_run(ws, capsys, "sft", f"run_dir={run_dir}", "batch_size=120")
    assert rc == 0 and ("data (train): 40 samples for batch_size=120 a step: each step takes "
                        "every sample about 3 times") in err, err
    # an evaluation that has no files to read says so (it was silently off)
    rc, err = _dry_run(ws, capsys, "grpo", f"run_dir={run_dir}", "data.eval_files=[]")
    assert rc == 0 and "eval.every=2: no held-out evaluation (data.eval_files is empty" in err
    assert "data.train_files: no sample fits the limits" in _fails(
        ws, tmp_path, capsys, "sft", "--dry-run", "data.max_response_tokens=1")


@pytest.mark.timeout(120)
def test_a_missing_answer_column_is_refused_where_the_reward_needs_it(ws, tmp_path, capsys):
    """The built-in math reward scores against each row's answer: a file without the column
    ran to the end on zero rewards, every call an exception; a data.answer_key naming no column
    handed reward.fn None."""
    plain = tmp_path / "noanswer.jsonl"
    plain.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in _rows(8)))
    err = _fails(ws, tmp_path, capsys, "grpo", f"data.train_files=[{plain}]",
                 "data.eval_files=null", "reward.fn=null")
    assert f"data.answer_key: column 'answer' is not in train_files ['{plain}']" in err, err
    assert "the built-in math reward (reward.fn: null) scores each completion against it" in err
    err = _fails(ws, tmp_path, capsys, "ppo", "data.answer_key=solution")
    assert "data.answer_key: column 'solution' is not in train_files" in err, err
    assert "its column is what reward.fn gets as answer" in err, err
    # a reward of the user's own, the default key: the column may be absent (answer is None)
    from fsdpfn.app.recipes import load_recipe_config
    from fsdpfn.app.recipes.data import answer_reason

    cfg = load_recipe_config(ws / "grpo.yaml", [f"data.train_files=[{plain}]"])
    assert answer_reason(cfg) is None
