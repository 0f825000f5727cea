"""fsdpfn.rollout.RolloutEngine in one process (no HTTP, no trainer) and the weight-push formats.

References: a plain HF forward of the same model (float32) for log-probs; the tensors written or
broadcast for updates. Updates go over a real gloo group built from a TCPStore, with the sender
(member 0) in this thread and the engine (member 1) in a second one.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpfn as ff
from fsdpfn.rollout import RolloutEngine, SamplingParams, UpdateError
from fsdpfn.rollout.process import free_port
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config
from fsdpfn.weights.gather import plan_buckets
from fsdpfn.wire.protocol import (ALIGN, broadcast, bucket_layout, combine_checksums,
                                  combine_on_device, make_group, sha256_of, tensor_checksum,
                                  write_manifest)

# float32 everywhere. Generation runs the model step by step with a KV cache and left padding,
# the reference runs whole right-padded sequences: the same products summed in another order,
# a few ulps apart (~1e-7 relative) per op; 2 layers of 64-wide sums stay far below 1e-5.
LOGP_ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m") / "tiny", tiny_qwen2_config(), seed=0)


@pytest.fixture()
def engine(model_dir):
    return RolloutEngine(str(model_dir), dtype="float32", device="cpu", max_pause_s=30)


def _ref_logp(model, rows: list[list[int]], temperature: float) -> list[torch.Tensor]:
    """log softmax(logits / T) of each token given its prefix, one unpadded row at a time."""
    out = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row])
            logits = model(input_ids=ids).logits.double()[0]
            logp = torch.log_softmax(logits / temperature, -1)
            out.append(logp[:-1].gather(-1, ids[0, 1:, None])[:, 0])
    return out


# ---------------------------------------------------------------- generation


@pytest.mark.timeout(60)
@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.3, 1.0), (0.0, 1.0)])
def test_generation_logprobs_match_forward(engine, temperature, top_p):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    sp = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=7, n=2, seed=3)
    res = engine.generate(prompts, sp)
    assert res["weight_version"] == 0 and len(res["outputs"]) == 4
    rows = [prompts[o["prompt_index"]] + o["output_ids"] for o in res["outputs"]]
    refs = _ref_logp(engine.model, rows, temperature or 1.0)
    for o, ref in zip(res["outputs"], refs):
        n_prompt = len(prompts[o["prompt_index"]])
        assert [o["prompt_index"] for o in res["outputs"]] == [0, 0, 1, 1]
        got = torch.tensor(o["output_logprobs"], dtype=torch.float64)
        torch.testing.assert_close(got, ref[n_prompt - 1:], atol=LOGP_ATOL, rtol=0)
        if temperature == 0:  # greedy: every token is the argmax of its distribution
            with torch.no_grad():
                logits = engine.model(input_ids=torch.tensor([rows[0]])).logits[0]
            p0 = len(prompts[res["outputs"][0]["prompt_index"]])
            assert logits[p0 - 1:-1].argmax(-1).tolist() == res["outputs"][0]["output_ids"]


@pytest.mark.timeout(60)
def test_stop_tokens_seed_and_validation(engine):
    base = dict(temperature=1.0, max_new_tokens=12, n=3, seed=11)
    free = engine.generate([[5, 6]], SamplingParams(**base))["outputs"]
    assert engine.generate([[5, 6]], SamplingParams(**base))["outputs"] == free  # seeded
    stop = free[0]["output_ids"][2]
    out = engine.generate([[5, 6]], SamplingParams(**base, stop_token_ids=[stop]))["outputs"]
    for o in out:
        ids = o["output_ids"]
        if o["finish_reason"] == "stop":
            assert ids[-1] == stop and stop not in ids[:-1]
        else:
            assert len(ids) == 12 and stop not in ids
        assert len(o["output_logprobs"]) == len(ids)
    assert out[0]["finish_reason"] == "stop" and len(out[0]["output_ids"]) == 3
    with pytest.raises(UpdateError, match=r"input_ids\[0\]: must be .* in \[0, 128\), got"):
        engine.generate([[1, 128]], SamplingParams())
    with pytest.raises(UpdateError, match="sampling_params.top_p: must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(UpdateError, match="unknown keys"):
        SamplingParams(temprature=1.0)


@pytest.mark.timeout(120)
def test_hf_generate_stops_only_at_the_requests_stop_ids(model_dir, tmp_path):
    """HF generate stops at the request's stop ids and no others: a model whose
    generation_config names an eos it emits runs past it with ignore_eos (no stop ids), with no
    padding returned as tokens; with the eos among the stop ids it stops there."""
    import json
    import shutil

    first = RolloutEngine(str(model_dir), dtype="float32", device="cpu", decode="hf")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompts = [[5, 6, 7], [9]]
    free = [o["output_ids"] for o in first.generate(prompts, greedy)["outputs"]]
    eos = free[0][1]  # the second token the first row emits
    eos_dir = tmp_path / "eos"
    shutil.copytree(model_dir, eos_dir)
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    engine = RolloutEngine(str(eos_dir), dtype="float32", device="cpu", decode="hf")
    out = engine.generate(prompts, greedy)["outputs"]  # no stop ids: what ignore_eos sends
    assert [o["output_ids"] for o in out] == free
    assert all(o["finish_reason"] == "length" for o in out)
    out = engine.generate(prompts, greedy.with_stops([eos]))["outputs"]
    assert out[0]["output_ids"] == free[0][:2] and out[0]["finish_reason"] == "stop"


@pytest.mark.timeout(60)
def test_a_seeded_request_leaves_the_process_generator_as_it_was(engine):
    """A seed draws from a generator of its own: later unseeded requests are not fixed by it."""
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    engine.generate([[5, 6]], SamplingParams(temperature=1.0, max_new_tokens=4, seed=7))
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.timeout(60)
def test_prompts_and_lengths_within_the_models_context(engine):
    """A prompt must leave a position to generate in (UpdateError naming it); max_new_tokens is
    capped at what the longest prompt leaves, the outputs finishing by length."""
    context = engine.context
    with pytest.raises(UpdateError, match=rf"input_ids\[1\]: must be shorter than the model's "
                                          rf"context \(max_position_embeddings = {context}\), "
                                          rf"got {context} tokens"):
        engine.generate([[1, 2], [3] * context], SamplingParams(max_new_tokens=4))
    out = engine.generate([[3] * (context - 3), [4]],
                          SamplingParams(temperature=1.0, max_new_tokens=10, seed=1))["outputs"]
    assert [len(o["output_ids"]) for o in out] == [3, 3]
    assert all(o["finish_reason"] == "length" for o in out)


def test_sampling_params_refuse_a_wrong_type_by_the_key_sent():
    for value in ("abc", "3", [1], {}):
        with pytest.raises(UpdateError, match=r"sampling_params.max_new_tokens: must be an int "
                                              r">= 1, got"):
            SamplingParams(max_new_tokens=value, min_new_tokens=2)
    for value in (-1, 2 ** 63):
        with pytest.raises(UpdateError, match=r"sampling_params.sampling_seed: must be null or an "
                                              rf"int in \[0, 2\*\*63\), got {value}"):
            SamplingParams(sampling_seed=value)


@pytest.mark.timeout(60)
def test_pause_blocks_generation_until_continue_and_expires(engine):
    engine.pause()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (engine.generate([[1, 2]], SamplingParams(
        max_new_tokens=2)), done.set()), daemon=True)
    thread.start()
    assert not done.wait(0.5), "generation ran while paused"
    engine.resume()
    assert done.wait(20), "generation did not continue after resume"
    engine.max_pause_s = 0.3
    engine.pause()
    t0 = time.monotonic()
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))  # waits for the expiry
    assert 0.2 < time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_update_waits_for_generation_in_flight(engine, tmp_path):
    """pause -> wait for the request in flight (it finishes on the old weights) -> swap ->
    continue: the next request sees the new version."""
    from safetensors.torch import save_file

    new = _perturbed(engine, seed=2)
    (tmp_path / "v").mkdir()
    save_file(new, str(tmp_path / "v" / "model.safetensors"))
    result = {}
    thread = threading.Thread(target=lambda: result.update(engine.generate(
        [[1, 2, 3]], SamplingParams(max_new_tokens=48, seed=0))), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while engine._active == 0 and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.001)
    engine.pause()  # returns once the request in flight is done
    assert result["weight_version"] == 0 and len(result["outputs"][0]["output_ids"]) == 48
    assert engine.receiver.update_from_disk({"model_path": str(tmp_path / "v"),
                                             "weight_version": 1})["weight_version"] == 1
    engine.resume()
    assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))["weight_version"] == 1
    thread.join(5)


# ---------------------------------------------------------------- updates over a gloo group


class _Pair:
    """Member 0 (this thread) and the engine's receiver (member 1) in one gloo group."""

    def __init__(self, engine, name="g", timeout_s=20):
        port = free_port()
        answer = {}
        self.receiver = engine.receiver
        t = threading.Thread(target=lambda: answer.update(self.receiver.init_group({
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": name, "backend": "gloo", "timeout_s": timeout_s})))
        t.start()
        self.store, self.pg = make_group(master_address="127.0.0.1", master_port=port, rank=0,
                                         world_size=2, group_name=name, backend="gloo",
                                         timeout_s=20)
        t.join(30)
        assert answer.get("success"), answer
        self.engine, self.name = engine, name

    def _serve(self, fn, *args):
        """The receiver runs ``fn(*args)`` in a thread: (thread, {"ok": answer} or {"err": exc},
        an event set by ack())."""
        result, acked = {}, threading.Event()

        def serve():
            try:
                result["ok"] = fn(*args)
            except UpdateError as exc:
                result["err"] = exc
            acked.set()  # an answer without an acceptance: nothing is to be sent
        t = threading.Thread(target=serve)
        t.start()
        return t, result, acked

    def send(self, tensors: dict[str, torch.Tensor], *, packed=True, dtypes=None, **extra):
        """One SGLang request: its metadata to the receiver (a thread), then its bytes: ONE
        broadcast of the tensors flattened and concatenated (SGLang's flattened_bucket), or one
        broadcast per tensor."""
        names = list(tensors)
        dtypes = dtypes or [str(t.dtype).removeprefix("torch.") for t in tensors.values()]
        payload = {"names": names, "dtypes": dtypes,
                   "shapes": [list(t.shape) for t in tensors.values()], "group_name": self.name,
                   "load_format": "flattened_bucket" if packed else None, **extra}
        t, result, _ = self._serve(self.receiver.update_from_distributed, payload)
        if packed:
            broadcast(self.pg, torch.cat([t_.flatten() for t_ in tensors.values()])).wait()
        else:
            for t_ in tensors.values():
                broadcast(self.pg, t_.contiguous()).wait()
        t.join(30)
        return result

    def send_update(self, buckets: list[dict[str, torch.Tensor]], **extra):
        """A whole update ({buckets: [...]}): once accepted, one aligned flat broadcast per
        bucket, with garbage in the padding (the receiver must not count it)."""
        metas = [{"names": list(b), "dtypes": [str(t.dtype).removeprefix("torch.")
                                               for t in b.values()],
                  "shapes": [list(t.shape) for t in b.values()]} for b in buckets]
        accepted = threading.Event()
        message = {"buckets": metas, "group_name": self.name, **extra}
        t, result, answered = self._serve(lambda: self.receiver.update(
            message, ack=accepted.set))
        while not (accepted.is_set() or answered.is_set()):
            time.sleep(0.001)
        for bucket, meta in zip(buckets, metas) if accepted.is_set() else ():
            offsets, total = bucket_layout(meta["dtypes"], meta["shapes"])
            buf = torch.full((total,), 0xAB, dtype=torch.uint8)
            for o, t_ in zip(offsets, bucket.values()):
                buf[o:o + t_.numel() * t_.element_size()].view(t_.dtype).copy_(t_.flatten())
            broadcast(self.pg, buf).wait()
        t.join(30)
        result["accepted"] = accepted.is_set()
        return result


def _perturbed(engine, scale=0.01, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: (p.detach() + scale * torch.randn(p.shape, generator=g)).clone()
            for n, p in engine.params.items()}


@pytest.mark.timeout(90)
def test_sglang_request_is_checked_then_lands_at_once(engine):
    """SGLang's /update_weights_from_distributed: each request a self-contained update of the
    tensors it names, packed back to back (no padding) or one broadcast per tensor. A refused
    request still takes its bytes (the group stays in step) and changes nothing."""
    pair = _Pair(engine)
    before = {n: p.detach().clone() for n, p in engine.params.items()}
    new = _perturbed(engine)
    names = list(new)
    half = len(names) // 2

    bad = {n: new[n] for n in names[:half]}
    bad[names[0]] = torch.zeros(3, 5)
    r = pair.send(bad)
    assert r["err"].status == 400 and f"tensor {names[0]!r}: shape must equal" in str(r["err"])
    assert engine.version == 0 and engine.receiver.last_error
    r = pair.send({names[1]: new[names[1]].double(), "model.nope": torch.zeros(2)},
                  packed=False)
    assert "dtype must equal the served float32, got float64" in str(r["err"])
    assert "tensor 'model.nope': name must be a parameter" in str(r["err"])
    nan = {n: new[n].clone() for n in names[:half]}
    nan[names[2]].view(-1)[0] = float("nan")
    r = pair.send(nan, weight_version="rl-step-1")
    assert "must be finite" in str(r["err"]) and names[2] in str(r["err"])
    assert engine.version == 0 and engine.version_label() == "0"
    assert all(torch.equal(p, before[n]) for n, p in engine.params.items())

    # the group is still in step: the buckets of one labelled version land, request by request
    r = pair.send({n: new[n] for n in names[:half]}, weight_version="rl-step-1")
    assert r["ok"]["weight_version"] == 1 == engine.version
    assert engine.version_label() == "rl-step-1"
    assert all(torch.equal(engine.params[n], new[n]) for n in names[:half])
    assert all(torch.equal(engine.params[n], before[n]) for n in names[half:])
    r = pair.send({n: new[n] for n in names[half:]}, weight_version="rl-step-1")
    assert r["ok"]["weight_version"] == 1 == engine.version  # the same version, completed
    assert all(torch.equal(p, new[n]) for n, p in engine.params.items())
    assert engine.version_label(1) == "rl-step-1" and engine.receiver.last_error is None
    # one broadcast per tensor; a numeric string is the version itself; none: the version
    # stays (SGLang's rule: a push that fails half way labels no part with a version of its own)
    one = {names[3]: torch.full_like(new[names[3]], 0.5)}
    r = pair.send(one, packed=False, weight_version="8")
    assert r["ok"]["weight_version"] == 8 == engine.version and engine.version_label() == "8"
    assert bool((engine.params[names[3]] == 0.5).all())
    assert pair.send(one)["ok"]["weight_version"] == 8
    assert engine.info()["weight_version"] == "8" and engine.info()["version"] == 8
    # a label keeps its version only across requests of one push; a whole update moves it on
    r = pair.send(one, weight_version="rl-step-9")
    assert r["ok"]["weight_version"] == 9 and engine.version_label() == "rl-step-9"
    assert pair.send(one)["ok"]["weight_version"] == 9 and engine.version_label() == "rl-step-9"


@pytest.mark.timeout(60)
def test_an_unsized_dtype_drops_the_group(engine):
    pair = _Pair(engine, name="g-unsized")
    name = next(iter(engine.params))
    payload = {"names": [name], "dtypes": ["int4"], "shapes": [[2]], "group_name": pair.name}
    with pytest.raises(UpdateError, match=r"dtypes: .*group 'g-unsized' dropped"):
        engine.receiver.update_from_distributed(payload)
    assert "g-unsized" not in engine.info()["groups"]


@pytest.mark.timeout(60)
def test_update_from_disk_verifies_before_swapping(engine, tmp_path):
    from safetensors.torch import save_file

    new = _perturbed(engine, seed=1)

    def write(directory, tensors, version, corrupt=None):
        directory.mkdir()
        save_file(tensors, str(directory / "model.safetensors"))
        entries = {n: {"dtype": "float32", "shape": list(t.shape), "file": "model.safetensors",
                       "sha256": sha256_of(t)} for n, t in tensors.items()}
        if corrupt:
            entries[corrupt]["sha256"] = "0" * 64
        write_manifest(directory, version=version, entries=entries,
                       files=["model.safetensors"], weights_checksum=0)
        return str(directory)

    before = {n: p.detach().clone() for n, p in engine.params.items()}
    bad_sha = write(tmp_path / "a", new, 3, corrupt=next(iter(new)))
    with pytest.raises(UpdateError, match="sha256 must equal the manifest's"):
        engine.receiver.update_from_disk({"model_path": bad_sha})
    extra = write(tmp_path / "b", {**new, "model.extra": torch.zeros(2)}, 3)
    with pytest.raises(UpdateError, match="'model.extra': name must be a parameter"):
        engine.receiver.update_from_disk({"model_path": extra})
    good = write(tmp_path / "c", new, 3)
    with pytest.raises(UpdateError, match="weight_version: must equal the manifest's version 3"):
        engine.receiver.update_from_disk({"model_path": good, "weight_version": 4})
    with pytest.raises(UpdateError, match="model_path: must be a directory") as info:
        engine.receiver.update_from_disk({"model_path": str(tmp_path / "missing")})
    assert info.value.status == 404
    assert engine.version == 0
    assert all(torch.equal(p, before[n]) for n, p in engine.params.items())
    answer = engine.receiver.update_from_disk({"model_path": good})
    assert answer["weight_version"] == 3 == engine.version
    assert all(torch.equal(p, new[n]) for n, p in engine.params.items())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fields, named", [
    ({"dtypes": ["float32", "float32"]}, "names, dtypes, shapes: must have equal lengths"),
    ({"names": "abc"}, "names: must be a list of strings"),
    ({"shapes": [[2, True]]}, "shapes: must be a list of lists of ints"),
    ({"weight_version": -2}, "weight_version: must be >= 0"),
    ("busy", "update: another update is in progress"),
])
def test_a_request_refused_before_its_bytes_drops_the_group(engine, fields, named):
    """A request refused before its bytes are read (fields that cannot size them, or another
    update holding the turn) drops the group: the sender's bytes for it are never read as the
    next request's (they once were: the next request served the refused one's values)."""
    pair = _Pair(engine, name="g-early", timeout_s=1)
    name = next(iter(engine.params))
    payload = {"names": [name], "dtypes": ["float32"],
               "shapes": [list(engine.params[name].shape)], "group_name": pair.name}
    before = {n: p.detach().clone() for n, p in engine.params.items()}
    if fields == "busy":
        engine.receiver._turn.acquire()  # another update holds the turn
    try:
        with pytest.raises(UpdateError, match=named) as info:
            engine.receiver.update_from_distributed(
                payload if fields == "busy" else {**payload, **fields})
    finally:
        if fields == "busy":
            engine.receiver._turn.release()
    assert "group 'g-early' dropped" in str(info.value)
    assert "g-early" not in engine.info()["groups"] and engine.version == 0
    assert all(torch.equal(p, before[n]) for n, p in engine.params.items())


@pytest.mark.timeout(90)
def test_sglang_requests_keep_the_version_unless_named_and_carry_a_merged_push(engine):
    """SGLang's rule: a request without weight_version leaves the version alone (a push that
    fails half way labels nothing); a label names one push, whose requests share its version,
    while a whole update under the same label is another version. A LoRA trainer's merged
    weights sent in SGLang's requests refuse an adapter on top, as on the other transports."""
    pair = _Pair(engine, name="g-versions")
    new = _perturbed(engine, seed=4)
    names = list(new)
    assert pair.send({n: new[n] for n in names[:2]})["ok"]["weight_version"] == 0
    assert engine.version == 0 and engine.version_label() == "0"
    r = pair.send({n: new[n] for n in names[2:]}, weight_version="step-1", merged_adapters=True)
    assert r["ok"]["weight_version"] == 1 and engine.version_label() == "step-1"
    with pytest.raises(UpdateError, match="merged"):
        engine.receiver.load_lora_adapter({"lora_name": "a", "lora_path": "/nonexistent"})


def test_a_whole_update_under_the_served_label_is_a_new_version(engine, tmp_path):
    from safetensors.torch import save_file

    versions = []
    for seed in (1, 2):
        directory = tmp_path / f"d{seed}"
        directory.mkdir()
        save_file(_perturbed(engine, seed=seed), str(directory / "model.safetensors"))
        versions.append(engine.receiver.update_from_disk({
            "model_path": str(directory), "weight_version": "rl-step"})["weight_version"])
    assert versions == [1, 2] and engine.version_label(2) == "rl-step"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, named", [
    ("truncated", "fsdpfn_manifest.json: must be a JSON object"),
    ("no-version", "fsdpfn_manifest.json: must name the files' version"),
    ("no-path", "model_path: required"),
])
def test_disk_updates_name_a_bad_manifest_or_a_missing_path(engine, tmp_path, case, named):
    from safetensors.torch import save_file

    tmp_path.joinpath("model.safetensors").write_bytes(b"")
    save_file(_perturbed(engine, seed=1), str(tmp_path / "model.safetensors"))
    manifest = tmp_path / "fsdpfn_manifest.json"
    manifest.write_text('{"version": 3, "tensors": {' if case == "truncated" else '{"x": 1}')
    with pytest.raises(UpdateError, match=named) as info:
        engine.receiver.update_from_disk({} if case == "no-path" else
                                         {"model_path": str(tmp_path)})
    assert info.value.status == 400 and engine.version == 0
    assert engine.receiver.last_error.startswith(named.split(":")[0])


