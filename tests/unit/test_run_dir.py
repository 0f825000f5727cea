"""The run_dir rules of ``fsdpfn run`` (fsdpfn.app.run_dir): a previous run needs --resume or
--overwrite, --resume in a run_dir without one says so and starts at step 0 (a job script may
always pass it), and --resume keeps the model, data and recipe the run was built with."""

from __future__ import annotations

import pytest

from fsdpfn.app import launcher
from fsdpfn.app.run_dir import check_resume_keeps, prepare_run_dir
from fsdpfn.errors import ConfigError


def test_resume_without_a_previous_run_says_it_starts_at_step_0(tmp_path):
    notes = prepare_run_dir(tmp_path / "fresh", resume=True, overwrite=False)
    assert notes == [f"{tmp_path / 'fresh'}: --resume: no previous run to continue; starting "
                     f"at step 0"], notes
    assert (tmp_path / "fresh").is_dir()


def test_a_previous_run_needs_resume_or_overwrite_and_resume_keeps_it(tmp_path):
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"holds a previous run \(checkpoints\).*--resume"):
        prepare_run_dir(run_dir, resume=False, overwrite=False)
    assert prepare_run_dir(run_dir, resume=True, overwrite=False) == []
    assert (run_dir / "checkpoints").is_dir()


@pytest.mark.parametrize("change, key", [
    ("model.hidden_size=64", "model.hidden_size"),
    ("model.seed=3", "model.seed"),
    ("data.eval_size=5", "data.eval_size"),
    ("task.digits=3", "task.digits"),  # the embedded task is the run's data
])
def test_resume_refuses_a_change_to_what_run_dir_was_built_with(tmp_path, change, key):
    """--resume reuses run_dir's model0 and prepared data: a changed model or data key would
    not take effect while config.yaml recorded it as run, so it is refused by name before
    anything in run_dir is read or written; the other keys (steps, lr, ...) may change."""
    from fsdpfn import serde
    from fsdpfn.app.recipes import default_config

    run_dir = tmp_path / "r"
    cfg = default_config("sft", [f"run_dir={run_dir}"])
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(serde.to_yaml(cfg))
    before = sorted(p.name for p in run_dir.rglob("*"))
    changed = default_config("sft", [f"run_dir={run_dir}", change])
    with pytest.raises(ConfigError) as info:
        launcher.launch(changed, resume=True)
    message = str(info.value)
    assert message.startswith(f"{key}: cannot change on --resume"), message
    assert "config.yaml" in message and "got" in message
    assert sorted(p.name for p in run_dir.rglob("*")) == before
    check_resume_keeps(default_config("sft", [f"run_dir={run_dir}", "steps=7",
                                              "optimizer.lr=3e-4"]), run_dir / "config.yaml")


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_run_dir_under_a_file_is_refused_by_the_dry_run_too(tmp_path, dry_run):
    """A run_dir below a regular file passed the dry run; the run then raised
    NotADirectoryError's traceback creating it."""
    (tmp_path / "job.yaml").write_text("recipe: grpo\n")
    run_dir = tmp_path / "job.yaml" / "runs" / "a"
    with pytest.raises(ConfigError, match=r"^run_dir: must be a directory \(or a path to "
                                          r"create\), got '.*runs/a', under '.*job\.yaml', "
                                          r"which is a file$"):
        prepare_run_dir(run_dir, resume=False, overwrite=False, dry_run=dry_run)
    assert not (tmp_path / "runs").exists() and (tmp_path / "job.yaml").is_file()
