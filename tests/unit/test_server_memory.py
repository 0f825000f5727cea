"""A rollout server on a GPU of its own holds the whole model in the served dtype and the decode
cache its command line sizes. Before, nothing estimated that GPU: a model too big for one server
GPU (a 70B on 80 GB) started the trainer ranks, then the server failed on an out-of-memory
error. Now the preflight holds the server's estimate against what is free on its GPU and
refuses by name, offering the decode rows that fit or, where the weights leave no room,
servers that shard the model. The sizes are written out by hand here, and the estimate's
slots and positions are read back from the server's own command line by the server's own
parser."""

from __future__ import annotations

import re

import pytest

from fsdpfn.app.recipes import default_config
from fsdpfn.app.recipes import gpu_memory, placement as P, preflight
from fsdpfn.app.recipes.memory import HEADROOM, ModelShape, server_bytes
from fsdpfn.app.recipes.server_memory import check_server_memory
from fsdpfn.app.servers import server_cmd
from fsdpfn.errors import ConfigError
from fsdpfn.rollout.args import parse_args

GiB = 2 ** 30
# a Llama-3-70B-shaped model and a Qwen2-7B-shaped one
L70 = ModelShape(hidden=8192, intermediate=28672, layers=80, vocab=128256, heads=64,
                 kv_heads=8, head_dim=128)
Q7 = ModelShape(hidden=3584, intermediate=18944, layers=28, vocab=152064, heads=28,
                kv_heads=4, head_dim=128)
FILES = ["model.path=/models/x", "data.train_files=[train.jsonl]", "data.max_prompt_tokens=512",
         "data.max_response_tokens=1024", "prompts_per_step=16", "ppo.n_minibatches=2"]


def _server_flags(cfg):
    """The slots and positions the server's parser reads from the command fsdpfn run gives
    it (launch.gpus and rollout.gpus: a trainer and a server GPU)."""
    cmd = server_cmd(cfg, "m", 0, P.place(cfg, 2, needs_rollout=True))
    args = parse_args(cmd[cmd.index("fsdpfn.rollout") + 1:])
    return args.decode_rows, args.decode_max_len


@pytest.mark.parametrize("overrides,slots,positions", [
    ([], 128, 1536),                                         # 16 x 8 answers, 512 + 1,024
    (["rollout.server_args=[--decode-rows, 40]"], 40, 1536),  # the user's flag wins
    (["rollout.server_args=[--decode-max-len, 4096]"], 128, 4096),
    (["rollout.servers=2", "launch.gpus=[0]", "rollout.gpus=[1, 2]"], 64, 1536),  # a share
])
def test_the_estimate_reads_the_cache_the_servers_command_line_sizes(overrides, slots,
                                                                      positions):
    cfg = default_config("grpo", FILES + overrides)
    if "rollout.servers=2" not in overrides:
        assert _server_flags(cfg) == (slots, positions)
    est = server_bytes(cfg, Q7)
    assert est["weights"] == 2 * Q7.params                       # bf16
    assert est["decode cache"] == slots * positions * 28 * 2 * 4 * 128 * 2   # k, v of 28 layers
    assert server_bytes(cfg, Q7, "float32")["weights"] == 4 * Q7.params


def test_a_float8_kv_cache_is_estimated_at_one_byte_a_value():
    """rollout.server_args=[--kv-cache-dtype, fp8_e4m3]: the server's cache holds one byte a
    value, so the estimate's decode cache is half the bf16 one; the weights do not change."""
    plain = server_bytes(default_config("grpo", FILES), Q7)
    fp8 = server_bytes(default_config(
        "grpo", FILES + ["rollout.server_args=[--kv-cache-dtype, fp8_e4m3]"]), Q7)
    assert fp8["decode cache"] == 128 * 1536 * 28 * 2 * 4 * 128 == plain["decode cache"] / 2
    assert fp8["weights"] == plain["weights"]