def test_a_staged_update_commits_under_its_version_as_a_string(engine, tmp_path):
    from safetensors.torch import save_file

    save_file(_perturbed(engine, seed=1), str(tmp_path / "model.safetensors"))
    staged = engine.receiver.update_from_disk({"model_path": str(tmp_path),
                                               "weight_version": 9, "commit": False})
    assert staged["staged"] and engine.version == 0
    assert engine.receiver.commit_staged({"weight_version": "9"})["weight_version"] == 9
    assert engine.version == 9


# ---------------------------------------------------------------- formats


def test_bucket_layout_aligns_and_plans_are_greedy():
    offsets, total = bucket_layout(["float32", "bfloat16", "float32"], [[3], [5], [2, 2]])
    assert offsets == [0, ALIGN, 2 * ALIGN] and total == 2 * ALIGN + 16
    params = [("a", torch.zeros(10)), ("b", torch.zeros(100)), ("c", torch.zeros(5)),
              ("d", torch.zeros(5))]
    buckets = plan_buckets(params, torch.float32, bucket_bytes=ALIGN + 400)
    assert [b.names for b in buckets] == [["a", "b"], ["c", "d"]]
    assert buckets[0].nbytes == ALIGN + 400
    small = plan_buckets(params, torch.float32, bucket_bytes=200)
    assert [b.names for b in small] == [["a"], ["b"], ["c"], ["d"]]  # b (400 B) alone
    assert buckets[1].offsets == (0, ALIGN) and buckets[1].nbytes == ALIGN + 20
    assert [b.metadata["dtypes"] for b in buckets] == [["float32"] * 2] * 2


