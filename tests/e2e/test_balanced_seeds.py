"""A seeded batch over two real rollout servers (CPU processes, HF generate) draws the tokens one
server draws for it, however the batch is cut: by equal load, or all on the second server
because another caller holds work on the first."""

from __future__ import annotations

import pytest

from fsdpfn.rollout import generate, launch_server
from fsdpfn.rollout.balance import Balancer, generate_balanced
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config

pytestmark = pytest.mark.dist


@pytest.mark.timeout(300)
def test_a_seeded_batch_draws_the_same_tokens_on_one_server_or_two(tmp_path):
    model_dir = save_tiny_model(tmp_path / "tiny", tiny_qwen2_config(), seed=0)
    servers = [launch_server(str(model_dir), log_dir=tmp_path, health_timeout=120)
               for i in range(2)]
    try:
        urls = [s.url for s in servers]
        prompts = [[1 + i, 2, 3 + i] for i in range(6)]
        kw = dict(n=2, max_new_tokens=5, seed=31)
        one = [o["output_ids"] for o in generate(urls[0], prompts, **kw)["outputs"]]
        split = generate_balanced(urls, prompts, **kw)
        assert sorted(set(split["servers"])) == sorted(urls)  # the batch was cut in two
        assert [o["output_ids"] for o in split["outputs"]] == one
        busy = Balancer(urls)
        busy.plan([1e9])  # another caller's work on the first server
        moved = generate_balanced(busy, prompts, **kw)
        assert set(moved["servers"]) == {urls[1]}
        assert [o["output_ids"] for o in moved["outputs"]] == one
    finally:
        for s in servers:
            s.close()
