"""The RL recipes' rollout stage (rank 0): each step's global batch from the rollout server.

Two producers, one interface (``step(step, cursor) -> dict``, ``advance(version)`` after each
push, ``close()``):

- ``SyncRollout`` (``rollout.max_staleness: 0`` without a workflow): the step's prompts in one
  /generate request after the previous step's push (with several servers, one request per
  server, the groups cut by load: fsdpfn.rollout.balance), scored by the reward's worker
  processes.
- ``StreamRollout`` (``max_staleness >= 1``, or a ``rollout.workflow``): a RolloutStream keeps up
  to max_staleness + 1 steps of groups in flight (fsdpfn.rollout.stream: admission control,
  groups in data order, so the data cursor counts trained prompts only); with a workflow each
  sample is an episode (fsdpfn.app.recipes.workflow) and the batch carries its advantages.

The dict a step returns: ``batch`` (the public batch as plain tensors), ``served_version``,
``stats`` (generation, reward and stream numbers for the metrics row) and ``advantages_done``
(True when the batch already holds advantages: episodes rows of unequal counts per group).
Each producer's ``balancer`` holds the servers' outstanding work; the recipe's greedy eval sends
through it too. The stats name the servers: ``rollout_servers`` and, per server i (the order of
the URLs), ``rollout_rows_server{i}`` and ``rollout_tokens_server{i}`` (rows and generated
tokens it answered this step), and ``rollout_load_imbalance`` (the most tokens any server
generated over the mean: 1.0 is even).
"""

from __future__ import annotations

import json
import time

from fsdpfn.app.recipes.runtime import RunContext, log
from fsdpfn.rollout.balance import Balancer, generate_balanced
from fsdpfn.validators import derived_seed

__all__ = ["build_rollout", "SyncRollout", "StreamRollout", "max_new_tokens", "sampling",
           "score", "server_stats"]

# of rollout.sampling, what the greedy eval takes too: where an answer ends
ENDS = ("stop", "min_new_tokens", "ignore_eos", "no_stop_trim", "skip_special_tokens")


def max_new_tokens(cfg) -> int:
    return cfg.data.max_response_tokens if cfg.data.from_files else cfg.task.max_answer_tokens


def sampling(cfg, tok, *, greedy: bool = False) -> dict:
    """The sampling parameters of a generation request: the recipe's own (the answer length,
    rollout.temperature and top_p, the tokenizer's stop ids) and rollout.sampling's (its
    stop_token_ids added to the tokenizer's). ``greedy`` (the held-out eval): temperature 0
    and, of rollout.sampling, only what decides where an answer ends (ENDS)."""
    extra = dict(cfg.rollout.sampling)
    stops = list(dict.fromkeys([*tok.stop_ids, *map(int, extra.pop("stop_token_ids", ()))]))
    if greedy:
        return {"max_new_tokens": max_new_tokens(cfg), "temperature": 0.0,
                "stop_token_ids": stops, **{k: v for k, v in extra.items() if k in ENDS}}
    return {"max_new_tokens": max_new_tokens(cfg), "temperature": cfg.rollout.temperature,
            "top_p": cfg.rollout.top_p, "stop_token_ids": stops, **extra}


def _prompt_text(example) -> str:
    """What the reward sees as the prompt: the dataset's string, or the last user turn."""
    prompt = example.get("prompt")
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt or () if m.get("role") == "user"]
    return users[-1] if users else ""


