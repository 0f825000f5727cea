"""Every field of the server's endpoints, given a value of the wrong kind or out of range
(null, negatives, 10**30, floats where ints are meant, strings, bools, lists, objects, nested
lists, a 20,000-character string, NaN and Infinity as Python's JSON writes them), is answered
200 or a 4xx naming the field within seconds: never a 500, a hang or a dropped connection, and
the server still generates afterwards. Found by this sweep: a scalar input_ids, a lora_path
object, an int temperature past int64, a non-string model (echoed into an answer JSON cannot
hold), paths past the file system's name length, and loose /init_weights_update_group fields
(1.5 read as port 1, null as the host "None") that held the update lock for the 300 s
rendezvous.

A real server process (python -m fsdpfn.rollout) on a tiny model directory.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from fsdpfn.rollout import launch_server
from fsdpfn.testing import write_tiny_hf_dir

TEXTS = ["What is 2+3? The answer is 5.", "Paris is the capital of France."] * 16
USER = [{"role": "user", "content": "What is 2+3?"}]
HOSTILE = {"null": None, "-1": -1, "0": 0, "1e30": 10**30, "1.5": 1.5, "str": "x", "empty": "",
           "true": True, "[]": [], "[1]": [1], "{}": {}, "{a:1}": {"a": 1}, "nested": [[[[1]]]],
           "long": "x" * 20_000, "[-1]": [-1], "[null]": [None], "NaN": "NaN",
           "Infinity": "Infinity"}
RAW = ("NaN", "Infinity")  # written bare, as json.dumps(float("nan")) does
SAMPLING = ["temperature", "top_p", "top_k", "min_p", "max_new_tokens", "min_new_tokens",
            "stop_token_ids", "stop", "ignore_eos", "n", "seed", "sampling_seed",
            "frequency_penalty", "presence_penalty", "repetition_penalty", "no_stop_trim",
            "skip_special_tokens"]
ENDPOINTS = {
    "/generate": ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
                  ["text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "rid", "stream", "lora_path", "return_text_in_logprobs",
                   "return_format", *(f"sampling_params.{k}" for k in SAMPLING)]),
    "/v1/completions": ({"prompt": "hi", "max_tokens": 2},
                        ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream",
                         "logprobs", "echo", "stop", "seed", "presence_penalty",
                         "frequency_penalty", "best_of", "logit_bias", "user", "suffix",
                         "stream_options", "top_k", "min_p", "stop_token_ids", "ignore_eos",
                         "min_tokens", "repetition_penalty", "skip_special_tokens", "rid"]),
    "/v1/chat/completions": ({"messages": USER, "max_tokens": 2},
                             ["messages", "model", "max_tokens", "max_completion_tokens",
                              "temperature", "top_p", "n", "stream", "logprobs", "top_logprobs",
                              "stop", "seed", "tools", "tool_choice", "parallel_tool_calls",
                              "response_format", "stream_options", "functions", "metadata",
                              "min_tokens", "rid", "logit_bias"]),
    "/forward": ({"input_ids": [[1, 2, 3]]}, ["input_ids", "temperature", "return_logits"]),
    "/abort_request": ({}, ["rid", "abort_all"]),
    "/unload_lora_adapter": ({"lora_name": "a"}, ["lora_name"]),
    "/pause_generation": ({}, ["mode"]),
}
# fields the rendezvous reads: values of a wrong kind only (a well-formed request to an absent
# trainer waits for it, by design)
GROUP = {"master_address": [None, -1, 1.5, True, [], {}, "", "  "],
         "master_port": [None, "x", "29500", 1.5, True, -1, 0, 70_000, [], {}],
         "rank_offset": [None, "1", 1.5, True, -1, [], 2, 3],
         "world_size": [None, "2", 2.5, True, 1, 0, [], {}],
         "group_name": ["", 1, [], {}, True],
         "backend": ["x", 1, [], True],
         "timeout_s": ["x", -1, 0, True, [], "NaN", "Infinity"]}
GROUP_BASE = {"master_address": "127.0.0.1", "master_port": 29_500, "rank_offset": 1,
              "world_size": 2, "group_name": "g", "backend": "gloo"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = write_tiny_hf_dir(tmp_path_factory.mktemp("m") / "tiny", texts=TEXTS, seed=5)
    with launch_server(model_dir, dtype="float32", extra_args=("--no-channel",)) as srv:
        yield srv


def _post(url: str, body: dict, field: str, value) -> tuple[int, str, float]:
    data = json.dumps(_with(body, field, "@@RAW@@" if value in RAW else value))
    data = data.replace('"@@RAW@@"', str(value)).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    start = time.perf_counter()
    try:
        with opener.open(req, timeout=30) as resp:
            return resp.status, resp.read().decode(), time.perf_counter() - start
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), time.perf_counter() - start


def _with(body: dict, field: str, value) -> dict:
    body = json.loads(json.dumps(body))
    head, _, leaf = field.rpartition(".")
    (body[head] if head else body)[leaf] = value
    return body


def _check(server, path: str, body: dict, field: str, shown: str, value) -> str | None:
    status, text, seconds = _post(server.url + path, body, field, value)
    if status not in (200, 400, 404, 409) or seconds > 10:
        return f"{path} {field}={shown}: {status} in {seconds:.1f}s: {text[:200]}"
    leaf = field.rpartition(".")[2]
    if status == 400 and leaf not in text and field.partition(".")[0] not in text:
        return f"{path} {field}={shown}: a 400 that names no field: {text[:200]}"
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_every_field_of_a_wrong_kind_is_a_4xx_naming_it_never_a_500(server, path):
    body, fields = ENDPOINTS[path]
    problems = [p for field in fields for shown, value in HOSTILE.items()
                if (p := _check(server, path, body, field, shown, value))]
    if path == "/pause_generation":
        _post(server.url + "/continue_generation", {}, "x", None)
    assert not problems, "\n".join(problems[:20])
    # the server still generates: two tokens, EOS ignored (a sampled EOS would end it at one)
    status, text, _ = _post(server.url + "/generate", ENDPOINTS["/generate"][0],
                            "sampling_params.ignore_eos", True)
    assert status == 200 and json.loads(text)["meta_info"]["completion_tokens"] == 2, text


@pytest.mark.timeout(120)
def test_a_weights_group_request_of_a_wrong_kind_is_refused_at_once_naming_the_field(server):
    """Each would have waited in the rendezvous (holding the update lock) for 300 s: the port
    1.5 read as 1, a null host as the name "None", "NaN" seconds as no bound."""
    problems = []
    for field, values in GROUP.items():
        for value in values:
            status, text, seconds = _post(server.url + "/init_weights_update_group",
                                          GROUP_BASE, field, value)
            if status != 400 or field not in text or seconds > 5:
                problems.append(f"{field}={value!r}: {status} in {seconds:.1f}s: {text[:160]}")
    assert not problems, "\n".join(problems)
