"""SGLang's /abort_request and /flush_cache on the built-in server: an aborted output ends where it
is with finish_reason "abort", whichever stage it is in (waiting for a pause, queued for a slot,
decoding in the loop or in HF generate), its log-probs still those of a float64 teacher-forced
forward of the same weights; the requests it does not name run on untouched (a seeded one draws
exactly what it draws alone). /flush_cache answers as SGLang's: 200 when idle, 400 while
generation runs or waits.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fsdpfn.rollout import RolloutEngine, SamplingParams, sglang_api
from fsdpfn.rollout.client import from_sglang
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config

LOGP_ATOL = 1e-5  # float32 engine against a float64 reference (see tests/unit/test_rollout.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m") / "tiny", tiny_qwen2_config(), seed=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()


def _engine(path, decode="loop", rows=8, max_len=200):
    return RolloutEngine(str(path), dtype="float32", device="cpu", max_pause_s=30,
                         decode=decode, decode_rows=rows, decode_max_len=max_len)


def _assert_exact(reference, prompt, output):
    """The output's log-probs equal the float64 forward of prompt + its tokens."""
    ids = list(output["output_ids"])
    assert len(output["output_logprobs"]) == len(ids)
    if not ids:
        return
    with torch.no_grad():
        row = torch.tensor([prompt + ids])
        logp = torch.log_softmax(reference(input_ids=row).logits[0], -1)
    want = logp[len(prompt) - 1:-1].gather(-1, row[0, len(prompt):, None])[:, 0]
    torch.testing.assert_close(torch.tensor(list(output["output_logprobs"]),
                                            dtype=torch.float64), want, atol=LOGP_ATOL, rtol=0)


def _wait(condition, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.001)


def _abort_at_forward(engine, forward: int, rid: str):
    """A forward hook on the engine's model that aborts ``rid`` during its ``forward``-th call
    (HF generate: the call that gives each row its ``forward``-th token); ``.remove()`` it."""
    forwards = []

    def count(*_):
        forwards.append(1)
        if len(forwards) == forward:
            assert engine.abort(rid) == 1

    return engine.model.register_forward_hook(count)


