"""The rules of a run directory for ``fsdpfn run`` / ``fsdpfn demo`` (fsdpfn.app.launcher):
a previous run needs ``--resume`` (continue it) or ``--overwrite`` (delete what fsdpfn wrote,
``OWNED``, and start over), never both; a run_dir whose launcher still runs on this host is
refused; ``--resume`` keeps the sections the run was built with (``FIXED_ON_RESUME``: its
model0 and data, prepared files or the embedded task, are reused as they are). Standard
library only at module level.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["OWNED", "FIXED_ON_RESUME", "check_run_dir_path", "check_flags",
           "check_resume_keeps", "prepare_run_dir", "check_started_by_hand",
           "finish_interrupted_saves"]

OWNED = ("config.yaml", "trainer.log", "model0", "model0.tmp", "sft", "checkpoints",
          "critic_checkpoints",
          "push", "model", "metrics.jsonl", "metrics.png", "rollout.log", "summary.json", ".ranks",
          "data", "tensorboard", "wandb", "reward_errors.jsonl", "run_state.json")


def check_run_dir_path(run_dir: Path) -> None:
    from fsdpfn.errors import ConfigError

    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir: must be a directory (or a path to create), got "
                          f"{str(run_dir)!r}, which is a file")
    parent = run_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():  # the run would fail creating it (NotADirectoryError)
        raise ConfigError(f"run_dir: must be a directory (or a path to create), got "
                          f"{str(run_dir)!r}, under {str(parent)!r}, which is a file")


def last_run_note(run_dir: Path) -> str | None:
    """How the last run in ``run_dir`` ended (None: no record); a run whose launcher is alive
    on this host is refused: two launchers must not write one run_dir."""
    import socket

    from fsdpfn.errors import ConfigError
    from fsdpfn.app.supervise import describe_last_run, last_run

    state = last_run(run_dir)
    if state is None:
        return None
    if state.get("status") == "running" and state.get("host") == socket.gethostname():
        raise ConfigError(f"run_dir: must not be in use by another run, got {str(run_dir)!r}, "
                          f"where {describe_last_run(state)}; stop it, wait for it, or set "
                          f"run_dir=... to another directory")
    return describe_last_run(state)


def check_flags(*, resume: bool, overwrite: bool) -> None:
    """--resume continues run_dir's run and --overwrite deletes it: never both."""
    from fsdpfn.errors import ConfigError

    if resume and overwrite:
        raise ConfigError("--overwrite: must not be given with --resume (--resume continues the "
                          "run in run_dir, --overwrite deletes it and starts over), got both")


def check_started_by_hand(cfg, run_dir: Path, *, resume: bool) -> None:
    """A trainer rank's check of run_dir as it starts, for ranks that torchrun starts on the
    hosts (``fsdpfn run FILE --prepare``): the data files prepared there (tokenized and
    filtered once, before any rank), and a previous run's checkpoints continued only with
    --resume. Under ``fsdpfn run`` both hold before the ranks start."""
    from fsdpfn.errors import ConfigError

    if cfg.data.from_files and not (run_dir / "data" / "train.jsonl").is_file():
        raise ConfigError(f"data.train_files: must be prepared into {run_dir / 'data'} before "
                          f"the ranks start (tokenized and filtered once, for every host), got "
                          f"nothing there; run `fsdpfn run FILE --prepare` first (it prints the "
                          f"torchrun command)")
    ckpts = run_dir / "checkpoints"
    if not resume and ckpts.is_dir() and any(ckpts.iterdir()):
        raise ConfigError(f"run_dir: {str(run_dir)!r} holds a previous run's checkpoints; pass "
                          f"--resume to continue it, or run `fsdpfn run FILE --prepare "
                          f"--overwrite` to start over")


# the sections a run bakes into run_dir before its first step (model0, the tokenizer, the
# prepared data) and --resume reuses as they are: a change there would not take effect
FIXED_ON_RESUME = ("recipe", "model", "data", "task")  # task: the embedded task's data