def test_a_server_that_fits_is_a_note_and_one_that_does_not_is_refused_with_rows_that_fit():
    cfg = default_config("grpo", FILES + ["prompts_per_step=64"])   # 512 slots of 1,536
    est = server_bytes(cfg, Q7)
    room = (est["weights"] + est["decode cache"]) / HEADROOM
    note = check_server_memory(cfg, Q7, gpus=(7,), capacity=room)
    assert note.startswith("rollout server memory estimate: ") and "on GPU 7 (weights 14.2, " \
        "decode cache 42.0)" in note, note
    capacity = 40 * GiB
    with pytest.raises(ConfigError) as info:
        check_server_memory(cfg, Q7, gpus=(7,), capacity=capacity)
    msg = str(info.value)
    assert msg.startswith("rollout: each rollout server holds the whole model on a GPU of its "
                          "own, and it does not fit, rollout server memory estimate: 56.2 GiB "
                          "of 40.0 GiB on GPU 7"), msg
    rows = int(re.search(r"\['--decode-rows', '(\d+)'\]", msg).group(1))
    assert rows % 8 == 0 and "data.max_response_tokens" in msg
    # the rows it offers fit; 8 more do not
    fits = default_config("grpo", FILES + ["prompts_per_step=64",
                                           f"rollout.server_args=[--decode-rows, {rows}]"])
    assert check_server_memory(fits, Q7, gpus=(7,), capacity=capacity)
    more = default_config("grpo", FILES + ["prompts_per_step=64",
                                           f"rollout.server_args=[--decode-rows, {rows + 8}]"])
    with pytest.raises(ConfigError):
        check_server_memory(more, Q7, gpus=(7,), capacity=capacity)


def test_weights_that_leave_no_room_for_a_cache_ask_for_a_sharded_server():
    cfg = default_config("grpo", FILES)
    with pytest.raises(ConfigError) as info:
        check_server_memory(cfg, L70, gpus=(6, 7), capacity=80 * GiB)
    msg = str(info.value)
    assert "on GPUs 6, 7 (weights 131.4, decode cache" in msg
    assert msg.endswith("its weights take 131.4 GiB and leave no room for a decode cache of 8 "
                        "rows: serve the model from servers that shard it (rollout.url, e.g. "
                        "SGLang with tensor parallelism), or train a smaller model"), msg


def test_the_preflight_holds_a_server_gpu_against_what_is_free_on_it(monkeypatch):
    """nvidia-smi's lines as text (the format tests/unit/test_gpu_memory.py reads): GPU 1, the
    server's, is nearly full with another process; the trainer's GPU 0 is free. A server
    sharing the trainer's GPU is counted in the trainer's estimate instead (one note)."""
    pytest.importorskip("fastapi", reason="grpo's preflight first checks that the server extra "
                        "(fastapi, uvicorn) is installed, as the README's test command installs")
    smi = "0, GPU-aaaa1111-0000, 81559, 4\n1, GPU-bbbb2222-0000, 81559, 81000\n"
    monkeypatch.setattr(gpu_memory, "host_gpus", lambda: gpu_memory.parse_gpus(smi))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = default_config("grpo", ["launch.device=cuda"])
    placed = P.place(cfg, 2, needs_rollout=True)
    assert placed.server_gpus == (1,) and placed.trainer_gpus == (0,)
    with pytest.raises(ConfigError) as info:
        preflight.preflight(cfg, placed, data=False)
    msg = str(info.value)
    assert msg.startswith("rollout: each rollout server holds the whole model") and \
        "GiB free on GPU 1 (" in msg and "in use by other processes (nvidia-smi): GPU 1: " \
        "79.1 of 79.6 GiB" in msg and msg.endswith("(or free the GPUs that other processes "
                                                   "hold)"), msg
    smi = "0, GPU-aaaa1111-0000, 81559, 4\n1, GPU-bbbb2222-0000, 81559, 4\n"
    monkeypatch.setattr(gpu_memory, "host_gpus", lambda: gpu_memory.parse_gpus(smi))
    notes = preflight.preflight(cfg, placed, data=False)
    assert any(n.startswith("rollout server memory estimate: ") and "on GPU 1 (" in n
               for n in notes), notes
    one = P.place(cfg, 1, needs_rollout=True)   # trainer and server share GPU 0
    notes = preflight.preflight(cfg, one, data=False)
    assert not any(n.startswith("rollout server memory") for n in notes)
    assert any("rollout server " in n for n in notes if n.startswith("memory estimate"))