def test_checksum_is_exact_and_detects_a_flipped_bit():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert tensor_checksum(t) == tensor_checksum(t.clone()) != tensor_checksum(t.flip(0))
    flipped = t.clone()
    flipped.view(torch.int32)[17] ^= 1
    assert tensor_checksum(flipped) != tensor_checksum(t)
    # the definition, computed independently (fsdpfn.wire.checksum): the bytes as little-endian
    # signed 16-bit units u_j, checksum sum(u_j * R**j) modulo 2**61 - 1
    p, r = 2**61 - 1, 0x1F0E5C2B3A49D68A
    big = torch.tensor([2**31 - 1, 2**31 - 5, -7, 2**30], dtype=torch.int32).view(torch.float32)
    for x in (t, big):
        units = [int(u) for u in np.frombuffer(x.numpy().tobytes(), dtype="<i2")]
        assert tensor_checksum(x) == sum(u * pow(r, j, p) for j, u in enumerate(units)) % p
    odd = torch.arange(3, dtype=torch.uint8)  # 3 bytes: hashed as bytes
    assert tensor_checksum(odd) == (1 * r + 2 * r * r) % p
    a, b = {"x": 1, "y": 2}, {"y": 2, "x": 1}
    assert combine_checksums(a) == combine_checksums(b) != combine_checksums({"x": 2, "y": 1})
    many = {f"t{(i * 7919) % 1000}": (i * 2654435761) % 2**64 - 2**63 for i in range(1000)}
    assert int(combine_on_device(torch.tensor(list(many.values())), list(many))) == \
        combine_checksums(many)