def _start(engine, prompts, sp, rid, out, key):
    thread = threading.Thread(target=lambda: out.__setitem__(key, engine.generate(
        prompts, sp, rid=rid)), daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
def test_abort_ends_a_decoding_request_where_it_is_and_leaves_the_others(model_dir, reference):
    engine = _engine(model_dir)
    decoder = engine._decoder  # noqa: SLF001
    decoder.sync_every = 2
    seeded = SamplingParams(temperature=1.0, max_new_tokens=180, seed=7)
    alone = engine.generate([[4, 5, 6]], seeded)["outputs"][0]["output_ids"]
    decoder.steps = 0
    out: dict = {}
    with engine._model_lock:  # noqa: SLF001 - both requests queued before the first step
        a = _start(engine, [[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=180,
                                                       n=2), "a", out, "a")
        b = _start(engine, [[4, 5, 6]], seeded, "b", out, "b")
        _wait(lambda: len(decoder.pending) == 2)
    _wait(lambda: decoder.steps >= 4)
    assert engine.abort("a") == 2
    assert engine.abort("a") == 0  # marked once
    a.join(60), b.join(60)
    for o in out["a"]["outputs"]:
        assert o["finish_reason"] == "abort" and 4 <= len(o["output_ids"]) < 180
        _assert_exact(reference, [1, 2, 3], o)
    (kept,) = out["b"]["outputs"]
    assert kept["finish_reason"] == "length" and kept["output_ids"] == alone
    _assert_exact(reference, [4, 5, 6], kept)
    assert decoder.table == [None] * 8 and not engine.busy()


@pytest.mark.timeout(120)
def test_abort_answers_queued_rows_with_no_tokens_and_the_loop_serves_on(model_dir, reference):
    engine = _engine(model_dir, rows=2)  # 2 slots: 3 of the 5 rows wait in the queue
    decoder = engine._decoder  # noqa: SLF001
    decoder.sync_every = 2
    out: dict = {}
    thread = _start(engine, [[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=180,
                                                        n=5), "q", out, "q")
    _wait(lambda: decoder.steps >= 2)
    assert engine.abort(abort_all=True) == 5
    thread.join(60)
    outputs = out["q"]["outputs"]
    assert [o["finish_reason"] for o in outputs] == ["abort"] * 5
    assert [len(o["output_ids"]) > 0 for o in outputs] == [True, True, False, False, False]
    for o in outputs:
        _assert_exact(reference, [1, 2, 3], o)
    assert decoder.table == [None, None] and decoder.pending == []
    greedy = engine.generate([[7, 8]], SamplingParams(temperature=0, max_new_tokens=20))
    want = _engine(model_dir, decode="hf").generate(
        [[7, 8]], SamplingParams(temperature=0, max_new_tokens=20))
    assert greedy["outputs"][0]["output_ids"] == want["outputs"][0]["output_ids"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("decode", ["loop", "hf"])
def test_abort_of_a_request_held_by_a_pause_answers_it_at_once(model_dir, decode):
    engine = _engine(model_dir, decode=decode)
    engine.pause()
    out: dict = {}
    thread = _start(engine, [[1, 2], [3]], SamplingParams(max_new_tokens=8, n=2), "p", out, "p")
    _wait(engine.busy)
    assert engine.abort("other") == 0
    assert engine.abort("p") == 4
    thread.join(10)
    assert not thread.is_alive(), "an aborted request still waited for the pause"
    assert [(o["prompt_index"], list(o["output_ids"]), o["finish_reason"])
            for o in out["p"]["outputs"]] == [(0, [], "abort"), (0, [], "abort"),
                                              (1, [], "abort"), (1, [], "abort")]
    short = engine.generate  # a rid list shorter than the outputs: abort_all still reaches all
    rest: dict = {}
    other = threading.Thread(target=lambda: rest.update(out=short(
        [[5]], SamplingParams(max_new_tokens=4, n=3), rid=["only"])), daemon=True)
    other.start()
    _wait(lambda: len(engine._tickets) == 1)  # noqa: SLF001
    assert engine.abort(abort_all=True) == 3
    other.join(10)
    assert [o["finish_reason"] for o in rest["out"]["outputs"]] == ["abort"] * 3
    done = threading.Event()  # the pause itself still holds new requests
    threading.Thread(target=lambda: (engine.generate([[1]], SamplingParams(max_new_tokens=2)),
                                     done.set()), daemon=True).start()
    assert not done.wait(0.3)
    engine.resume()
    assert done.wait(30)


@pytest.mark.timeout(60)
def test_hf_generate_stops_an_aborted_row_at_its_step_in_sglangs_shape(model_dir, reference):
    """HF generate: output "y" aborted before its first token has none; output "x", aborted
    during the model's 5th forward (the one that gives its 5th token), has 5 tokens; both
    answer SGLang's finish_reason {"type": "abort"} under their rids."""
    engine = _engine(model_dir, decode="hf")
    handle = _abort_at_forward(engine, 5, "x")
    payload = {"input_ids": [[1, 2, 3], [4, 5]], "rid": ["x", "y"], "return_logprob": True,
               "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    out: dict = {}
    try:
        with engine._model_lock:  # noqa: SLF001 - "y" is aborted before generate starts
            thread = threading.Thread(target=lambda: out.update(
                answer=sglang_api.generate(engine, payload)), daemon=True)
            thread.start()
            _wait(engine.busy)
            assert engine.abort("y") == 1
        thread.join(30)
    finally:
        handle.remove()
    x, y = out["answer"]
    assert x["meta_info"]["id"] == "x" and y["meta_info"]["id"] == "y"
    assert x["meta_info"]["finish_reason"]["type"] == "abort"
    assert y["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(x["output_ids"]) == 5 and y["output_ids"] == []
    assert x["meta_info"]["completion_tokens"] == 5
    _assert_exact(reference, [1, 2, 3], {
        "output_ids": x["output_ids"],
        "output_logprobs": [t[0] for t in x["meta_info"]["output_token_logprobs"]]})
    parsed = from_sglang(out["answer"], 1)["outputs"]  # the client keeps the reason
    assert [o["finish_reason"] for o in parsed] == ["abort", "abort"]


@pytest.mark.timeout(180)
def test_the_server_serves_abort_request_and_flush_cache_as_sglang(model_dir, reference):
    import requests

    from fsdpfn.rollout import launch_server

    with launch_server(model_dir, dtype="float32", extra_args=("--no-channel",)) as srv:
        flushed = requests.get(srv.url + "/flush_cache", timeout=30)
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
        for body, field in (({"rid": 5}, "rid"), ({"abort_all": "yes"}, "abort_all")):
            refused = requests.post(srv.url + "/abort_request", json=body, timeout=30)
            assert refused.status_code == 400 and refused.json()["message"].startswith(field)
        out: dict = {}
        thread = threading.Thread(target=lambda: out.update(answer=requests.post(
            srv.url + "/generate", timeout=120, json={
                "input_ids": [1, 2, 3], "rid": "long", "return_logprob": True,
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}).json()),
            daemon=True)
        thread.start()
        _wait(lambda: requests.post(srv.url + "/flush_cache", timeout=30).status_code == 400)
        time.sleep(0.2)
        aborted = requests.post(srv.url + "/abort_request", json={"rid": "long"}, timeout=30)
        assert aborted.status_code == 200 and aborted.json()["aborted"] == 1
        thread.join(60)
        meta = out["answer"]["meta_info"]
        assert meta["id"] == "long" and meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] < 500
        _assert_exact(reference, [1, 2, 3], {
            "output_ids": out["answer"]["output_ids"],
            "output_logprobs": [t[0] for t in meta["output_token_logprobs"]]})
        assert requests.post(srv.url + "/flush_cache", timeout=30).status_code == 200
        # fsdpfn's client names its request too, and reads the reason from the packed answer
        from fsdpfn.errors import ConfigError
        from fsdpfn.rollout import generate

        mine: dict = {}
        thread = threading.Thread(target=lambda: mine.update(answer=generate(
            srv.url, [[4, 5]], n=2, max_new_tokens=500, ignore_eos=True, rid="mine")),
            daemon=True)
        thread.start()
        _wait(lambda: requests.post(srv.url + "/flush_cache", timeout=30).status_code == 400)
        assert requests.post(srv.url + "/abort_request", json={"rid": "mine"},
                             timeout=30).json()["aborted"] == 2
        thread.join(60)
        for o in mine["answer"]["outputs"]:
            assert o["finish_reason"] == "abort" and len(o["output_ids"]) < 500
            _assert_exact(reference, [4, 5], o)
        with pytest.raises(ConfigError, match=r"^rid: must be a string or None, got 7$"):
            generate(srv.url, [[1]], rid=7)
        # an update's abort_all_requests (SGLang's field) ends what runs first, where it is;
        # without it the request would go on over the update to its 500 tokens
        late: dict = {}
        thread = threading.Thread(target=lambda: late.update(answer=requests.post(
            srv.url + "/generate", timeout=120, json={
                "input_ids": [1, 2, 3], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}).json()),
            daemon=True)
        thread.start()
        _wait(lambda: requests.post(srv.url + "/flush_cache", timeout=30).status_code == 400)
        refused = requests.post(srv.url + "/update_weights_from_disk", json={
            "model_path": str(model_dir), "abort_all_requests": "yes"}, timeout=60)
        assert refused.status_code == 400 and refused.json()["message"].startswith(
            "abort_all_requests: must be a bool")
        assert requests.post(srv.url + "/flush_cache", timeout=30).status_code == 400
        updated = requests.post(srv.url + "/update_weights_from_disk", json={
            "model_path": str(model_dir), "abort_all_requests": True}, timeout=60)
        assert updated.status_code == 200 and updated.json()["success"] is True
        thread.join(60)
        meta = late["answer"]["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 500
        _assert_exact(reference, [1, 2, 3], {
            "output_ids": late["answer"]["output_ids"],
            "output_logprobs": [t[0] for t in meta["output_token_logprobs"]]})


@pytest.mark.timeout(60)
def test_openai_requests_carry_sglangs_rid_and_abort_by_it(model_dir, reference):
    from fsdpfn.rollout import UpdateError, openai_api

    engine = _engine(model_dir, decode="hf")
    handle = _abort_at_forward(engine, 4, "v")
    try:
        answer = openai_api.completions(engine, {"prompt": [1, 2, 3], "max_tokens": 40,
                                                 "ignore_eos": True, "rid": "v"})
    finally:
        handle.remove()
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) == 4
    _assert_exact(reference, [1, 2, 3], {"output_ids": choice["token_ids"],
                                         "output_logprobs": choice["token_logprobs"]})
    with pytest.raises(UpdateError, match=r"^rid: must be a string \(or a list of them, one per "
                                          r"choice\), got 5$"):
        openai_api.completions(engine, {"prompt": [1], "max_tokens": 2, "rid": 5})
