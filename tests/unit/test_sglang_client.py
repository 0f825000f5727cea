"""A trainer built as AReaL and verl build theirs pushes into fsdpfn's server (python -m
fsdpfn.rollout, a real process), in SGLang's protocol, and the server then serves the new weights.

The client here is written from SGLang's definitions (/work/shared/SGLANG.md; not fsdpfn's
sender): it forms the group as SGLang's init_custom_process_group does (torch's rendezvous,
PrefixStore(group_name), torch's own _new_process_group_helper; the trainer is rank 0, the server
joins at rank_offset), posts /init_weights_update_group and /update_weights_from_distributed with
SGLang's fields only (every body checked against SGLang's schemas, tests/sglang_standin.py), and
broadcasts each bucket packed back to back (torch.cat of the flattened tensors, no padding), with
a string weight_version label. gloo on CPU.

Reference: the Hugging Face model holding the pushed weights, in float64: the server's greedy
log-probs must be its log_softmax at the served tokens.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from sglang_standin import init_custom_process_group, validate

from fsdpfn.wire.ports import free_port
from fsdpfn.rollout import launch_server
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config
from fsdpfn.wire.http import call

LOGP_ATOL = 1e-5  # float32 server against a float64 reference (see tests/unit/test_rollout.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("sglang-client") / "tiny",
                               tiny_qwen2_config(), seed=0))


@pytest.fixture(scope="module")
def server(model_dir):
    with launch_server(model_dir, dtype="float32", extra_args=("--no-channel",)) as srv:
        yield srv


def _post(url: str, path: str, body: dict) -> dict:
    """POST a body that SGLang's own schema accepts."""
    assert validate(path, body) == [], (path, validate(path, body))
    return call(url, path, body, timeout=60)


def _in_thread(fn):
    box = {}
    thread = threading.Thread(target=lambda: box.update(answer=fn()), daemon=True)
    thread.start()
    return thread, box


class SGLangTrainer:
    """Rank 0 of an update group, as AReaL's and verl's trainers are."""

    def __init__(self, url: str, group_name: str):
        self.url, self.group_name = url, group_name
        port = free_port()
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": group_name, "backend": "gloo"}
        thread, box = _in_thread(lambda: _post(url, "/init_weights_update_group", body))
        self.pg = init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=60), world_size=2, rank=0, group_name=group_name)
        thread.join(60)
        assert box["answer"]["success"] is True, box

    def push(self, buckets: list[dict[str, torch.Tensor]], version: str) -> list[dict]:
        """One request and one packed broadcast per bucket, in turn."""
        answers = []
        for i, bucket in enumerate(buckets):
            body = {"names": list(bucket),
                    "dtypes": [str(t.dtype).split(".")[-1] for t in bucket.values()],
                    "shapes": [list(t.shape) for t in bucket.values()],
                    "group_name": self.group_name, "flush_cache": i == len(buckets) - 1,
                    "weight_version": version, "load_format": "flattened_bucket"}
            thread, box = _in_thread(lambda: _post(self.url, "/update_weights_from_distributed",
                                                   body))
            flat = torch.cat([t.flatten() for t in bucket.values()])
            dist.broadcast(flat, src=0, group=self.pg)
            thread.join(60)
            answers.append(box["answer"])
        return answers


def _new_weights(model_dir: str, seed: int):
    """The pushed weights (HF names) and the HF model holding them in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    weights = {n: (p.detach() + 0.02 * torch.randn(p.shape, generator=g)).contiguous()
               for n, p in model.named_parameters()}
    model.load_state_dict(weights, strict=False)
    return weights, model.double().eval()


def _greedy_matches(url: str, reference, prompt: list[int], label: str) -> None:
    out = _post(url, "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params":
                                   {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}})
    rows = out["meta_info"]["output_token_logprobs"]
    tokens, served = [r[1] for r in rows], [r[0] for r in rows]
    assert out["meta_info"]["weight_version"] == label
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(reference(input_ids=ids).logits[0], -1)
    ref = logp[len(prompt) - 1:-1].gather(-1, ids[0, len(prompt):, None])[:, 0]
    torch.testing.assert_close(torch.tensor(served, dtype=torch.float64), ref, atol=LOGP_ATOL,
                               rtol=0)
    assert tokens == logp[len(prompt) - 1:-1].argmax(-1).tolist()  # greedy: each the argmax


@pytest.mark.timeout(240)
def test_an_sglang_shaped_trainer_pushes_and_the_server_serves_its_weights(server, model_dir):
    url, prompt = server.url, [3, 10, 17, 24, 31, 38]
    version = server.get("/weight_version")["weight_version"]
    trainer = SGLangTrainer(url, "weight_update_group")
    for step in (1, 2):  # the group is formed once and reused
        weights, reference = _new_weights(model_dir, seed=step)
        names = list(weights)
        buckets = [{n: weights[n] for n in names[i::3]} for i in range(3)]
        label = f"rl-step-{step}"
        answers = trainer.push(buckets, label)
        assert all(a["success"] is True for a in answers)
        # the label as given, beside fsdpfn's integer version (one more per labelled version)
        assert server.get("/get_weight_version") == {"weight_version": label}
        info = server.get("/get_model_info")
        assert info["weight_version"] == label and info["version"] == version + step
        assert server.get("/weight_version")["weight_version"] == version + step
        _greedy_matches(url, reference, prompt, label)
    assert _post(url, "/destroy_weights_update_group",
                 {"group_name": "weight_update_group"})["success"] is True
    assert "weight_update_group" not in server.get("/get_model_info")["groups"]
    dist.destroy_process_group(trainer.pg)  # torch's registry holds it, as SGLang's trainers