@pytest.mark.timeout(90)
def test_whole_update_is_checked_and_atomic(engine):
    """{buckets: [...]} (the update channel's message): every bucket received, then one swap.
    The checksum the receiver reports equals tensor_checksum of what was sent (padding garbage
    ignored); an unknown name is refused before any byte is sent, a NaN after the bytes, and
    the weights stay."""
    pair = _Pair(engine, name="g-one")
    new = _perturbed(engine, seed=5)
    names = list(new)
    buckets = [{n: new[n] for n in names[:3]}, {n: new[n] for n in names[3:]}]
    r = pair.send_update(buckets, weight_version=7)
    assert r["ok"]["weight_version"] == 7 == engine.version
    sent = combine_checksums({n: tensor_checksum(t) for n, t in new.items()})
    assert r["ok"]["weights_checksum"] == sent == engine.weights_checksum()
    assert all(torch.equal(p, new[n]) for n, p in engine.params.items())
    assert not engine.info()["paused"]
    kept = {n: p.detach().clone() for n, p in engine.params.items()}
    bad = _perturbed(engine, seed=6)
    bad[names[-1]].view(-1)[0] = float("nan")
    r = pair.send_update([{n: bad[n] for n in names[:3]}, {n: bad[n] for n in names[3:]}],
                         weight_version=8)
    assert r["accepted"] and "must be finite" in str(r["err"]) and names[-1] in str(r["err"])
    unknown = dict(list(bad.items())[:2])
    unknown["model.not_a_weight"] = torch.zeros(3)
    r = pair.send_update([unknown], weight_version=8)
    assert not r["accepted"] and "update refused before any byte was sent" in str(r["err"])
    assert "name must be a parameter of the served model" in str(r["err"])
    assert engine.version == 7
    assert all(torch.equal(p, kept[n]) for n, p in engine.params.items())
    assert "g-one" in engine.info()["groups"]  # the group stayed in step: usable again
    r = pair.send_update([new], weight_version="rl-step-9")
    assert r["ok"]["weight_version"] == 8 and engine.version_label() == "rl-step-9"
    # finite values whose float32 sum overflows: the fast bucket check flags them, the closer
    # look clears them, and the update lands
    huge = {n: t.clone() for n, t in new.items()}
    huge[names[0]].view(-1)[:4] = 3.0e38
    r = pair.send_update([huge], weight_version=10)
    assert r["ok"]["weight_version"] == 10
    assert torch.equal(engine.params[names[0]], huge[names[0]])


