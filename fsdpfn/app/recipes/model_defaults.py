"""What a recipe's config defaults to for a pretrained model of the user's.

The recipes' own defaults (fsdpfn.app.recipes.config) are the embedded task's: a tiny model
trained from random init at 2e-4 to 3e-3, in runs of seconds. A model of the user's own
(``model.path`` without ``model.random_init``) is pretrained, and those rates would wreck it
within a few steps; its runs are long. So, wherever the file or an override leaves a key unset,
its config defaults to the usual fine-tuning rates at 1B to 8B parameters, and the supervised
recipes save a checkpoint every 100 steps rather than only at the end:

    recipe   optimizer.lr   warmup.optimizer.lr   critic_optimizer.lr   checkpoint.every
    sft      2e-5                                                        100
    rw       1e-5                                                        100
    dpo      1e-6                                                        100
    grpo     1e-6           1e-5                                         (10, as before)
    ppo      1e-6           1e-5                  1e-5                   (10, as before)

Adapters (``engine.lora``, on the policy only) train at ten times the full model's rate. The
choice is made on the raw data before it is structured (fsdpfn.app.recipes.config_from_data),
so ``fsdpfn config RECIPE model.path=DIR`` prints it.
"""

from __future__ import annotations

import copy

__all__ = ["PRETRAINED", "LORA_LR_FACTOR", "pretrained", "model_defaults",
           "with_model_defaults", "without_model_keys", "model_defaults_note"]

_SUPERVISED_SAVES = {"checkpoint.every": 100}
PRETRAINED = {"sft": {"optimizer.lr": 2e-5, **_SUPERVISED_SAVES},
              "rw": {"optimizer.lr": 1e-5, **_SUPERVISED_SAVES},
              "dpo": {"optimizer.lr": 1e-6, **_SUPERVISED_SAVES},
              "grpo": {"optimizer.lr": 1e-6, "warmup.optimizer.lr": 1e-5},
              "ppo": {"optimizer.lr": 1e-6, "warmup.optimizer.lr": 1e-5,
                      "critic_optimizer.lr": 1e-5}}
LORA_LR_FACTOR = 10
_POLICY_RATES = ("optimizer.lr", "warmup.optimizer.lr")  # the critic trains in full


def pretrained(data: dict) -> bool:
    """Whether raw config data names a pretrained model of the user's (``model.path``, without
    ``model.random_init``); bad values are left to the config's own validation."""
    model = data.get("model")
    return isinstance(model, dict) and model.get("path") is not None and \
        model.get("random_init") is not True


def model_defaults(name: str, data: dict) -> dict:
    """{dotted key: its default} for raw config ``data`` of recipe ``name``: the pretrained
    model's where ``data`` names a model of the user's, else nothing (the class defaults
    stand)."""
    if not pretrained(data):
        return {}
    engine = data.get("engine")
    lora = isinstance(engine, dict) and engine.get("lora") is not None
    return {key: float(f"{value * LORA_LR_FACTOR:.12g}") if lora and key in _POLICY_RATES
            else value for key, value in PRETRAINED[name].items()}


def _parent(data: dict, dotted: str) -> tuple[dict | None, str]:
    *path, leaf = dotted.split(".")
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return (data if isinstance(data, dict) else None), leaf


def with_model_defaults(name: str, defaults: dict, data: dict) -> dict:
    """``defaults`` (an unstructured recipe config) with the values ``data``'s model calls for
    (model_defaults); ``defaults`` itself is not changed."""
    out = copy.deepcopy(defaults)
    for dotted, value in model_defaults(name, data).items():
        parent, leaf = _parent(out, dotted)
        parent[leaf] = value
    return out


def without_model_keys(name: str, data: dict) -> dict:
    """A whole default config (``data``) less the keys that depend on the model, so that the
    defaults chosen for the model the overrides name fill them (default_config)."""
    out = copy.deepcopy(data)
    for dotted in PRETRAINED[name]:
        parent, leaf = _parent(out, dotted)
        if parent is not None:
            parent.pop(leaf, None)
    return out


def model_defaults_note(name: str, data: dict) -> str | None:
    """The launcher's line naming the values raw config ``data`` (overrides applied) of recipe
    ``name`` takes from the pretrained model's defaults, the keys it leaves unset; None when
    it takes none (no model of the user's, or every such key written)."""
    chosen = {}
    for dotted, value in model_defaults(name, data).items():
        parent, leaf = _parent(data, dotted)
        if parent is None or leaf not in parent:
            chosen[dotted] = value
    if not chosen:
        return None
    lora = " with LoRA" if any(k in _POLICY_RATES for k in chosen) and \
        isinstance(data.get("engine"), dict) and data["engine"].get("lora") is not None else ""
    values = ", ".join(f"{key}={value:g}" for key, value in chosen.items())
    return (f"model.path names a pretrained model: {values} (the fine-tuning defaults{lora}, "
            f"where the config sets none; docs/recipes.md)")
