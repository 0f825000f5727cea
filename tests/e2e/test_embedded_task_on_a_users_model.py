"""The embedded addition task (no data.train_files) on a model the user brings (model.path):
its problems through the model's own tokenizer, and the RL recipes' warm-up starting from that
model. Before, sft stopped on "'HFTokenizer' object has no attribute 'bos_id'" and grpo and
ppo looked for the embedded model's run_dir/model0 in their warm-up.

References: the tokenizer's own encoding of the task's text, and the task's reward on the
decoded answer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fsdpfn.errors import ConfigError
from fsdpfn.testing import write_tiny_hf_dir

pytestmark = pytest.mark.dist
TEXTS = ["12+34=46", "7+8=15", "99+1=100", "0123456789+="] * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_dir(tmp_path_factory.mktemp("users") / "m", texts=TEXTS, seed=0)


def test_the_tasks_rows_are_the_model_tokenizers_encoding(model_dir):
    from fsdpfn.app.recipes.data import AdditionSource
    from fsdpfn.app.recipes.model import HFTokenizer
    from fsdpfn.app.recipes.task import AdditionTask

    tok, task = HFTokenizer(model_dir), AdditionTask(digits=2)
    for k in range(20):
        e = AdditionSource(task, tok, seed=3).example(k)
        a, b = e["sample"]["a"], e["sample"]["b"]
        assert e["prompt_ids"] == list(tok.tok.encode(f"{a}+{b}=", add_special_tokens=True))
        answer = e["ids"][len(e["prompt_ids"]):]
        assert answer[-1] == tok.eos_id and tok.decode(answer) == str(a + b)
        assert task.reward(a, b, tok.decode(answer)) == 1.0
        assert e["loss"] == [False] * len(e["prompt_ids"]) + [True] * len(answer)


def test_a_tokenizer_without_an_end_of_sequence_token_is_refused_by_name(model_dir):
    from fsdpfn.app.recipes.model import HFTokenizer
    from fsdpfn.app.recipes.task import AdditionTask

    tok = HFTokenizer(model_dir)
    tok.eos_id = None
    with pytest.raises(ConfigError, match=r"^model\.path: the embedded addition task .* has "
                                          r"none \(eos_token\); give data\.train_files"):
        AdditionTask().answer_ids(tok, 12)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("recipe", ["sft", "grpo", "ppo"])
def test_each_recipe_runs_the_task_on_the_users_model(model_dir, tmp_path, recipe):
    run_dir = tmp_path / "run"
    extra = ["steps=2", "batch_size=8"] if recipe == "sft" else [
        "steps=1", "warmup.steps=2", "prompts_per_step=4"]
    proc = subprocess.run([sys.executable, "-m", "fsdpfn", "run", recipe, f"run_dir={run_dir}",
                           f"model.path={model_dir}", "launch.nproc=1", "log.plot=false",
                           *extra], capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    phases = [json.loads(x)["phase"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if recipe != "sft":  # the warm-up trained from model.path and left its tokenizer beside it
        assert phases == ["warmup", "warmup", recipe], phases
        assert (run_dir / "sft" / "tokenizer.json").is_file()
        assert not (run_dir / "model0").exists()