def test_generate_client_validates_and_reports_the_server():
    """fsdpfn.rollout.generate: bad arguments are ConfigErrors naming the field; an unreachable
    server is a WeightSyncError naming it."""
    from fsdpfn.rollout import generate

    with pytest.raises(ff.ConfigError, match="prompts: must be a non-empty list"):
        generate("http://127.0.0.1:9", [])
    with pytest.raises(ff.ConfigError, match=r"^n: must be an int >= 1, got 0"):
        generate("http://127.0.0.1:9", [[1, 2]], n=0)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ff.WeightSyncError, match=f"server {url}: /generate failed"):
        generate(url, [[1, 2]], timeout=2)


@pytest.mark.parametrize("kwargs, named", [
    ({"seed": 1.9}, r"^seed: must be null or an int in \[0, 2\*\*63\), got 1\.9"),
    ({"seed": True}, r"^seed: must be null or an int .*got True"),
    ({"seed": "x"}, r"^seed: must be null or an int .*got 'x'"),
    ({"seed": -3}, r"^seed: must be null or an int .*got -3"),
    ({"seed": 2 ** 63}, r"^seed: must be null or an int .*got 9223372036854775808"),
    ({"top_k": 2.7}, r"^top_k: must be an int >= 0 \(or -1: off\), got 2\.7"),
    ({"top_k": -2}, r"^top_k: must be an int >= 0 \(or -1: off\), got -2"),
    ({"stop_token_ids": [5.6]}, r"^stop_token_ids: must be a list of token ids .*5\.6"),
    ({"stop_token_ids": [-1]}, r"^stop_token_ids: must be a list of token ids .*-1"),
    ({"temperature": "abc"}, r"^temperature: must be a finite number >= 0, got 'abc'"),
    ({"temperature": float("nan")}, r"^temperature: must be a finite number >= 0, got nan"),
    ({"top_p": 0}, r"^top_p: must be in \(0, 1\], got 0"),
    ({"min_p": 2.0}, r"^min_p: must be in \[0, 1\], got 2\.0"),
    ({"max_new_tokens": -1}, r"^max_new_tokens: must be an int >= 1, got -1"),
    ({"timeout": 0}, r"^timeout: must be a finite number of seconds > 0, got 0"),
    ({"timeout": "5"}, r"^timeout: must be a finite number of seconds > 0, got '5'"),
    ({"sampling_seed": 3}, r"^sampling_seed: pass it as seed=, got sampling_seed=3"),
])
def test_generate_refuses_a_bad_sampling_argument_before_sending_it(kwargs, named):
    """The server's own rule, checked where the caller passed the value and named by the
    caller's key: a seed of 1.9 drew what seed 1 draws, a string temperature was a bare
    ValueError, a negative seed a WeightSyncError quoting the server's 400."""
    from fsdpfn.rollout import generate, generate_balanced

    url = "http://127.0.0.1:9"  # never reached: the arguments are refused first
    with pytest.raises(ff.ConfigError, match=named):
        generate(url, [[1, 2]], **kwargs)
    if "sampling_seed" not in kwargs:
        with pytest.raises(ff.ConfigError, match=named):
            generate_balanced([url, "http://127.0.0.1:10"], [[1, 2], [3]], **kwargs)


