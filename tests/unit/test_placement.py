"""Where `fsdpfn run` puts trainer ranks and the rollout server (no GPU needed: the GPU count is
an argument), and the parallel layout checked against the ranks before any rank starts."""

from __future__ import annotations

import pytest

from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes import default_config
from fsdpfn.app.recipes import placement as P


def place(recipe="grpo", n_gpus=0, *overrides):
    cfg = default_config(recipe, list(overrides))
    return P.place(cfg, n_gpus, needs_rollout=recipe in ("grpo", "ppo"))


def test_cpu_host_runs_two_ranks_and_broadcasts():
    p = place("grpo", 0)
    assert (p.device, p.nproc, p.trainer_gpus, p.server_device, p.transport, p.dtype) == \
        ("cpu", 2, (), "cpu", "broadcast", "float32")


def test_one_gpu_is_shared_and_weights_go_by_cuda_ipc():
    p = place("grpo", 1)
    assert (p.device, p.nproc, p.trainer_gpus, p.server_gpus, p.transport, p.dtype) == \
        ("cuda", 1, (0,), (0,), "ipc", "bfloat16")
    assert place("grpo", 1, "rollout.transport=disk").transport == "disk"
    with pytest.raises(ConfigError, match=r"rollout.transport: 'broadcast' needs the server on "
                                          r"a GPU of its own.*got 'broadcast'"):
        place("grpo", 1, "rollout.transport=broadcast")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_last_gpu_serves_the_others_train(n):
    p = place("grpo", n)
    assert p.trainer_gpus == tuple(range(n - 1)) and p.server_gpus == (n - 1,)
    assert p.nproc == n - 1 and p.transport == "broadcast"


def test_supervised_recipes_train_on_every_gpu():
    p = place("sft", 4)
    assert p.trainer_gpus == (0, 1, 2, 3) and p.nproc == 4 and p.server_device is None


def test_explicit_gpus_and_their_errors():
    p = place("grpo", 4, "launch.gpus=[1, 2]", "rollout.gpus=[0]")
    assert p.trainer_gpus == (1, 2) and p.server_gpus == (0,) and p.nproc == 2
    # the server shares a GPU, but not rank 0's: IPC cannot reach it, disk can
    assert place("grpo", 4, "launch.gpus=[0, 1]", "rollout.gpus=[1]").transport == "disk"
    assert place("grpo", 4, "launch.gpus=[1, 0]", "rollout.gpus=[1]").transport == "ipc"
    with pytest.raises(ConfigError, match=r"rollout.transport: 'ipc' needs the server on "
                                          r"trainer rank 0's GPU"):
        place("grpo", 4, "rollout.transport=ipc")
    with pytest.raises(ConfigError, match=r"launch.gpus: GPU indices must be < 2 .*got \[0, 5\]"):
        place("grpo", 2, "launch.gpus=[0, 5]")
    with pytest.raises(ConfigError, match=r"launch.nproc: one trainer rank per GPU.*got 3"):
        place("grpo", 2, "launch.nproc=3")
    with pytest.raises(ConfigError, match=r"launch.device: 'cuda' needs a GPU"):
        place("grpo", 0, "launch.device=cuda")
    with pytest.raises(ConfigError, match=r"launch.gpus: must be null or a list of distinct"):
        place("grpo", 4, "launch.gpus=[1, 1]")


def test_cpu_trainer_with_a_gpu_server_and_float32_on_request():
    p = place("grpo", 2, "launch.device=cpu", "rollout.device=cuda")
    assert p.device == "cpu" and p.server_gpus == (1,) and p.transport == "broadcast"
    assert place("grpo", 1, "engine.dtype=float32").dtype == "float32"


def test_parallel_layout_must_fill_the_ranks():
    with pytest.raises(ConfigError, match=r"parallel.tp: tp x cp = 3 x 1 = 3 must divide the 2 "
                                          r"trainer ranks"):
        place("sft", 0, "parallel.tp=3")
    with pytest.raises(ConfigError, match=r"parallel.dp: dp x cp x tp = 2 x 1 x 2 = 4 must "
                                          r"equal the 2 trainer ranks"):
        place("sft", 0, "parallel.dp=2", "parallel.tp=2")
    assert place("sft", 0, "parallel.tp=2").nproc == 2


