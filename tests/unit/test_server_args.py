"""rollout.server_args: the flags a recipe passes on to the rollout servers `fsdpfn run` starts
(the decode loop's kernels, rows and lengths, HF generate, CUDA graphs). Each is checked against
the server's own command line before launch, a flag the launcher sets itself is refused naming
the key that sets it, and they reach the server's command last, so the recipe's decode rows and
lengths win over the launcher's sizing. rollout.sampling: more sampling parameters for every
request, checked by the server's own rules before launch."""

from __future__ import annotations

import pytest

from fsdpfn.app.servers import server_cmd
from fsdpfn.app.recipes import default_config
from fsdpfn.app.recipes import placement as P
from fsdpfn.errors import ConfigError
from fsdpfn.rollout.args import parse_args


def _server(*overrides):
    """The server's parsed command line for a grpo run with these overrides, on the CPU."""
    cfg = default_config("grpo", list(overrides))
    cmd = server_cmd(cfg, "m", 0, P.place(cfg, 0, needs_rollout=True))
    assert cmd[:3] and cmd[2] == "fsdpfn.rollout"
    return parse_args(cmd[3:])


def test_the_flags_reach_the_server_last_and_win_over_the_launchers_sizing():
    plain = _server("prompts_per_step=4")
    assert (plain.decode, plain.decode_rows, plain.no_cuda_graphs) == ("auto", 32, False)
    got = _server("prompts_per_step=4", "rollout.server_args=[--decode, loop, --decode-rows, "
                  "64, --no-cuda-graphs, --decode-rope-kv=torch]")
    assert (got.decode, got.decode_rows, got.no_cuda_graphs, got.decode_rope_kv) == \
        ("loop", 64, True, "torch")
    assert (got.model, got.port, got.device) == (plain.model, plain.port, plain.device)
    # one string is split as a shell would; numbers in a YAML list are written as text
    cfg = default_config("grpo", ['rollout.server_args="--decode hf --log-level info"'])
    assert cfg.rollout.server_args == ("--decode", "hf", "--log-level", "info")
    assert default_config("grpo", ["rollout.server_args=[--decode-max-len, 4096]"]) \
        .rollout.server_args == ("--decode-max-len", "4096")
    assert default_config("grpo").rollout.server_args == ()


@pytest.mark.parametrize("value,rule", [
    ("[--port, 9]", "must not set --port, which comes from fsdpfn run (a free port)"),
    ("[--device=cpu]", "must not set --device, which comes from rollout.device and rollout.gpus"),
    ("[--dtype, float16]", "must not set --dtype, which comes from engine.dtype"),
    ("[--no-channel]", "must not set --no-channel, which comes from fsdpfn run"),
    ("[--decode-rowz, 8]", "must be flags python -m fsdpfn.rollout accepts, got ['--decode-rowz',"
                           " '8'] (unrecognized arguments: --decode-rowz 8)"),
    ("[--decode-ro, 8]", "must be flags python -m fsdpfn.rollout accepts, got ['--decode-ro', "
                         "'8'] (unrecognized arguments: --decode-ro 8)"),
    ("[--decode-attention, paged]", "must be flags python -m fsdpfn.rollout accepts, got "
                                    "['--decode-attention', 'paged'] (argument "
                                    "--decode-attention: invalid choice: 'paged'"),
    ("[--decode-rows, x]", "argument --decode-rows: must be an int >= 1, got 'x'"),
    ("[--decode-rows]", "argument --decode-rows: expected one argument"),
    ("5", "must be a list of flags of python -m fsdpfn.rollout (non-empty strings), got 5"),
    ("'--decode \"hf'", "must be a list of flags, or one string a shell can split (quotes "
                         "closed), got '--decode \"hf'"),
    ("[--decode, '']", "must be a list of flags of python -m fsdpfn.rollout (non-empty "
                       "strings)"),
])
def test_a_bad_flag_is_refused_naming_the_key_the_rule_and_the_value(value, rule):
    with pytest.raises(ConfigError) as info:
        default_config("grpo", [f"rollout.server_args={value}"])
    message = str(info.value)
    assert message.startswith("rollout.server_args: ") and rule in message, message
    assert ", got " in message


def test_sampling_with_a_workflow_is_refused():
    """A workflow calls the server itself, with its own sampling: rollout.sampling would do
    nothing there."""
    with pytest.raises(ConfigError, match=r"^rollout.sampling: must be empty with "
                                          r"rollout.workflow .*, got \{'top_k': 3\}$"):
        default_config("grpo", ["rollout.workflow=pkg.mod:fn", "rollout.sampling={top_k: 3}"])