def test_generate_sends_numpy_and_torch_scalars_as_the_numbers_they_hold(monkeypatch):
    import numpy as np

    from fsdpfn.rollout import client
    from fsdpfn.wire import http

    sent = {}

    def fake_call(url, path, body, timeout):
        sent.update(body["sampling_params"], timeout=timeout)
        return {"weight_version": 0, "outputs": []}  # an unpacked answer, returned as it is

    monkeypatch.setattr(http, "call", fake_call)
    client.generate("http://x", [[1, 2]], seed=np.int64(7), top_k=torch.tensor(3),
                    temperature=np.float32(0.5), stop_token_ids=np.array([4, 5]), timeout=9)
    assert sent["sampling_seed"] == 7 and type(sent["sampling_seed"]) is int
    assert sent["top_k"] == 3 and type(sent["top_k"]) is int
    assert sent["temperature"] == 0.5 and type(sent["temperature"]) is float
    assert sent["stop_token_ids"] == [4, 5] and all(type(t) is int for t in sent["stop_token_ids"])
    assert sent["timeout"] == 9.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=60), st.integers(1, 20000),
       st.one_of(st.none(), st.integers(1, 8000)))
def test_ramped_plans_hold_every_tensor_once_within_the_caps(numels, bucket_bytes, edge):
    params = [(f"t{i}", torch.empty(n, device="meta")) for i, n in enumerate(numels)]
    buckets = plan_buckets(params, torch.float32, bucket_bytes, edge)
    assert sorted(n for b in buckets for n in b.names) == sorted(n for n, _ in params)
    assert len({n for b in buckets for n in b.names}) == len(params)
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for b in buckets:
        assert b.names == sorted(b.names, key=lambda n: int(n[1:]))  # forward order inside
        assert all(o % ALIGN == 0 for o in b.offsets)
        assert b.nbytes == b.offsets[-1] + b.sizes[-1]
        if len(b.specs) > 1:
            assert b.nbytes <= bucket_bytes
    if edge is None:  # greedy: the concatenation is the name order
        assert [n for b in buckets for n in b.names] == [n for n, _ in params]


