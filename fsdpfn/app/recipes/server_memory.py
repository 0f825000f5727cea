"""The built-in rollout server's memory on its GPU: the model's weights in the served dtype and
the decode cache its command line sizes (slots x positions x layers x k and v).

    check_server_memory(cfg, shape, gpus=..., capacity=..., dtype=...)  # servers on own GPUs

The bytes are fsdpfn.app.recipes.memory's server_bytes (the cache's slots and positions read
from the server's command line: server_cache); where the server shares a GPU with the trainer,
that GPU's estimate adds them. Where each server has a GPU of its own, nothing of the
trainer's estimate covers it: a model whose weights or cache do not fit one server GPU is
refused here, before the trainer ranks start, instead of the server failing on an
out-of-memory error after them.
What the server holds beside these (CUDA graphs' pools, a step's logits, the prefill's
activations) is small next to them, and the HEADROOM kept free covers it.
"""

from __future__ import annotations

from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes.memory import GiB, HEADROOM, ModelShape, server_bytes, server_cache

__all__ = ["check_server_memory"]


def check_server_memory(cfg, shape: ModelShape, *, gpus: tuple[int, ...], capacity: float,
                        dtype: str = "bfloat16", busy: str = "") -> str:
    """server_bytes against ``capacity`` bytes (what is free on the fullest of the servers'
    own ``gpus``): a note when a server fits, else a ConfigError naming what would make it
    fit: fewer decode slots (rows beyond the slots wait for one), or, where the weights alone
    do not fit, servers that shard the model (rollout.url) or a smaller model."""
    est = server_bytes(cfg, shape, dtype)
    total = sum(est.values())
    where = f"GPU {gpus[0]}" if len(gpus) == 1 else "GPUs " + ", ".join(map(str, gpus))
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in est.items())
    line = (f"rollout server memory estimate: {total / GiB:.1f} GiB of {capacity / GiB:.1f} "
            f"GiB{' free' if busy else ''} on {where} ({parts}{'; ' + busy if busy else ''})")
    if total <= HEADROOM * capacity:
        return line
    slots, _ = server_cache(cfg)
    room = HEADROOM * capacity - est["weights"]
    fit = int(room // (est["decode cache"] / slots)) // 8 * 8 if room > 0 else 0
    if fit >= 8:
        hint = (f"it would fit with rollout.server_args: ['--decode-rows', '{fit}'] (a "
                f"server decodes that many rows at once, a step's other rows wait for a free "
                f"slot)")
        if cfg.data.from_files:
            hint += " or shorter rows (data.max_prompt_tokens, data.max_response_tokens)"
    else:
        hint = (f"its weights take {est['weights'] / GiB:.1f} GiB and leave no room for a "
                f"decode cache of 8 rows: serve the model from servers that shard it "
                f"(rollout.url, e.g. SGLang with tensor parallelism), or train a smaller model")
    if busy:
        hint += " (or free the GPUs that other processes hold)"
    raise ConfigError(f"rollout: each rollout server holds the whole model on a GPU of its own, "
                      f"and it does not fit, {line}, more than {HEADROOM:.0%} of the device; "
                      f"{hint}")