def test_env_names_the_launchers_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    p = place("grpo", 3)
    assert p.env(p.trainer_gpus) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert p.env(p.server_gpus) == {"CUDA_VISIBLE_DEVICES": "6"}
    assert p.env(()) == {}


def test_the_servers_decode_cache_is_sized_to_one_steps_answers():
    """Each server `fsdpfn run` starts gets a slot per answer of its share of one step
    (prompts_per_step x group_size over the servers, in multiples of 8, at most 1,024) and, for
    data files, the positions of the longest prompt plus answer the data allows (its default,
    half the free GPU memory, took 60 GB beside the trainer on one H200 and ran the trainer out
    of memory)."""
    from fsdpfn.app.servers import server_cmd

    def flags(recipe, *overrides):
        cfg = default_config(recipe, list(overrides))
        cmd = server_cmd(cfg, "m", 0, P.place(cfg, 1, needs_rollout=True))
        return cmd[cmd.index("--parent-pid") + 2:]

    assert flags("grpo", "prompts_per_step=3", "advantage.group_size=5") == ["--decode-rows",
                                                                            "16"]
    assert flags("ppo", "prompts_per_step=7") == ["--decode-rows", "8"]
    assert flags("grpo", "prompts_per_step=1000") == ["--decode-rows", "1024"]
    assert flags("grpo", "model.path=/m", "data.train_files=[/d.jsonl]",
                 "data.max_prompt_tokens=700", "data.max_response_tokens=3000",
                 "prompts_per_step=16") == ["--decode-rows", "128", "--decode-max-len", "3700"]
    # a workflow's turns carry the turns before them: its declared episode length sizes the
    # positions where it is longer than the data's row (or the server's default of 2048)
    wf = ("rollout.workflow=examples/workflows.py:check_and_retry", "prompts_per_step=16")
    data = ("model.path=/m", "data.train_files=[/d.jsonl]", "data.max_prompt_tokens=700",
            "data.max_response_tokens=300")
    assert flags("grpo", *wf, *data, "rollout.max_episode_tokens=6000")[-2:] == [
        "--decode-max-len", "6000"]
    assert flags("grpo", *wf, *data, "rollout.max_episode_tokens=800")[-2:] == [
        "--decode-max-len", "1000"]
    assert flags("grpo", *wf, "rollout.max_episode_tokens=4096") == [
        "--decode-rows", "128", "--decode-max-len", "4096"]
    assert flags("grpo", *wf, "rollout.max_episode_tokens=2048") == ["--decode-rows", "128"]
    # several servers: each holds its share of the step (the balancer fills them evenly)
    cfg = default_config("grpo", ["prompts_per_step=16", "rollout.servers=3"])
    cmd = server_cmd(cfg, "m", 0, P.place(cfg, 0, needs_rollout=True))
    assert cmd[cmd.index("--parent-pid") + 2:] == ["--decode-rows", "48"]  # 128 / 3 -> 43 -> 48


def test_the_server_waits_for_the_starting_model_only_where_rank_0_writes_it():
    """run_dir/model0 (the embedded model, random_init's config) is written by trainer rank 0
    as it starts, so the server `fsdpfn run` starts waits for its config.json (as long as rank
    0 waits for the server's /health); a user's model.path is there from the start."""
    from fsdpfn.app.servers import server_cmd

    def wait(*overrides):
        cfg = default_config("grpo", list(overrides))
        cmd = server_cmd(cfg, "m", 0, P.place(cfg, 1, needs_rollout=True))
        return cmd[cmd.index("--wait-for-model") + 1] if "--wait-for-model" in cmd else None

    assert wait() == "300.0"
    assert wait("rollout.health_timeout_s=45") == "45.0"
    assert wait("model.path=/m", "model.random_init=true") == "300.0"
    assert wait("model.path=/m") is None
