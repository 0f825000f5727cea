"""The preflight's GPU memory: what other processes already hold on the run's GPUs is taken off
the capacity the run's estimate is held against, and named. Before, the estimate was held
against each GPU's total, so a run on a GPU that another job held started and ran out of memory
minutes later. nvidia-smi's lines are given as text here (its exact output format); the GPU
test (tests/e2e/test_memory_gpu.py) holds memory in another process on a real GPU."""

from __future__ import annotations

import pytest

from fsdpfn.app.recipes import default_config
from fsdpfn.app.recipes.gpu_memory import Gpu, cuda_order, parse_gpus, trainer_capacity
from fsdpfn.app.recipes.memory import HEADROOM, ModelShape, check_memory, run_estimate
from fsdpfn.errors import ConfigError

GiB = 2 ** 30
SMI = ("0, GPU-aaaa1111-0000, 81559, 4\n"
       "1, GPU-bbbb2222-0000, 81559, 61440\n"
       "2, GPU-cccc3333-0000, 81559, [N/A]\n")


def test_nvidia_smi_lines_are_read_in_bytes():
    gpus = parse_gpus(SMI + "garbage line\n3, GPU-x, [N/A], 5\n")
    assert gpus == [Gpu(0, "GPU-aaaa1111-0000", 81559 * 2 ** 20, 4 * 2 ** 20),
                    Gpu(1, "GPU-bbbb2222-0000", 81559 * 2 ** 20, 61440 * 2 ** 20),
                    Gpu(2, "GPU-cccc3333-0000", 81559 * 2 ** 20, 0.0)]


@pytest.mark.parametrize("visible, indices", [
    (None, [0, 1, 2]),
    ("2,0", [2, 0]),
    ("GPU-bbbb,0", [1, 0]),          # a UUID prefix, as CUDA takes it
    ("1,7,0", [1]),                  # CUDA stops at the first entry that names no GPU
    ("0,0", [0]),                    # ... or one named twice
    ("", []),
])
def test_the_visible_gpus_follow_cuda_visible_devices(visible, indices):
    assert [g.index for g in cuda_order(parse_gpus(SMI), visible)] == indices


def test_a_mig_instance_leaves_the_figures_unknown():
    assert cuda_order(parse_gpus(SMI), "MIG-1234") is None


def test_capacity_is_the_fullest_trainer_gpus_free_memory_and_the_busy_ones_are_named():
    gpus = parse_gpus(SMI)
    capacity, said = trainer_capacity(gpus, (0,))
    assert capacity == (81559 - 4) * 2 ** 20 and said == ""  # 4 MiB: not worth a word
    capacity, said = trainer_capacity(gpus, (0, 1))
    assert capacity == (81559 - 61440) * 2 ** 20
    assert said == "in use by other processes (nvidia-smi): GPU 1: 60.0 of 79.6 GiB"
    capacity, said = trainer_capacity(gpus, (0,), others=(1,))  # the server's GPU: named only
    assert capacity == (81559 - 4) * 2 ** 20 and "GPU 1: 60.0 of 79.6 GiB" in said


def test_a_run_that_fits_the_total_but_not_what_is_free_is_refused_naming_the_gpu():
    shape = ModelShape(hidden=1536, intermediate=8960, layers=28, vocab=151936, heads=12,
                       kv_heads=2, head_dim=128, tied=True)
    cfg = default_config("sft", [])
    need = run_estimate(cfg, shape, n_gpus=1, shared=False)["total"]
    total = 2 * need / HEADROOM
    gpus = [Gpu(0, "GPU-a", total, total - need)]   # another process holds all but `need`
    capacity, busy = trainer_capacity(gpus, (0,))
    assert check_memory(cfg, shape, n_gpus=1, capacity=total)  # the total alone: it fits
    with pytest.raises(ConfigError) as info:
        check_memory(cfg, shape, n_gpus=1, capacity=capacity, busy=busy)
    msg = str(info.value)
    assert msg.startswith("engine: the run does not fit one GPU, memory estimate per GPU: ")
    assert f"GiB of {need / GiB:.1f} GiB free (" in msg and "in use by other processes " \
        f"(nvidia-smi): GPU 0: {(total - need) / GiB:.1f} of {total / GiB:.1f} GiB" in msg
    assert msg.endswith("(or free the GPUs that other processes hold)")
