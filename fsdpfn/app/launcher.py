"""The launcher behind ``fsdpfn run`` and ``fsdpfn demo`` (fsdpfn/app/cli.py parses their
arguments).

``launch`` takes a validated recipe config, checks what can fail before any process starts,
prepares the data files, writes the config to ``run_dir/config.yaml`` and starts the rollout
servers (fsdpfn.app.servers: ``python -m fsdpfn.rollout``, one per ``rollout.gpus`` entry or
``rollout.servers`` of them, each on its own port and device, its output in
run_dir/rollout.log, rollout1.log, ...) when ``rollout.url`` is not set, then starts
``launch.nproc`` trainer ranks itself (fsdpfn.app.ranks: torchrun's environment, no torchrun;
OMP_NUM_THREADS=launch.threads_per_rank each), handing them every server's URL; trainer rank 0
writes run_dir/model0 (the embedded model, random_init's config: prepare_initial_model), which
the servers wait for, and then waits for each server's /health. The launcher waits for the
ranks (a server of its own that exits stops them); at the end it records each server's final
weights version (summary.json's ``rollout_servers``), plots run_dir/metrics.jsonl to
run_dir/metrics.png and prints a summary.

``fsdpfn run FILE --prepare`` stops before any process starts: the checks that do not depend on
the hosts, run_dir's config.yaml and prepared data, and the torchrun command that starts the
trainer ranks on each host (fsdpfn.app.recipes.worker; docs/getting-started.md).

Ctrl-C (SIGINT) is forwarded to the ranks, which finish the current step, save a checkpoint and
exit; the rollout servers are then shut down. A second Ctrl-C kills the ranks at once (the last
published checkpoint stays intact: checkpoints are atomic). Exit status: 0 done, 130 stopped by
a signal, 2 bad config or command line, else the trainer's. The ranks' output goes to
run_dir/trainer.log and the terminal; a failed rank is named in one line (fsdpfn.app.terminal:
what passes between the terminal and the ranks).

The launcher's children die with it, even when it is killed with SIGKILL (fsdpfn.wire.lifeline):
the trainer ranks and the rollout servers get a parent-death signal, and every trainer rank and
server watch the launcher's pid and exit within about a second of it going away.
run_dir/run_state.json says how the last run ended: "running" (with the launcher's pid) from
the start, then "done", "failed" or "interrupted"; a record still "running" whose launcher is
gone is reported as "killed" by the next ``fsdpfn run``/``fsdpfn demo`` into that run_dir
(``--resume`` continues from the latest checkpoint, after publishing one whose save was killed
between its marker and its rename), and a run_dir whose launcher still runs is refused.

Only the standard library (and the app's modules that import only it: run_dir, servers,
terminal) is imported here at module level: the CLI's config path stays free of torch
(placement, data and model helpers are imported when a run starts). On a CPU host a run of the
embedded model imports neither torch nor transformers here, only in the ranks and servers
(BENCHMARKS.md, "Start-up of fsdpfn run"); a model.path's tokenizer, which tokenizes the data
files here, imports both.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fsdpfn.app.run_dir import (check_flags, check_resume_keeps, check_resume_steps,
                                check_run_dir_path, finish_interrupted_saves,
                                prepare_run_dir)
from fsdpfn.app.servers import (check_server_gpus, describe_servers, server_records,
                                start_servers)
from fsdpfn.app.terminal import Relay, Signals, log_line, report_failure, say

__all__ = ["launch"]

TTY_ENV = "FSDPFN_STDERR_TTY"  # "1": the launcher's stderr is a terminal (the ranks' is a pipe)


# ---------------------------------------------------------------- commands


def _master_port(cfg, url: str | None) -> int:
    """The ranks' rendezvous port (rank 0 hosts the store): ``launch.master_port``, else a free
    one; never a rollout server's port, which it may not have bound yet."""
    from fsdpfn.wire.ports import free_port

    port = cfg.launch.master_port
    urls = url.split(",") if url else []
    while port is None or any(u.endswith(f":{port}") for u in urls):
        port = free_port()
    return port


def _worker_cmd(cfg, config_path: Path, placement, *, resume: bool,
                url: str | None) -> list[str]:
    """Each trainer rank's command (fsdpfn.app.ranks gives it its rank's environment)."""
    cmd = [sys.executable, "-u", "-m", "fsdpfn.app.recipes.worker", "--config",
           str(config_path), "--device", placement.device, "--transport", placement.transport]
    if resume:
        cmd.append("--resume")
    if url:
        cmd += ["--rollout-url", url]
    return cmd


