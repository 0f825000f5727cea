"""fsdpfn's packed /generate answer (fsdpfn/rollout/packing.py): through JSON and back it is the
plain answer, float for float; a malformed one is refused by name; a real server answers it and
fsdpfn.rollout.generate reads it into the plain answer."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn.rollout import packing


def _f32(x: float) -> float:
    """x rounded to float32, as the server's log-probs are."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


_output = st.integers(0, 40).flatmap(lambda n: st.fixed_dictionaries({
    "prompt_index": st.integers(0, 5),
    "output_ids": st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n),
    "output_logprobs": st.lists(st.floats(-2.0**100, 0.0, width=32), min_size=n, max_size=n),
    "finish_reason": st.sampled_from(["stop", "length"]),
    # versions only ever rise within an output (swaps land between steps)
    "weight_versions": st.lists(st.integers(0, 3), min_size=n, max_size=n).map(sorted),
}, optional={"matched": st.integers(0, 100)}))


@settings(max_examples=60, deadline=None)
@given(st.lists(_output, min_size=1, max_size=6), st.integers(0, 9))
def test_packed_answer_through_json_is_the_plain_answer(outputs, version):
    answer = {"weight_version": version, "outputs": outputs}
    wire = json.loads(json.dumps(packing.pack(answer)))
    assert packing.unpack(wire) == json.loads(json.dumps(answer))
    for o, got in zip(outputs, packing.unpack(wire)["outputs"]):
        assert all(_f32(x) == x for x in got["output_logprobs"])  # float32 values, exactly


@settings(max_examples=40, deadline=None)
@given(st.lists(_output, min_size=1, max_size=6), st.integers(0, 9))
def test_packing_the_decode_loops_tensors_equals_packing_lists(outputs, version):
    """The decode loop hands its rows to pack as CPU tensors (int64 ids, float32 log-probs,
    RolloutEngine.generate(..., lists=False)): the same packed answer as from lists."""
    import torch

    rows = [{**o, "output_ids": torch.tensor(o["output_ids"], dtype=torch.long),
             "output_logprobs": torch.tensor(o["output_logprobs"], dtype=torch.float32)}
            for o in outputs]
    want = packing.pack({"weight_version": version, "outputs": outputs})
    assert packing.pack({"weight_version": version, "outputs": rows}) == want
    # views into one [rows, width] buffer, as the loop reads them
    width = max(len(o["output_ids"]) for o in outputs)
    ids = torch.zeros(len(outputs), width + 3, dtype=torch.long)
    for i, o in enumerate(outputs):
        ids[i, :len(o["output_ids"])] = torch.tensor(o["output_ids"], dtype=torch.long)
    views = [{**r, "output_ids": ids[i, :len(o["output_ids"])]}
             for i, (r, o) in enumerate(zip(rows, outputs))]
    assert packing.pack({"weight_version": version, "outputs": views}) == want


def test_packed_answer_is_smaller_and_keeps_special_floats():
    rows = [{"prompt_index": i // 8, "output_ids": list(range(1000, 2024)),
             "output_logprobs": [_f32(-1.0 / (j + 3)) for j in range(1024)],
             "finish_reason": "length", "weight_versions": [7] * 1024} for i in range(64)]
    plain = json.dumps({"weight_version": 7, "outputs": rows})
    packed = json.dumps(packing.pack({"weight_version": 7, "outputs": rows}))
    assert len(packed) < 0.5 * len(plain)
    special = {"weight_version": 0, "outputs": [{
        "prompt_index": 0, "output_ids": [1, 2, 3], "finish_reason": "stop",
        "output_logprobs": [-0.0, _f32(-1e-40), float("-inf")], "weight_versions": [0, 0, 1]}]}
    got = packing.unpack(json.loads(json.dumps(packing.pack(special))))["outputs"][0]
    assert got["output_logprobs"][1] == _f32(-1e-40) and got["output_logprobs"][2] == -float("inf")
    assert str(got["output_logprobs"][0]) == "-0.0" and got["weight_versions"] == [0, 0, 1]


def test_a_malformed_packed_answer_is_refused_by_name():
    good = packing.pack({"weight_version": 0, "outputs": [{
        "prompt_index": 0, "output_ids": [5, 6], "output_logprobs": [-1.0, -2.0],
        "finish_reason": "length", "weight_versions": [0, 0]}]})
    short = {**good, "outputs": [{**good["outputs"][0], "length": 3}]}
    with pytest.raises(ValueError, match="2 ids and 2 log-probs for outputs of 3 tokens"):
        packing.unpack(short)
    versions = {**good, "outputs": [{**good["outputs"][0], "weight_versions": [[0, 5]]}]}
    with pytest.raises(ValueError, match="5 weight versions for an output of 2 tokens"):
        packing.unpack(versions)
    two = packing.pack({"weight_version": 0, "outputs": [
        {"prompt_index": 0, "output_ids": ids, "output_logprobs": [-1.0] * len(ids),
         "finish_reason": "length", "weight_versions": [0] * len(ids)}
        for ids in ([5, 6], [7])]})
    negative = {**two, "outputs": [{**two["outputs"][0], "length": 4},
                                   {**two["outputs"][1], "length": -1}]}  # the total still 3
    with pytest.raises(ValueError, match="length must be >= 0, got -1"):
        packing.unpack(negative)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("decode", ["hf", "loop"])
def test_a_real_server_answers_packed_and_generate_reads_it(tmp_path, decode):
    """The server process answers "fsdpfn_packed" with bytes, "fsdpfn" with lists, the same
    tokens for the same seed; fsdpfn.rollout.generate returns the plain answer from the packed
    one. With HF generate and with the decode loop (whose rows are packed from its tensors)."""
    from fsdpfn.rollout import generate, launch_server
    from fsdpfn.testing import save_tiny_model, tiny_qwen2_config
    from fsdpfn.wire.http import call

    path = save_tiny_model(tmp_path / "tiny", tiny_qwen2_config(), seed=0)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    body = {"input_ids": prompts, "return_logprob": True, "sampling_params": {
        "n": 3, "max_new_tokens": 9, "temperature": 1.0, "sampling_seed": 5}}
    with launch_server(path, device="cpu", threads=1, extra_args=("--decode", decode)) as server:
        plain = call(server.url, "/generate", {**body, "return_format": "fsdpfn"}, timeout=60)
        packed = call(server.url, "/generate", {**body, "return_format": "fsdpfn_packed"},
                      timeout=60)
        got = generate(server.url, prompts, n=3, max_new_tokens=9, temperature=1.0, seed=5,
                       timeout=60)
    assert isinstance(packed["output_logprobs"], str) and "output_ids" not in packed["outputs"][0]
    assert packing.unpack(packed) == plain
    assert got == plain and len(got["outputs"]) == 6
    assert all(len(o["output_logprobs"]) == len(o["output_ids"]) == len(o["weight_versions"])
               for o in got["outputs"])