def test_flags_for_external_servers_are_refused():
    """rollout.url names servers fsdpfn run does not start: flags for them would do nothing."""
    with pytest.raises(ConfigError, match=r"^rollout.server_args: must be empty when rollout.url "
                                          r"names external servers .*, got \['--decode', 'hf'\]$"):
        default_config("grpo", ["rollout.url=http://127.0.0.1:1",
                                "rollout.server_args=[--decode, hf]"])
    assert default_config("grpo", ["rollout.url=http://127.0.0.1:1"]).rollout.server_args == ()


@pytest.mark.parametrize("override,message", [
    ("data.prompt_key=''", "data.prompt_key: must be a column name, got ''"),
    ("data.train_files=5", "data.train_files: must be a list of file paths, got 5"),
])
def test_a_data_key_is_named_once(override, message):
    """The data section's validators name their section themselves (for configs built outside
    fsdpfn.serde); the error of a recipe names it once, not ``data.data.``."""
    with pytest.raises(ConfigError) as info:
        default_config("grpo", [override])
    assert str(info.value) == message


class _Tok:
    stop_ids = [2, 7]


def test_sampling_parameters_reach_every_request_and_the_eval_takes_the_ends():
    """rollout.sampling adds to the recipe's own parameters (its stop_token_ids after the
    tokenizer's); the greedy eval takes only what decides where an answer ends."""
    from fsdpfn.app.recipes.rollout_stage import sampling

    cfg = default_config("grpo", ["rollout.temperature=0.7", "ppo.temperature=0.7",
                                  "rollout.sampling={top_k: 20, "
                                  "stop: ['</answer>'], stop_token_ids: [7, 9], min_p: 0.05}"])
    assert sampling(cfg, _Tok()) == {
        "max_new_tokens": cfg.task.max_answer_tokens, "temperature": 0.7, "top_p": 1.0,
        "stop_token_ids": [2, 7, 9], "top_k": 20, "stop": ["</answer>"], "min_p": 0.05}
    assert sampling(cfg, _Tok(), greedy=True) == {
        "max_new_tokens": cfg.task.max_answer_tokens, "temperature": 0.0,
        "stop_token_ids": [2, 7, 9], "stop": ["</answer>"]}
    plain = default_config("grpo")
    assert sampling(plain, _Tok()) == {"max_new_tokens": plain.task.max_answer_tokens,
                                       "temperature": 1.0, "top_p": 1.0,
                                       "stop_token_ids": [2, 7]}


@pytest.mark.parametrize("value,message", [
    ("{top_k: 1.5}", "rollout.sampling.top_k: must be an int >= 0 (or -1: off), got 1.5"),
    ("{repetition_penalty: 3}", "rollout.sampling.repetition_penalty: must be in (0, 2], got 3"),
    ("{n: 4}", "rollout.sampling.n: must not be set here: it comes from advantage.group_size, "
               "got 4"),
    ("{temperature: 0}", "rollout.sampling.temperature: must not be set here: it comes from "
                         "rollout.temperature, got 0"),
    ("{topk: 4}", "rollout.sampling: unknown key(s) ['topk']; did you mean 'top_k'?"),
    ("{json_schema: x}", "rollout.sampling.json_schema: not supported by this server"),
    ("5", "rollout.sampling: must be a mapping, got 5"),
    ("{stop: 5}", "rollout.sampling.stop: must be a non-empty string or a list of them, got 5"),
    ("{stop_token_ids: [a]}", "rollout.sampling.stop_token_ids: must be a list of token ids "
                              "(ints >= 0), got ['a']"),
])
def test_a_bad_sampling_parameter_is_refused_before_launch(value, message):
    with pytest.raises(ConfigError) as info:
        default_config("grpo", [f"rollout.sampling={value}"])
    assert str(info.value).startswith(message), str(info.value)



def test_a_decode_cache_shorter_than_the_longest_row_is_refused():
    """--decode-max-len in rollout.server_args must hold the longest row the data allows, or
    the server would refuse the run's long answers one request at a time."""
    data = ["model.path=/m", "data.train_files=[/d.jsonl]", "warmup.steps=0",
            "data.max_prompt_tokens=700", "data.max_response_tokens=300"]
    with pytest.raises(ConfigError, match=r"^rollout.server_args: --decode-max-len must be >= "
                                          r"data.max_prompt_tokens \+ data.max_response_tokens "
                                          r"= 700 \+ 300 = 1000 tokens .*, got 999$"):
        default_config("grpo", [*data, "rollout.server_args=[--decode-max-len=999]"])
    assert _server(*data, "rollout.server_args=[--decode-max-len, 1000]").decode_max_len == 1000