def _describe_trainer(cmd: list[str], nproc: int, port: int, threads: int) -> str:
    """The dry run's line for the trainer: what each rank runs, in a form a shell takes."""
    from fsdpfn.app.ranks import rank_env

    env = {**rank_env(0, nproc, port), "OMP_NUM_THREADS": str(threads)}
    env["RANK"] = env["LOCAL_RANK"] = "<rank>"
    return (f"{nproc} rank(s) (<rank> = 0..{nproc - 1}): "
            + " ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(cmd))


def _check_prepare(cfg, *, dry_run: bool, own_server: bool) -> None:
    """--prepare leaves the ranks to torchrun: it starts no rollout server either."""
    from fsdpfn.errors import ConfigError

    if dry_run:
        raise ConfigError("--prepare: must not be given with --dry-run (--dry-run writes "
                          "nothing, --prepare writes run_dir for ranks started by hand), got both")
    if own_server:
        raise ConfigError(f"rollout.url: must name running rollout servers with --prepare (ranks "
                          f"started by hand start none; python -m fsdpfn.rollout starts one, "
                          f"docs/rollout.md), got null for recipe {cfg.recipe}")


def _torchrun_line(cfg, config_path: Path, *, resume: bool) -> str:
    """--prepare's command for each host; NODES, NODE_RANK, HEAD (and GPUS, without
    launch.nproc) are the user's."""
    threads, nproc = cfg.launch.threads_per_rank, cfg.launch.nproc or "GPUS"
    cmd = ["cd", shlex.quote(os.getcwd()), "&&"]  # the config's relative paths are this cwd's
    cmd += [f"OMP_NUM_THREADS={threads}"] if threads != 1 else []
    cmd += ["torchrun", "--nnodes", "NODES", "--nproc-per-node", str(nproc), "--node-rank",
            "NODE_RANK", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"HEAD:{cfg.launch.master_port or 29500}", "-m", "fsdpfn.app.recipes.worker",
            "--config", shlex.quote(str(config_path.resolve()))]
    if resume:
        cmd.append("--resume")  # the servers: the config's rollout.url, which the ranks read
    return "  " + " ".join(cmd)


def _check_threads(cfg) -> None:
    """A rank's or a server's CPU threads, at most this host's cores: more only slow it down
    (and torch's thread pool takes no count past a C long)."""
    from fsdpfn.errors import ConfigError

    cores = os.cpu_count() or 1
    counts = [("launch.threads_per_rank", cfg.launch.threads_per_rank)]
    if hasattr(cfg, "rollout"):
        counts.append(("rollout.threads", cfg.rollout.threads))
    for key, n in counts:
        if n > cores:
            raise ConfigError(f"{key}: at most this host's {cores} CPU cores (more threads only "
                              f"slow it down), got {n}")


def _check_inputs(cfg, *, weights: bool = True) -> None:
    """What can fail before any rank starts: the model directory and the loggers (the data,
    the reward and the memory: fsdpfn.app.recipes.preflight). ``weights`` False: a hub
    model's dry run, whose weights are not fetched."""
    from fsdpfn.app.recipes.model import check_model_dir

    check_model_dir(cfg.model, weights=weights)
    _check_threads(cfg)
    if cfg.log.wandb is not None:
        try:
            import wandb  # noqa: F401
        except ImportError:
            from fsdpfn.errors import ConfigError

            raise ConfigError("log.wandb: needs the wandb package (pip install 'fsdpfn[wandb]'), "
                              f"got {cfg.log.wandb!r}") from None
    if cfg.log.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            from fsdpfn.errors import ConfigError

            raise ConfigError("log.tensorboard: needs the tensorboard package (pip install "
                              "tensorboard), got true") from None


def _prepare_data(cfg, run_dir: Path, *, resume: bool, out: Path | None = None) -> None:
    """Tokenize and filter the data files into run_dir/data once (reused on --resume, so the
    data cursor points into the same examples), and report what was dropped; ``out``: another
    directory (--dry-run's, thrown away)."""
    from fsdpfn.app.recipes.data import DATA_DIR, answer_reason, prepare_files
    from fsdpfn.app.recipes.model import load_tokenizer

    if not cfg.data.from_files:
        return
    out = out or run_dir / DATA_DIR
    if resume and (out / "train.jsonl").is_file():
        return
    report = prepare_files(cfg.data, load_tokenizer(cfg.model), cfg.recipe, out,
                           answer_reason=answer_reason(cfg))
    for split, r in report.items():
        dropped = sum(r["dropped"].values())
        say(f"data ({split}): {r['kept']} of {r['rows']} samples"
            + (f"; dropped {dropped}: " + ", ".join(f"{n} {why}" for why, n in
                                                   r["dropped"].items()) if dropped else ""))
    every = getattr(getattr(cfg, "eval", None), "every", 0)
    if every and not cfg.data.eval_files:
        say(f"eval.every={every}: no held-out evaluation (data.eval_files is empty; the "
            f"greedy accuracy is measured on eval files only)")
    per_step = _rows_per_step(cfg)
    kept = report.get("train", {}).get("kept", 0)
    if per_step is not None and 0 < kept < per_step[1]:
        say(f"data (train): {kept} samples for {per_step[0]}={per_step[1]} a step: each "
            f"step takes every sample about {per_step[1] / kept:.0f} times")


def _rows_per_step(cfg) -> tuple[str, int] | None:
    """(key, value): how many data samples one step of ``cfg``'s recipe reads."""
    for key in ("prompts_per_step", "batch_size", "pairs_per_step"):
        if hasattr(cfg, key):
            return key, getattr(cfg, key)
    return None


def launch(cfg, *, resume: bool = False, overwrite: bool = False, dry_run: bool = False,
           prepare: bool = False, notes=()) -> int:
    """Run ``cfg`` (a recipe config) as ``fsdpfn run`` does; returns the exit status.
    ``prepare``: every check and run_dir's files (config.yaml, data/), then the command that
    starts the trainer ranks under torchrun on each host; no process is started. ``notes``:
    lines of the config's making (the values chosen for the model), said with the preflight's."""
    from fsdpfn import serde
    from fsdpfn.app.recipes import NEEDS_ROLLOUT
    from fsdpfn.app.recipes.sources import resolve_sources
    from fsdpfn.app.recipes.model import initial_model_dir
    from fsdpfn.app.recipes.placement import count_gpus, place
    from fsdpfn.app.recipes.preflight import preflight
    from fsdpfn.app.supervise import write_run_state

    check_flags(resume=resume, overwrite=overwrite)
    run_dir = Path(cfg.run_dir)
    check_run_dir_path(run_dir)  # before count_gpus, which imports torch
    model_path = cfg.model.path
    cfg, found = resolve_sources(cfg, dry_run=dry_run)  # hub ids, hub files, patterns: local
    notes = [*notes, *found]
    hub = cfg.model.path != model_path
    config_path = run_dir / "config.yaml"
    if resume:
        check_resume_keeps(cfg, config_path)
        if not dry_run:  # a dry run changes nothing: it reads the published ones only
            finish_interrupted_saves(run_dir)
        check_resume_steps(cfg, run_dir)
    needs_rollout = cfg.recipe in NEEDS_ROLLOUT
    own_server = needs_rollout and cfg.rollout.url is None
    placement = None  # --prepare: the hosts are torchrun's, and their checks the ranks'
    if prepare:
        _check_prepare(cfg, dry_run=dry_run, own_server=own_server)
    else:
        n_gpus = count_gpus()
        placement = place(cfg, n_gpus, needs_rollout=needs_rollout)
        check_server_gpus(cfg, placement, n_gpus)
    model_dir = initial_model_dir(cfg.model, run_dir)
    url = cfg.rollout.url if needs_rollout else None
    _check_inputs(cfg, weights=not (dry_run and hub))
    notes = [*notes, *preflight(cfg, placement, data=dry_run)]  # a real run reads the data below
    if dry_run:
        import tempfile

        notes = prepare_run_dir(run_dir, resume=resume, overwrite=overwrite,
                                dry_run=True) + notes

        with tempfile.TemporaryDirectory(prefix="fsdpfn-dry-run-") as tmp:
            _prepare_data(cfg, run_dir, resume=False, out=Path(tmp))  # counts, as a run's
        for note in notes:
            say(note)
        print(serde.to_yaml(cfg), end="")
        say(f"placement: {_describe(placement)}")
        for line in describe_servers(cfg, model_dir, placement) if own_server else []:
            say(line)
        say("trainer: " + _describe_trainer(
            _worker_cmd(cfg, config_path, placement, resume=resume, url=url), placement.nproc,
            _master_port(cfg, url), cfg.launch.threads_per_rank))
        return 0
    fresh, had_data = not run_dir.exists(), (run_dir / "data").exists()
    for note in prepare_run_dir(run_dir, resume=resume, overwrite=overwrite):
        say(note)
    try:
        _prepare_data(cfg, run_dir, resume=resume)
    except BaseException:  # a refused run leaves no run_dir, nor a data/ half written
        if fresh:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif overwrite or not had_data:  # --overwrite cleared an earlier run's data/ before
            shutil.rmtree(run_dir / "data", ignore_errors=True)
        raise
    for note in notes:  # after every refusal: a refused run prints its one line alone
        say(note)
    config_path.write_text(serde.to_yaml(cfg))
    if prepare:
        say(f"prepared {run_dir}; start the trainer ranks on each host (run_dir on a file "
            f"system every host reads and writes) with:")
        print(_torchrun_line(cfg, config_path, resume=resume))
        return 0
    write_run_state(run_dir, "running", recipe=cfg.recipe, resume=resume)
    try:
        rc, interrupted, seconds, servers, failed = _run(cfg, run_dir, config_path, placement,
                                                         model_dir, own_server=own_server,
                                                         url=url, resume=resume)
    except BaseException as exc:
        write_run_state(run_dir, "failed", exit_code=None,
                        error=f"{type(exc).__name__}: {exc}"[:2000])
        raise
    status = 130 if interrupted else rc  # the process's exit status
    _summarize(cfg, run_dir, seconds, status, interrupted, servers)
    failure = {}
    if rc != 0 and not interrupted:
        failure["error"] = report_failure(run_dir, rc, failed)
    write_run_state(run_dir, "interrupted" if interrupted else ("done" if rc == 0 else "failed"),
                    exit_code=status, **failure)
    return status


def _run(cfg, run_dir: Path, config_path: Path, placement, model_dir: Path, *, own_server: bool,
         url: str | None, resume: bool) -> tuple[int, bool, float, list[dict], str | None]:
    """Start the servers (when ours) and the trainer ranks and wait for them; (exit status,
    interrupted, seconds, each server's record: server_records, how the first failed rank
    ended or None). The children die with this process (fsdpfn.wire.lifeline)."""
    from fsdpfn.app.ranks import TrainerRanks
    from fsdpfn.wire.lifeline import LAUNCHER_PID_ENV, die_with_parent

    t0 = time.monotonic()
    signals = Signals(run_dir)
    shutil.rmtree(signals.ranks_dir, ignore_errors=True)
    signals.install()
    servers: list = []
    records: list[dict] = []
    ranks, failed = None, None
    try:
        if own_server:
            servers = start_servers(cfg, run_dir, model_dir, placement)
            url = ",".join(s.url for s in servers)
        cmd = _worker_cmd(cfg, config_path, placement, resume=resume, url=url)
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.launch.threads_per_rank),
               TTY_ENV: "1" if sys.stderr.isatty() else "0",
               "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               LAUNCHER_PID_ENV: str(os.getpid()), **placement.env(placement.trainer_gpus)}
        urls = url.split(",") if url else []
        where = (f", rollout server {urls[0]}" if len(urls) == 1 else
                 f", {len(urls)} rollout servers {' '.join(urls)}" if urls else "")
        say(f"{cfg.recipe}: {placement.nproc} trainer rank(s), run_dir {run_dir}{where}; "
            f"{_describe(placement)}")
        if signals.count:
            return 130, True, time.monotonic() - t0, records, None
        # each in its own session: a terminal's Ctrl-C reaches the launcher only, which
        # forwards it
        ranks = TrainerRanks(cmd, placement.nproc, port=_master_port(cfg, url), env=env,
                             preexec_fn=die_with_parent())
        signals.trainer = ranks
        relay = Relay(ranks.stdout, run_dir)
        rc = _wait(ranks, servers, signals)
        relay.join()
        failed = ranks.describe_failure()
        if failed and not signals.count:
            log_line(run_dir, f"[fsdpfn] {failed}" + ("; the other ranks were stopped"
                                                       if ranks.stopped else ""))
        records = server_records(urls, servers, placement)
    finally:
        if ranks is not None and ranks.running():  # an error in the launcher itself
            ranks.kill()
        for server in servers:
            server.close()
        signals.restore()
    return rc, signals.count > 0, time.monotonic() - t0, records, failed


