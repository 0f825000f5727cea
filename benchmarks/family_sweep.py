"""Every causal-LM model_type of the installed transformers through shard_model, against the
model's own forward in float64 (CPU, one rank): what the engine accepts must compute it exactly.

    python benchmarks/family_sweep.py                  # every model_type transformers registers
    python benchmarks/family_sweep.py --types gpt_neox phi

For each model_type: a tiny config (64 wide, 4 heads on 2 kv heads, 2 layers, vocabulary 97),
HF's random init perturbed (so norm weights and biases matter), saved with save_pretrained; then
``shard_model`` from that directory in float32 with the defaults (verified families are built,
others go through the guard, ``EngineConfig.verify_model``), and ``forward_logp`` on two rows of
12 and 9 tokens against the log-softmax of ``from_pretrained``'s float64 forward of each row
alone. Verdicts: ``exact`` (largest gap under 1e-4), ``WRONG`` (accepted, gap above),
``forward failed`` (accepted, then forward_logp raised), ``refused`` (a ConfigError from
shard_model: the reason, shortened), ``refused by config`` (fsdpfn.engine.families.refusal on
the config alone: mixture-of-experts, multimodal, encoder-decoder, logit scales; not built),
``no tiny model`` (transformers cannot build this tiny config). A correctness sweep, not a
timing: it prints a table and exits 1 when any model is WRONG or failed its forward.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TOL = 1e-4


class _Timeout(Exception):
    pass


def _alarm(*_):
    raise _Timeout()


def one(model_type: str, tmp: str) -> dict:
    from tensordict import TensorDict
    from transformers import AutoConfig, AutoModelForCausalLM

    import fsdpfn as ff
    from fsdpfn.engine.families import refusal

    row = {"model_type": model_type}
    try:
        config = AutoConfig.for_model(model_type, **TINY)
    except Exception:  # noqa: BLE001 - some configs derive head_dim (Falcon): without it
        try:
            config = AutoConfig.for_model(model_type, **{k: v for k, v in TINY.items()
                                                         if k != "head_dim"})
        except Exception as exc:  # noqa: BLE001 - transformers cannot build this tiny config
            return dict(row, verdict="no tiny model", detail=type(exc).__name__)
    rotary = getattr(config, "rotary_dim", None)  # GPT-J, CodeGen: at most the head size
    if isinstance(rotary, int) and rotary > TINY["head_dim"]:
        config.rotary_dim = TINY["head_dim"] // 2
    why = refusal(config)
    if why is not None:
        return dict(row, verdict="refused by config", detail=why.split(":")[0])
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        path = os.path.join(tmp, model_type)
        model.save_pretrained(path)
        del model
    except Exception as exc:  # noqa: BLE001
        return dict(row, verdict="no tiny model", detail=type(exc).__name__)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cpu")
    try:
        state = ff.shard_model(ff.EngineConfig(model_path=path, dtype="float32", optimizer=None),
                               mesh)
    except ff.errors.ConfigError as exc:
        text = str(exc).split(";")[0].replace("|", "/")
        return dict(row, verdict="refused", detail=text[text.find(":") + 1:][:110].strip())
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 9:] = False
    try:
        got = ff.forward_logp(state, TensorDict(dict(input_ids=ids, attention_mask=mask),
                                                batch_size=[2]))["logp"]
    except Exception as exc:  # noqa: BLE001 - accepted, then failed: a finding
        return dict(row, verdict="forward failed", detail=f"{type(exc).__name__}: {exc}"[:110])
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    gap = 0.0
    with torch.no_grad():
        for b in range(2):
            n = int(mask[b].sum())
            logp = reference(ids[b:b + 1, :n]).logits[0].log_softmax(-1)
            ref = logp[:-1].gather(-1, ids[b, 1:n, None])[:, 0]
            gap = max(gap, float((got[b, 1:n].double() - ref).abs().max()))
    return dict(row, verdict="exact" if gap < TOL else "WRONG", detail=f"gap {gap:.1e}")


def main() -> None:
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = argparse.ArgumentParser()
    p.add_argument("--types", nargs="*", default=None, help="only these model_types")
    p.add_argument("--timeout", type=int, default=90, help="seconds per model_type")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    signal.signal(signal.SIGALRM, _alarm)
    types = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in types:
            signal.alarm(args.timeout)
            try:
                row = one(model_type, tmp)
            except _Timeout:
                row = {"model_type": model_type, "verdict": "timeout", "detail": ""}
            finally:
                signal.alarm(0)
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    counts = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print(f"\n# transformers {__version__}, torch {torch.__version__}: {len(rows)} model_types; "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print_markdown_table(rows, ("model_type", "verdict", "detail"))
    sys.exit(1 if counts.get("WRONG") or counts.get("forward failed") else 0)


if __name__ == "__main__":
    main()