def test_a_negative_initial_weight_version_is_refused_by_the_server_command(capsys):
    """-1 marks tokens no weights sampled (fsdpfn.rollout.episode): a server started at it
    labelled its tokens as not sampled; the update requests refuse negative versions too."""
    from fsdpfn.rollout.args import parser

    assert parser().parse_args(["--model", "m", "--port", "1", "--weight-version", "3"]) \
        .weight_version == 3
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["--model", "m", "--port", "1", "--weight-version", "-1"])
    assert info.value.code == 2
    assert "argument --weight-version: must be an int >= 0, got '-1'" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,rule", [
    ("--port", "99999", "must be an int in [0, 65535]"),
    ("--port", "-1", "must be an int in [0, 65535]"),
    ("--channel-port", "70000", "must be an int in [0, 65535]"),
    ("--decode-rows", "0", "must be an int >= 1"),
    ("--decode-max-len", "1", "must be an int >= 2"),
    ("--max-pause-s", "nan", "must be a finite number of seconds > 0"),
    ("--max-pause-s", "0", "must be a finite number of seconds > 0"),
    ("--wait-for-model", "-3", "must be a finite number of seconds >= 0"),
    ("--parent-pid", "0", "must be an int >= 1"),
])
def test_the_servers_numbers_are_checked_by_its_command_line(capsys, flag, value, rule):
    """A port past 65535 was an OverflowError from bind(); negative decode rows, a NaN pause and
    the rest started a server that failed later (or never): each is now argparse's one line,
    and rollout.server_args meets the same rule before launch."""
    args = ["--model", "m", "--port", "0"] + ([flag, value] if flag != "--port" else [])
    with pytest.raises(SystemExit):
        parse_args(args if flag != "--port" else ["--model", "m", flag, value])
    assert f"argument {flag}: {rule}, got '{value}'" in capsys.readouterr().err
    if flag in ("--decode-rows", "--decode-max-len", "--max-pause-s"):  # the rest: the
        # launcher's own flags, refused in server_args by name before their values are read
        with pytest.raises(ConfigError, match=rf"argument {flag}: {rule}, got '{value}'"):
            default_config("grpo", [f"rollout.server_args=[{flag}, '{value}']"])


@pytest.mark.parametrize("value", ["tpu", "cuda:x", "gpu", "cuda:", "CPU"])
def test_a_device_not_of_the_form_cpu_cuda_cuda_n_is_one_line(capsys, value):
    """--device tpu was torch's RuntimeError traceback once the server had imported it."""
    with pytest.raises(SystemExit) as info:
        parse_args(["--model", "m", "--port", "0", "--device", value])
    assert info.value.code == 2
    assert f"argument --device: must be cpu, cuda or cuda:N, got '{value}'" in \
        capsys.readouterr().err
    assert parse_args(["--model", "m", "--port", "0", "--device", "cuda:1"]).device == "cuda:1"


@pytest.mark.parametrize("flag,value", [("--dtype", "bogus"), ("--dtype", "bf16"),
                                        ("--log-level", "loud")])
def test_a_dtype_or_log_level_the_server_lacks_is_one_line(capsys, flag, value):
    """--dtype bogus was a ValueError traceback after the imports, --log-level loud uvicorn's
    KeyError after the model had loaded."""
    with pytest.raises(SystemExit) as info:
        parse_args(["--model", "m", "--port", "0", flag, value])
    assert info.value.code == 2
    assert f"argument {flag}: invalid choice: '{value}' (choose from " in capsys.readouterr().err
    ok = parse_args(["--model", "m", "--port", "0", "--dtype", "bfloat16", "--log-level", "INFO"])
    assert (ok.dtype, ok.log_level) == ("bfloat16", "info")