def check_resume_keeps(cfg, config_path: Path) -> None:
    """--resume continues the run recorded in run_dir/config.yaml on its model0 and prepared
    data: a ConfigError naming the first key of ``FIXED_ON_RESUME`` that differs (a key the
    record lacks, written by another fsdpfn version, is not compared)."""
    import yaml

    from fsdpfn import serde
    from fsdpfn.errors import ConfigError

    try:
        before = yaml.safe_load(config_path.read_text())
    except (OSError, yaml.YAMLError):
        return  # no record to hold the run to (a run_dir without one starts at step 0)
    if not isinstance(before, dict):
        return
    now = json.loads(json.dumps(serde.unstructure(cfg), default=str))
    before = json.loads(json.dumps(before, default=str))

    def differ(key: str, old, new) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for sub in old:
                if sub in new:
                    differ(f"{key}.{sub}", old[sub], new[sub])
        elif old != new:
            raise ConfigError(f"{key}: cannot change on --resume (the run in run_dir was built "
                              f"with {old!r}, recorded in {config_path}), got {new!r}; resume "
                              f"with the recorded value, or start a new run_dir")

    for key in FIXED_ON_RESUME:
        if key in before and key in now:
            differ(key, before[key], now[key])


def read_progress(path: Path | None, per_step: int) -> tuple[int, int]:
    """(recipe step, data cursor) a checkpoint was saved at, from its manifest's ``extra``."""
    if path is None:
        return 0, 0
    manifest = json.loads((path / "fsdpfn.json").read_text())
    extra = manifest.get("extra") or {}
    step = int(extra.get("step", manifest.get("step", 0)))
    return step, int(extra.get("data_cursor", step * per_step))


def finish_interrupted_saves(run_dir: Path) -> None:
    """--resume: a save killed between its marker and its rename left a complete
    ``step_N.tmp-<token>``; it is published here (checkpoint.files.clean_up_leftovers, which
    also removes what dead saves left), so that the run continues from step N rather than from
    the checkpoint before. Only a save whose process is gone from this host is finished, and
    only in a run_dir no live launcher holds (refused, as prepare_run_dir refuses it). A policy
    checkpoint is marked only after its critic's is published, so the pair stays whole."""
    from fsdpfn.checkpoint.files import clean_up_leftovers

    last_run_note(run_dir)
    for name in ("critic_checkpoints", "checkpoints"):
        if (run_dir / name).is_dir():
            clean_up_leftovers(run_dir / name)


def check_resume_steps(cfg, run_dir: Path) -> None:
    """--resume continues from run_dir's newest complete checkpoint: ``steps`` below its step
    (read as the resume reads it, read_progress) would train nothing and leave a config.yaml
    that disagrees with the run, a ConfigError."""
    from fsdpfn.checkpoint.files import latest_checkpoint
    from fsdpfn.errors import ConfigError

    latest = latest_checkpoint(run_dir / "checkpoints")
    step, _ = read_progress(latest, 1)
    if step > cfg.steps:
        raise ConfigError(f"steps: must be >= the step --resume continues from ({step}, "
                          f"{latest}), got {cfg.steps}; raise steps, or start a new run_dir")


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool,
                    dry_run: bool = False) -> list[str]:
    """Refuse a run_dir holding a previous run (without --resume or --overwrite) and return the
    notes to print; then clear what --overwrite replaces and create the directory, except with
    ``dry_run`` (the checks alone: --dry-run changes nothing)."""
    from fsdpfn.errors import ConfigError

    check_run_dir_path(run_dir)
    last = last_run_note(run_dir)
    previous = [name for name in ("checkpoints", "metrics.jsonl", "sft")
                if (run_dir / name).exists()]
    if previous and not (resume or overwrite):
        raise ConfigError(f"run_dir: {str(run_dir)!r} holds a previous run "
                          f"({', '.join(previous)}" + (f"; {last}" if last else "") + "); pass "
                          "--resume to continue it, --overwrite to start over, or set "
                          "run_dir=... to another directory")
    notes = []
    if last and "killed" in last:
        notes.append(f"{run_dir}: {last}" + ("; resuming from its latest checkpoint" if resume
                                             else "; starting over"))
    if resume and not previous:
        notes.append(f"{run_dir}: --resume: no previous run to continue; starting at step 0")
    if dry_run:
        return notes
    if overwrite:
        for name in OWNED:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        for path in run_dir.glob("rollout[0-9]*.log"):  # the logs of servers 1, 2, ...
            path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    return notes
