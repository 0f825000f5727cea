"""fsdpfn.rollout: the built-in rollout server, the embedded default behind push_weights.

Start it with ``python -m fsdpfn.rollout --model DIR --port N``; it serves HF transformers
generation on SGLang's /generate and OpenAI's /v1/completions and /v1/chat/completions
(batched sampling; token ids and the server's own per-token log-probs, the ``behav_logp`` of the
public batch) and takes weight updates on SGLang's endpoints
(/init_weights_update_group, /update_weights_from_distributed, /update_weights_from_disk,
/pause_generation, /continue_generation), and SGLang's /abort_request and /flush_cache. Updates are
staged, validated, then swapped atomically.

``RolloutEngine`` is the server without HTTP; ``build_app(engine)`` the FastAPI app;
``launch_server`` / ``RolloutProcess`` start one as a subprocess (tests, examples);
``generate(url, prompts, ...)`` samples from one (n per prompt, ids and behav_logp);
``generate_balanced(urls or Balancer, prompts, ...)`` from several, each prompt's samples from
the least loaded server (fsdpfn.rollout.balance); ``fsdpfn.rollout_batch`` lays their answers
out as the public batch.
"""

from __future__ import annotations

from fsdpfn.lazy import lazy_exports

# name -> the module that defines it; imported on first use (PEP 562): the launcher starts
# servers through fsdpfn.rollout.process without importing the engine (torch)
_SOURCES = {"Balancer": "fsdpfn.rollout.balance", "generate_balanced": "fsdpfn.rollout.balance",
            "generate": "fsdpfn.rollout.client",
            **dict.fromkeys(("RolloutEngine", "SamplingParams", "UpdateError"),
                            "fsdpfn.rollout.engine"),
            **dict.fromkeys(("RolloutProcess", "launch_server"), "fsdpfn.rollout.process")}

__all__ = ["RolloutEngine", "SamplingParams", "UpdateError", "RolloutProcess", "launch_server",
           "generate", "generate_balanced", "Balancer"]


__getattr__, __dir__ = lazy_exports(__name__, _SOURCES, __all__)
