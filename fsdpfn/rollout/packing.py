"""fsdpfn's packed /generate answer (``"return_format": "fsdpfn_packed"``): the same value as
``"fsdpfn"``'s, with the per-token lists carried as bytes instead of JSON numbers.

Why: at 512 rows x 1,024 new tokens the plain answer is 16 MB of JSON (each log-prob a 17-digit
decimal), and writing it on the server and reading it in the trainer took about 0.7 s on a 2-core
CPU, a tenth of the rollout's wall time (BENCHMARKS.md, "Decode loop"). Packed, the answer is
5.6 MB and both ends take about 0.2 s; from the decode loop's tensor rows (RolloutEngine.generate
with ``lists=False``) the server's part is about 18 ms, the client's unpack about 70.

Layout: ``output_ids`` (int32) and ``output_logprobs`` (float32) of every output, concatenated
in order, each little-endian and base64-encoded; each output keeps its other keys and gives its
``length`` (tokens) and its ``weight_versions`` as runs ``[[version, count], ...]``. The log-probs
are the float32 values the server computed, so unpacking gives exactly the floats the plain
answer carries (those are float32 values written as doubles)."""

from __future__ import annotations

import base64
import itertools
import sys
from array import array

__all__ = ["pack", "unpack", "PACKED"]

PACKED = ("output_ids", "output_logprobs", "weight_versions")


def _b64(rows: list, code: str) -> str:
    """The rows (lists, or the decode loop's CPU tensors) end to end as little-endian int32
    ("i") or float32 ("f"), base64-encoded. Tensors are written from their own bytes, with no
    list in between (BENCHMARKS.md, "Decode loop": pack from the loop's tensors)."""
    if rows and sys.byteorder == "little" and all(hasattr(r, "numpy") for r in rows):
        import torch

        flat = torch.cat([r.reshape(-1) for r in rows])
        flat = flat.to(torch.int32 if code == "i" else torch.float32)
        return base64.b64encode(flat.numpy().tobytes()).decode("ascii")
    data = array(code)
    for r in rows:
        data.extend(r if isinstance(r, list) else r.tolist())
    if sys.byteorder == "big":
        data.byteswap()
    return base64.b64encode(data.tobytes()).decode("ascii")


def _unb64(text: str, code: str) -> array:
    data = array(code)
    data.frombytes(base64.b64decode(text))
    if sys.byteorder == "big":
        data.byteswap()
    return data


def _runs(values: list) -> list:
    """[[value, count], ...] of the consecutive equal values: one run when all are equal
    (every token of a row from one weight version, the common case), found at C speed."""
    if values and values[-1] == values[0] and values.count(values[0]) == len(values):
        return [[values[0], len(values)]]
    return [[v, len(list(run))] for v, run in itertools.groupby(values)]


def pack(answer: dict) -> dict:
    """{weight_version, outputs: [...]} (fsdpfn's answer, its ids and log-probs lists or CPU
    tensors, RolloutEngine.generate(..., lists=False)) -> its packed form."""
    outputs, ids, logprobs = [], [], []
    for o in answer["outputs"]:
        ids.append(o["output_ids"])
        logprobs.append(o["output_logprobs"])
        outputs.append({**{k: v for k, v in o.items() if k not in PACKED},
                        "length": len(o["output_ids"]),
                        "weight_versions": _runs(list(o.get("weight_versions") or []))})
    return {**{k: v for k, v in answer.items() if k != "outputs"}, "outputs": outputs,
            "output_ids": _b64(ids, "i"), "output_logprobs": _b64(logprobs, "f")}


def unpack(packed: dict) -> dict:
    """The packed form -> {weight_version, outputs: [...]}, as the plain answer reads. A malformed
    answer raises ValueError naming what does not add up."""
    ids = _unb64(packed["output_ids"], "i")
    logprobs = _unb64(packed["output_logprobs"], "f")
    lengths = [int(o["length"]) for o in packed["outputs"]]
    if any(n < 0 for n in lengths):
        raise ValueError(f"packed answer: an output's length must be >= 0, got {min(lengths)}")
    total = sum(lengths)
    if len(ids) != total or len(logprobs) != total:
        raise ValueError(f"packed answer: {len(ids)} ids and {len(logprobs)} log-probs for "
                         f"outputs of {total} tokens")
    outputs, at = [], 0
    for o, n in zip(packed["outputs"], lengths):
        versions = []
        for v, count in o.get("weight_versions") or []:
            versions += [v] * count
        if versions and len(versions) != n:
            raise ValueError(f"packed answer: {len(versions)} weight versions for an output of "
                             f"{n} tokens")
        # each row's list straight from the bytes (an array slice, then tolist): no list of
        # every token to slice again, which at 1,024 x 1,024 tokens cost a third of unpack
        outputs.append({**{k: v for k, v in o.items() if k not in ("length", "weight_versions")},
                        "output_ids": ids[at:at + n].tolist(),
                        "output_logprobs": logprobs[at:at + n].tolist(),
                        "weight_versions": versions})
        at += n
    return {**{k: v for k, v in packed.items() if k not in ("outputs",) + PACKED},
            "outputs": outputs}