def _describe(p) -> str:
    many = f"{p.servers} servers" if p.servers > 1 else "server"
    if p.device == "cpu" and p.server_device in (None, "cpu"):
        return "CPU" + (f", {many + ', ' if p.servers > 1 else ''}weights pushed by "
                        f"{p.transport}" if p.server_device else "")
    train = f"trainer on {p.device}" + (f" GPU {list(p.trainer_gpus)}" if p.trainer_gpus else "")
    if p.server_device is None:
        return f"{train}, {p.dtype}"
    serve = f"{many} on {p.server_device}" + (f" GPU {list(p.server_gpus)}" if p.server_gpus
                                              else "")
    return f"{train}, {serve}, weights pushed by {p.transport}, {p.dtype}"


def _wait(ranks, servers: list, signals: Signals) -> int:
    reported = False
    while True:
        try:
            return ranks.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        dead = [s for s in servers if not s.alive()]
        if dead and not reported and not signals.count:
            reported = True
            server = dead[0]
            say(f"the rollout server {server.url} exited with {server.proc.returncode}; "
                f"stopping the trainer. Its log ({server.log_path}):\n{server.log()}")
            ranks.stop()


def _summarize(cfg, run_dir: Path, seconds: float, rc: int, interrupted: bool,
               servers: list[dict] = ()) -> dict:
    from fsdpfn.app.recipes.plot import plot_metrics, read_metrics

    metrics = run_dir / "metrics.jsonl"
    rows = [r for r in read_metrics(metrics) if r.get("phase") == cfg.recipe] \
        if metrics.is_file() else []
    summary = {"recipe": cfg.recipe, "run_dir": str(run_dir), "exit_code": rc,
               "interrupted": interrupted, "wall_seconds": round(seconds, 1),
               "steps": rows[-1]["step"] if rows else 0}
    key = next((k for k in ("reward_mean", "accuracy", "reward_accuracy", "loss")
                if rows and rows[0].get(k) is not None), None)
    if key is not None:
        k = max(1, min(5, len(rows) // 4))
        first = [r[key] for r in rows[:k] if r.get(key) is not None]
        last = [r[key] for r in rows[-k:] if r.get(key) is not None]
        summary[key] = {"first": rows[0][key], "last": rows[-1][key],
                        f"mean_first_{k}": sum(first) / len(first),
                        f"mean_last_{k}": sum(last) / len(last)}
    evals = [r["greedy_accuracy"] for r in rows if r.get("greedy_accuracy") is not None]
    if evals:
        summary["greedy_accuracy"] = {"first": evals[0], "last": evals[-1]}
    if servers:
        summary["rollout_servers"] = list(servers)
    from fsdpfn.checkpoint.files import latest_checkpoint

    latest = latest_checkpoint(run_dir / "checkpoints")  # published only: never a step_N.tmp-*
    if latest is not None:
        summary["checkpoint"] = str(latest)
    if rows and cfg.log.plot:
        png = plot_metrics(metrics, run_dir / "metrics.png", phase=cfg.recipe)
        if png is not None:
            summary["plot"] = str(png)
        else:
            say("no metrics.png: plotting needs matplotlib (pip install 'fsdpfn[recipes]')")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    minutes = f"{int(seconds) // 60}:{int(seconds) % 60:02d}"
    status = "stopped" if interrupted else ("done" if rc == 0 else f"failed (exit {rc})")
    line = f"{status} in {minutes}: {cfg.recipe}, {summary['steps']} steps"
    if key is not None:
        s = summary[key]
        k = next(n for n in s if n.startswith("mean_first_")).rsplit("_", 1)[1]
        line += (f"; {key} {s[f'mean_first_{k}']:.3f} -> {s[f'mean_last_{k}']:.3f} "
                 f"(mean of the first / last {k} steps)")
    if evals:
        line += f"; greedy accuracy (held-out) {evals[0]:.3f} -> {evals[-1]:.3f}"
    say(line)
    if len(servers) > 1:
        say("rollout servers: " + "; ".join(
            f"{s['url']} ({s.get('device', 'external')}) at weights version "
            f"{s['weight_version']}" for s in servers))
    written = [f"metrics {metrics}"] if metrics.is_file() else []  # none if it failed first
    written += [f"plot {summary['plot']}"] if "plot" in summary else []
    written += [f"checkpoint {summary['checkpoint']}"] if "checkpoint" in summary else []
    if written:
        say(", ".join(written))
    if (interrupted or rc != 0) and _resumable(run_dir, summary):
        say(f"continue with: fsdpfn run {run_dir / 'config.yaml'} --resume")
    return summary


def _resumable(run_dir: Path, summary: dict) -> bool:
    """Whether --resume would continue anything: a published checkpoint, or the RL warm-up's
    result (run_dir/sft, fsdpfn.app.recipes.rl.WARMUP_MODEL); a run that failed or stopped
    before either starts over at step 0 on --resume, so it is not suggested."""
    return "checkpoint" in summary or (run_dir / "sft" / "config.json").is_file()
