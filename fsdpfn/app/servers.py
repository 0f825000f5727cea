"""The rollout servers that ``fsdpfn run`` starts itself (when ``rollout.url`` is not set): one
``python -m fsdpfn.rollout`` per ``rollout.gpus`` entry or ``rollout.servers`` of them, each on
a port the launcher binds and hands over (``--fd``), on its own device, in its own session,
with the launcher's lifeline (fsdpfn.wire.lifeline), its output in run_dir/rollout.log,
rollout1.log, ...; its decode cache sized to the run. Also the refusal of ``rollout.gpus`` where
the servers would run on the CPU, each server's line in the dry run and its record in the
summary (URL, device, log, final weights version).

Only the standard library is imported here at module level (the launcher's module-level
imports stay free of torch: fsdpfn.app.launcher).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fsdpfn.rollout.args import DECODE_MAX_LEN

__all__ = ["check_server_gpus", "decode_cache_args", "describe_servers", "server_cmd",
           "server_records", "start_servers"]


def check_server_gpus(cfg, placement, n_gpus: int) -> None:
    """rollout.gpus places the servers fsdpfn run starts on CUDA; where they run on the CPU
    (a host without GPUs, or rollout.device auto following a trainer on the CPU) it is refused
    rather than ignored. So is rollout.server_args' --kv-cache-dtype fp8_e4m3 there (the
    float8 cache is read on a GPU; the server would refuse it as it starts). rollout.device cpu
    and rollout.url with gpus are config rules
    (fsdpfn.app.recipes.rollout_config.RolloutConfig)."""
    rollout = getattr(cfg, "rollout", None)
    if rollout is None or placement.server_device != "cpu":
        return
    from fsdpfn.app.recipes.rollout_config import server_namespace
    from fsdpfn.errors import ConfigError

    why = ("this host has no GPU" if n_gpus == 0 else
           f"rollout.device {cfg.rollout.device!r} follows launch.device "
           f"{cfg.launch.device!r}")
    cache = server_namespace(list(rollout.server_args)).kv_cache_dtype
    if cache != "auto":
        raise ConfigError(f"rollout.server_args: --kv-cache-dtype {cache} is the decode loop's "
                          f"float8 cache, read on a GPU of compute capability 8.9 or later, and "
                          f"the servers would run on the CPU ({why}); leave the flag out there, "
                          f"got {list(rollout.server_args)}")
    gpus = rollout.gpus
    if gpus is None:
        return
    raise ConfigError(f"rollout.gpus: GPU indices need the rollout servers on CUDA, and they "
                      f"would run on the CPU ({why}; rollout.servers=N starts N there), got "
                      f"{list(gpus)}")


def server_cmd(cfg, model_dir: Path, port: int, placement) -> list[str]:
    """A rollout server's command, listening on ``port`` (the dry run shows 0: a server that is
    started gets the port the launcher bound for it, and ``--fd``)."""
    return [sys.executable, "-m", "fsdpfn.rollout", "--model", str(model_dir),
            # run_dir/model0 is written by trainer rank 0 as it starts (prepare_initial_model)
            *(["--wait-for-model", str(cfg.rollout.health_timeout_s)]
              if cfg.model.embedded or cfg.model.random_init else []),
            "--port", str(port), "--host", "127.0.0.1", "--device", placement.server_device,
            "--dtype", placement.dtype, "--threads", str(cfg.rollout.threads),
            "--parent-pid", str(os.getpid()), *decode_cache_args(cfg),
            # random_init: the server starts on placeholders, the first push brings the weights
            *(["--load-format", "dummy"] if cfg.model.random_init and not cfg.model.embedded
              else []),
            # the recipe's own flags last: its --decode-rows or --decode-max-len wins
            *cfg.rollout.server_args]


def decode_cache_args(cfg) -> list[str]:
    """Each server's decode cache sized to the run: a slot for each of its share of one step's
    answers (prompts_per_step x group_size over the servers, which the balancer fills evenly; in
    multiples of 8, at most 1,024; rows beyond the slots queue), and, for data files,
    positions for the longest prompt plus answer the data allows, or a workflow's
    rollout.max_episode_tokens where that is longer (a later turn's prompt holds the turns before
    it; a call past the positions is refused). Left to its default (half of the free memory at
    start), a server that shares its GPU with the trainer takes memory the trainer needs later,
    sized for far more rows than a step asks for (BENCHMARKS.md, "The main job": the server
    cache sizing)."""
    rows = -(-cfg.prompts_per_step * cfg.advantage.group_size // cfg.rollout.n_servers)
    args = ["--decode-rows", str(min(1024, max(8, -(-rows // 8) * 8)))]
    positions = cfg.data.max_prompt_tokens + cfg.data.max_response_tokens \
        if cfg.data.from_files else None
    episode = cfg.rollout.max_episode_tokens if cfg.rollout.workflow else None
    if episode is not None and episode > (positions or DECODE_MAX_LEN):
        positions = episode
    if positions is not None:
        args += ["--decode-max-len", str(positions)]
    return args


def describe_servers(cfg, model_dir: Path, placement) -> list[str]:
    """The dry run's line for each server the run would start: its environment and command, in
    a form a shell takes."""
    lines = []
    for i in range(placement.servers):
        env = placement.server_env(i)
        lines.append(f"rollout server {i}: " + "".join(f"{k}={v} " for k, v in env.items())
                     + " ".join(server_cmd(cfg, model_dir, 0, placement)))
    return lines


def start_servers(cfg, run_dir: Path, model_dir: Path, placement) -> list:
    """Every server of the placement; a failure to start one stops those already started."""
    servers = []
    try:
        for i in range(placement.servers):
            servers.append(_start_server(cfg, run_dir, model_dir, placement, i))
    except BaseException:
        for server in servers:
            server.close()
        raise
    return servers


def _start_server(cfg, run_dir: Path, model_dir: Path, placement, i: int):
    """Server ``i``: ``python -m fsdpfn.rollout`` on its own port and device (its GPU alone
    visible), in its own session (Ctrl-C must not reach it before the ranks finished their
    step), with the launcher's lifeline; trainer rank 0 waits for its /health."""
    import socket

    from fsdpfn.app.recipes.placement import server_log_name
    from fsdpfn.rollout.process import RolloutProcess
    from fsdpfn.wire.lifeline import die_with_parent

    # the port is bound here and the socket handed to the server (--fd): a server waits for
    # the starting model (the warm-up) before it serves, and a port only chosen, not bound,
    # could be taken meanwhile by any other process of the host
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listening.bind(("127.0.0.1", 0))
        listening.listen(128)
        port = listening.getsockname()[1]
        log_path = run_dir / server_log_name(i)
        env = {**os.environ, "OMP_NUM_THREADS": str(cfg.rollout.threads),
               **placement.server_env(i)}
        cmd = server_cmd(cfg, model_dir, port, placement) + ["--fd", str(listening.fileno())]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, preexec_fn=die_with_parent(),
                                    pass_fds=(listening.fileno(),))
    finally:
        listening.close()  # the server holds its own copy
    return RolloutProcess(proc, f"http://127.0.0.1:{port}", log_path)


def server_records(urls: list[str], servers: list, placement) -> list[dict]:
    """Each rollout server as the summary names it: its URL, where it ran (ours: its device
    and log) and the weights version it serves at the end (None: it did not answer)."""
    from fsdpfn.wire.http import call

    records = []
    for i, url in enumerate(urls):
        record: dict = {"url": url}
        if i < len(servers):
            record["device"] = (f"cuda (GPU {placement.server_gpus[i]})"
                                if placement.server_gpus else placement.server_device)
            record["log"] = str(servers[i].log_path)
        try:
            record["weight_version"] = call(url, "/get_model_info", timeout=5.0).get("version")
        except Exception:  # noqa: BLE001 - a server that is gone is named without a version
            record["weight_version"] = None
        records.append(record)
    return records
