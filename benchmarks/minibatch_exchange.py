"""What cutting several minibatches from the global batch costs: the exchange of the ranks' rows
(fsdpfn.batch.global_batch, one all_gather of each rank's batch on the CPU) and the cut with its
balancing over the ranks, against nothing (one minibatch runs each rank's own rows).

    torchrun --nproc-per-node 2 benchmarks/minibatch_exchange.py              # gloo, CPU
    torchrun --nproc-per-node 2 benchmarks/minibatch_exchange.py --rows 512 --width 4096

Each rank holds --rows / dp rows of an RL batch right-padded to --width (lognormal lengths, mean
--width / 4): input_ids, the masks, rewards, old_logp, ref_logp, behav_logp and advantages, as
ppo_step reads them. Times are the median of --repeats calls of the same path grad_step takes
(``fsdpfn.engine.minibatch.minibatches``). Prints one Markdown table (rank 0).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.engine.minibatch import minibatches

try:
    from _table import print_markdown_table
except ImportError:  # run as a module
    from benchmarks._table import print_markdown_table


class _Shell:
    """What minibatches reads of a state: its mesh."""

    def __init__(self, mesh):
        self.mesh = mesh


def _local_batch(rows: int, width: int, seed: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.exp(torch.randn(rows, generator=g) * 0.6).mul(width / 4).clamp(16, width).long()
    attn = torch.arange(width)[None] < lens[:, None]
    loss = attn.clone()
    loss[:, :8] = False
    data = {K.INPUT_IDS: torch.randint(0, 150_000, (rows, width), generator=g) * attn,
            K.ATTENTION_MASK: attn, K.LOSS_MASK: loss, K.REWARDS: torch.rand(rows, generator=g)}
    for key in (K.OLD_LOGP, K.REF_LOGP, K.BEHAV_LOGP, K.ADVANTAGES):
        data[key] = torch.randn(rows, width, generator=g) * loss
    return TensorDict(data, batch_size=[rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512, help="rows of the global batch")
    parser.add_argument("--width", type=int, default=2048, help="padded width T")
    parser.add_argument("--minibatches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    shell = _Shell(mesh)
    local = _local_batch(args.rows // mesh.dp, args.width, seed=mesh.rank("dp"))
    mb = sum(v.numel() * v.element_size() for v in local.values()) / 2**20
    rows = []
    for n in args.minibatches:
        times = []
        for _ in range(args.repeats):
            torch.distributed.barrier()
            start = time.perf_counter()
            parts = minibatches(shell, local, n, group_size=1, order=None, shuffle_seed=None,
                                 fn_name="ppo_step")
            times.append(time.perf_counter() - start)
        rows.append({"minibatches": n, "dp": mesh.dp, "rows (global)": args.rows,
                     "width": args.width, "MiB a rank": f"{mb:.1f}",
                     "rows a rank, per minibatch": "/".join(str(p.batch_size[0]) for p in parts),
                     "ms (median)": f"{1e3 * statistics.median(times):.1f}"})
    if mesh.rank("dp") == 0:
        print_markdown_table(rows, ("minibatches",))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