def test_a_gpu_the_host_lacks_is_one_line_before_the_model_loads(capsys, tmp_path):
    """--device cuda on a host without one was torch's 'not compiled with CUDA' AssertionError
    traceback; a cuda:N past the host's GPUs failed in the model's move."""
    import types

    from fsdpfn.rollout.__main__ import main
    from fsdpfn.rollout.args import _device_problem

    def host(n):
        return types.SimpleNamespace(cuda=types.SimpleNamespace(
            is_available=lambda: n > 0, device_count=lambda: n))

    assert _device_problem("cpu", host(0)) is None
    assert _device_problem("cuda", host(1)) is None and _device_problem("cuda:1", host(2)) is None
    assert _device_problem("cuda", host(0)) == ("needs a GPU and this host has none "
                                                "(torch.cuda.is_available() is False), got 'cuda'")
    assert _device_problem("cuda:2", host(2)) == ("this host has 2 GPU(s) (cuda:0 to cuda:1), "
                                                  "got 'cuda:2'")
    import torch
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(SystemExit) as info:  # the model is never looked at
        main(["--model", str(tmp_path / "absent"), "--port", "0", "--device", f"cuda:{n}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and err[0].startswith(
        "python -m fsdpfn.rollout: error: argument --device: ") and f"cuda:{n}" in err[0], err


@pytest.mark.timeout(120)
def test_a_port_in_use_is_one_line_and_port_0_prints_the_port_it_took(tmp_path):
    """The server listens before it loads the model: a port in use ends it at once with one line
    naming host, port and why; with --port 0 the line it prints carries the port it took (it
    printed ':0'), and that address answers."""
    import re
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from fsdpfn.testing import write_tiny_hf_dir

    model = write_tiny_hf_dir(tmp_path / "m", texts=["What is 1+1? 2"] * 4)
    cmd = [sys.executable, "-m", "fsdpfn.rollout", "--model", str(model), "--device", "cpu",
           "--no-channel", "--port"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(cmd + [str(port)], capture_output=True, text=True, timeout=100)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        f"fsdpfn.rollout: --host 127.0.0.1 --port {port}: cannot listen there (Address already "
        f"in use)"), done.stderr[-500:]
    proc = subprocess.Popen(cmd + ["0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        line = next(x for x in proc.stdout if x.startswith("fsdpfn.rollout: serving"))
        url = re.search(r" on (http://127\.0\.0\.1:(\d+)) ", line)
        assert url and int(url.group(2)) > 0, line
        for _ in range(100):
            try:
                assert urllib.request.urlopen(url.group(1) + "/health", timeout=2).status == 200
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError(f"{url.group(1)} never answered /health")
    finally:
        proc.terminate()
        proc.wait(30)



@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype="fp16"), "argument --dtype: invalid choice: 'fp16'"),
    (dict(device="tpu"), "argument --device: must be cpu, cuda or cuda:N, got 'tpu'"),
    (dict(weight_version=-1), "argument --weight-version: must be an int >= 0, got '-1'"),
    (dict(port=70000), "argument --port: must be an int in [0, 65535], got '70000'"),
    (dict(extra_args=("--decode-rows", "0")), "argument --decode-rows: must be an int >= 1"),
    (dict(extra_args=("--bogus",)), "unrecognized arguments: --bogus"),
])
def test_launch_server_refuses_what_the_servers_command_line_would(kwargs, message, tmp_path,
                                                                   monkeypatch):
    """Before, the server started, printed its usage and exited, and launch_server raised a
    RuntimeError holding the twenty lines of usage; now it is one ConfigError line and no
    process starts."""
    import subprocess

    from fsdpfn.rollout import launch_server

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(ConfigError) as info:
        launch_server(tmp_path, log_dir=tmp_path / "logs", **kwargs)
    assert str(info.value).startswith("launch_server: the server's command line refuses ")
    assert message in str(info.value) and "\n" not in str(info.value)
    assert started == [] and not (tmp_path / "logs").exists()


@pytest.mark.timeout(120)
def test_a_model_the_decode_loop_refuses_is_one_line_naming_its_family(tmp_path, capsys):
    """--decode loop on a model with sliding windows ended the server with a traceback; the
    refusal is now the one line of every startup error, naming the model_type and what serves
    it instead."""
    from fsdpfn.rollout.__main__ import main
    from fsdpfn.testing.models import save_family_model, tiny_family_configs

    model = save_family_model(tmp_path / "mistral", tiny_family_configs()["mistral"])
    with pytest.raises(SystemExit) as info:
        main(["--model", str(model), "--port", "0", "--device", "cpu", "--decode", "loop",
              "--no-channel"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the weights' loading bar, if any
    assert info.value.code == 2 and "Traceback" not in err, err
    assert last.startswith("python -m fsdpfn.rollout: error: decode: 'loop' cannot serve this "
                           "model (mistral): ") and "'auto' or 'hf' serves it" in last, err