def test_ramped_plan_starts_and_ends_small():
    # an embedding larger than the edge, then 12 "layers" of three 400-byte tensors
    params = [("embed", torch.empty(3000, device="meta"))] + [
        (f"l{i}.{k}", torch.empty(100, device="meta")) for i in range(12) for k in "abc"]
    buckets = plan_buckets(params, torch.float32, bucket_bytes=8 * ALIGN, edge_bytes=2 * ALIGN)
    sizes = [len(b.specs) for b in buckets]
    assert buckets[0].names == ["l0.a", "l0.b"]  # the embedding waits for a bucket it fits
    assert buckets[-1].names == ["l11.b", "l11.c"] and sizes[-1] == 2
    assert "embed" in buckets[1].names or "embed" in buckets[2].names
    assert max(b.nbytes for b in buckets[1:-1] if len(b.specs) > 1) <= 8 * ALIGN


@pytest.mark.timeout(120)
def test_a_text_that_encodes_to_no_token_is_refused_naming_text(tmp_path):
    from fsdpfn.rollout.sglang_api import encode_prompts
    from fsdpfn.testing import write_tiny_hf_dir

    path = write_tiny_hf_dir(tmp_path / "tok", texts=["one two three", "four five"], seed=1)
    engine = RolloutEngine(str(path), dtype="float32", device="cpu")
    assert encode_prompts(engine, None, "one two")[0][0]
    with pytest.raises(UpdateError, match=r"^text: must encode to at least one token, got ''$"):
        encode_prompts(engine, None, "")