def score(pool, tok, examples: list[dict], outputs: list[dict], group: int):
    """Rewards of the completions (outputs[i] answers examples[i // group])."""
    rows = [examples[i // group] for i in range(len(outputs))]
    return pool.score([_prompt_text(e) for e in rows],
                      [tok.decode(o["output_ids"]) for o in outputs],
                      answers=[e.get("answer") for e in rows],
                      samples=[e.get("sample") or {} for e in rows])


def record_errors(ctx: RunContext, step: int, result) -> None:
    with open(ctx.run_dir / "reward_errors.jsonl", "a") as fh:
        for e in result.errors:
            fh.write(json.dumps({"step": step, "index": e.index, "kind": e.kind,
                                 "message": e.message, "prompt": e.prompt,
                                 "completion": e.completion}) + "\n")


def _generation_stats(prompts, outputs, seconds) -> dict:
    lengths = [len(o["output_ids"]) for o in outputs]
    return {"generate_seconds": seconds,
            "response_len_mean": sum(lengths) / len(lengths),
            "response_len_max": max(lengths),
            "response_clip_frac": sum(o.get("finish_reason") == "length"
                                      for o in outputs) / len(outputs),
            "prompt_len_mean": sum(map(len, prompts)) / len(prompts),
            "generated_tokens": sum(lengths)}


def server_stats(urls: list[str], where: list[str], sizes: list[int]) -> dict:
    """Per-server rows and generated tokens of a step: ``where[i]`` answered the i-th sample
    (or episode), which has ``sizes[i]`` generated tokens (module doc)."""
    rows = {u: 0 for u in urls}
    tokens = {u: 0 for u in urls}
    for url, size in zip(where, sizes):
        rows[url] += 1
        tokens[url] += size
    out = {"rollout_servers": len(urls)}
    for i, url in enumerate(urls):
        out[f"rollout_rows_server{i}"] = rows[url]
        out[f"rollout_tokens_server{i}"] = tokens[url]
    mean = sum(tokens.values()) / len(urls)
    out["rollout_load_imbalance"] = max(tokens.values()) / mean if mean else 1.0
    return out


def _scored_batch(cfg, ctx, tok, pool, step, examples, outputs, seconds) -> dict:
    """The public batch of generated groups, scored on this thread by the reward pool."""
    from fsdpfn.batch.rows import rollout_batch

    G = cfg.advantage.group_size
    result = score(pool, tok, examples, outputs, G)
    if result.errors:
        log(f"step {step}: {result.summary()}")
        record_errors(ctx, step, result)
    prompts = [e["prompt_ids"] for e in examples]
    return {"batch": rollout_batch(prompts, outputs, G, result.rewards).to_dict(),
            "stats": {**_generation_stats(prompts, outputs, seconds), **result.metrics()}}


class SyncRollout:
    """The step's prompts in one request after the previous push (module doc)."""

    def __init__(self, cfg, ctx: RunContext, tok, source, pool):
        self.cfg, self.ctx, self.tok, self.source, self.pool = cfg, ctx, tok, source, pool
        self.balancer = Balancer(ctx.rollout_urls)

    def step(self, step: int, cursor: int) -> dict:
        cfg = self.cfg
        G = cfg.advantage.group_size
        examples = self.source.take(cursor, cfg.prompts_per_step)
        t0 = time.perf_counter()
        answer = generate_balanced(
            self.balancer, [e["prompt_ids"] for e in examples], n=G,
            seed=derived_seed(cfg.seed, step), timeout=cfg.rollout.timeout_s,
            **sampling(cfg, self.tok))
        out = _scored_batch(cfg, self.ctx, self.tok, self.pool, step, examples,
                            answer["outputs"], time.perf_counter() - t0)
        out["stats"].update(data_first=cursor, data_last=cursor + len(examples) - 1)
        out["stats"].update(server_stats(
            self.balancer.urls, [u for u in answer["servers"] for _ in range(G)],
            [len(o["output_ids"]) for o in answer["outputs"]]))
        return {**out, "served_version": answer["weight_version"], "advantages_done": False}

    def advance(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass


def _episode_stats(results, batch_stats, seconds) -> dict:
    sampled = [sum(len(t.output_ids) for t in r.turns) for r in results]
    return {"generate_seconds": seconds, "response_len_mean": sum(sampled) / len(sampled),
            "response_len_max": max(sampled), "generated_tokens": sum(sampled),
            "episode_reward_mean": sum(r.reward for r in results) / len(results),
            **batch_stats}


def _max_positions(cfg, ctx: RunContext) -> int:
    """The model's max_position_embeddings (the longest row it can be trained on)."""
    from fsdpfn.app.recipes.model import initial_model_dir, text_model_config

    config = text_model_config(initial_model_dir(cfg.model, ctx.run_dir))
    return int(config.get("max_position_embeddings") or 2048)


class StreamRollout:
    """Generation (or episodes) running up to max_staleness steps ahead (module doc)."""

    def __init__(self, cfg, ctx: RunContext, tok, source, pool, *, cursor: int, version: int,
                 steps: int):
        from fsdpfn.app.recipes.workflow import load_workflow, run_episodes
        from fsdpfn.rollout.stream import RolloutStream

        self.cfg, self.ctx, self.tok, self.source, self.pool = cfg, ctx, tok, source, pool
        G, r = cfg.advantage.group_size, cfg.rollout
        self.workflow = load_workflow(r.workflow) if r.workflow else None
        self.max_episode_tokens = r.max_episode_tokens or _max_positions(cfg, ctx)
        runner = None
        if self.workflow is not None:
            def runner(url, first, rows):
                results = run_episodes(url, self.workflow, rows, G, first=first,
                                       timeout_s=r.workflow_timeout_s,
                                       on_error=cfg.reward.on_error, seed=cfg.seed)
                return [results[i * G:(i + 1) * G] for i in range(len(rows))]

        def item(i):
            example = source.take(i, 1)[0]
            return example if runner else example["prompt_ids"]

        self.stream = RolloutStream(
            ctx.rollout_urls, item, group_size=G, groups_per_step=cfg.prompts_per_step,
            max_staleness=r.max_staleness, start=cursor, version=version, seed=cfg.seed,
            runner=runner, sampling={**sampling(cfg, tok), "timeout": r.timeout_s},
            steps=steps)
        self.balancer = self.stream.balancer

    def step(self, step: int, cursor: int) -> dict:
        got = self.stream.next_batch(timeout=self.cfg.rollout.timeout_s * 10)
        seconds = got.stats["trainer_wait_seconds"]
        versions = [g.oldest_version for g in got.groups if g.oldest_version is not None]
        served = min(versions) if versions else got.version
        got.stats.update(data_first=got.groups[0].index, data_last=got.groups[-1].index)
        got.stats.update(server_stats(
            self.balancer.urls, [g.server for g in got.groups for _ in g.outputs],
            [_generated(o) for g in got.groups for o in g.outputs]))
        if self.workflow is None:
            examples = self.source.take(got.groups[0].index, len(got.groups))
            outputs = [o for g in got.groups for o in g.outputs]
            out = _scored_batch(self.cfg, self.ctx, self.tok, self.pool, step, examples,
                                outputs, seconds)
            return {**out, "served_version": served, "advantages_done": False,
                    "stats": {**out["stats"], **got.stats}}
        return self._episodes(step, got, served, seconds)

    def _episodes(self, step, got, served, seconds) -> dict:
        from fsdpfn.app.recipes.workflow import check_episodes, episodes_batch

        cfg = self.cfg
        results = [r for g in got.groups for r in g.outputs]
        failed = [r for r in results if r.error is not None]
        for r in failed[:3]:
            log(f"step {step}: {self.workflow.spec}: episode of {r.where}: {r.error}")
        if len(failed) > 3:
            log(f"step {step}: {self.workflow.spec}: {len(failed) - 3} more failed episodes "
                f"(episode_errors in metrics.jsonl)")
        check_episodes(results, self.workflow.spec, cfg.ppo.temperature)
        batch, stats = episodes_batch(results, cfg.advantage.group_size,
                                      max_tokens=self.max_episode_tokens,
                                      estimator=cfg.advantage.estimator,
                                      eps=cfg.advantage.eps)
        if stats["episode_rows_dropped"]:
            log(f"step {step}: {stats['episode_rows_dropped']} episode rows longer than "
                f"rollout.max_episode_tokens={self.max_episode_tokens} dropped")
        return {"batch": None if batch is None else batch.to_dict(), "served_version": served,
                "advantages_done": True,
                "stats": {**_episode_stats(results, stats, seconds), **got.stats}}

    def advance(self, version: int) -> None:
        self.stream.advance(version)

    def close(self) -> None:
        self.stream.close()


def _generated(output) -> int:
    """Tokens a server generated for one sample or episode (every turn's)."""
    if isinstance(output, dict):
        return len(output.get("output_ids") or ())
    return sum(len(t.output_ids) for t in getattr(output, "turns", ()))


def build_rollout(cfg, ctx: RunContext, tok, source, pool, *, cursor: int, version: int,
                  steps: int):
    """Rank 0's rollout producer for the run's settings (module doc); ``steps``: the steps
    left to train (the stream generates nothing past the last)."""
    if cfg.rollout.max_staleness == 0 and not cfg.rollout.workflow:
        return SyncRollout(cfg, ctx, tok, source, pool)
    return StreamRollout(cfg, ctx, tok, source, pool, cursor=cursor, version=version,
                         steps=steps)
