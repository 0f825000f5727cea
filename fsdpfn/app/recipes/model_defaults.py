"""The learning rates a recipe's config defaults to for a pretrained model of the user's.

The recipes' own rates (fsdpfn.app.recipes.config) are the embedded task's: a tiny model trained
from random init at 2e-4 to 3e-3. A model of the user's own (``model.path`` without
``model.random_init``) is pretrained, and those rates would wreck it within a few steps, so its
config defaults to the usual fine-tuning rates at 1B to 8B parameters instead, wherever the
file or an override does not set the key:

    recipe   optimizer   warmup.optimizer   critic_optimizer
    sft      2e-5
    rw       1e-5
    dpo      1e-6
    grpo     1e-6        1e-5
    ppo      1e-6        1e-5               1e-5

Adapters (``engine.lora``, on the policy only) train at ten times the full model's rate. The
choice is made on the raw data before it is structured (fsdpfn.app.recipes.config_from_data),
so ``fsdpfn config RECIPE model.path=DIR`` prints it.
"""

from __future__ import annotations

import copy

__all__ = ["PRETRAINED_LR", "LORA_LR_FACTOR", "pretrained", "model_defaults",
           "with_model_defaults", "without_model_keys"]


PRETRAINED_LR = {"sft": {"optimizer": 2e-5},
                 "rw": {"optimizer": 1e-5},
                 "dpo": {"optimizer": 1e-6},
                 "grpo": {"optimizer": 1e-6, "warmup.optimizer": 1e-5},
                 "ppo": {"optimizer": 1e-6, "warmup.optimizer": 1e-5, "critic_optimizer": 1e-5}}
LORA_LR_FACTOR = 10
_POLICY_OPTIMIZERS = ("optimizer", "warmup.optimizer")  # the critic trains in full


def pretrained(data: dict) -> bool:
    """Whether raw config data names a pretrained model of the user's (``model.path``, without
    ``model.random_init``); bad values are left to the config's own validation."""
    model = data.get("model")
    return isinstance(model, dict) and model.get("path") is not None and \
        model.get("random_init") is not True


def model_defaults(name: str, data: dict) -> dict:
    """{optimizer section (dotted): its default lr} for raw config ``data`` of recipe ``name``:
    the pretrained rates where ``data`` names a model of the user's, else nothing (the class
    defaults stand)."""
    if not pretrained(data):
        return {}
    engine = data.get("engine")
    lora = isinstance(engine, dict) and engine.get("lora") is not None
    factor = {s: LORA_LR_FACTOR if lora and s in _POLICY_OPTIMIZERS else 1
              for s in PRETRAINED_LR[name]}
    return {s: float(f"{lr * factor[s]:.12g}") for s, lr in PRETRAINED_LR[name].items()}


def _section(data: dict, dotted: str) -> dict | None:
    for key in dotted.split("."):
        data = data.get(key) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None


def with_model_defaults(name: str, defaults: dict, data: dict) -> dict:
    """``defaults`` (an unstructured recipe config) with the learning rates ``data``'s model
    calls for (model_defaults); ``defaults`` itself is not changed."""
    out = copy.deepcopy(defaults)
    for dotted, lr in model_defaults(name, data).items():
        _section(out, dotted)["lr"] = lr
    return out


def without_model_keys(name: str, data: dict) -> dict:
    """A whole default config (``data``) less the keys that depend on the model, so that the
    defaults chosen for the model the overrides name fill them (default_config)."""
    out = copy.deepcopy(data)
    for dotted in PRETRAINED_LR[name]:
        section = _section(out, dotted)
        if section is not None:
            section.pop("lr", None)
    return out
