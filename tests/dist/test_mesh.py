"""build_mesh: every factorisation of world sizes 1..4 builds; bad ones print the arithmetic."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

import fsdpfn as ff
from fsdpfn.engine.mesh import resolve_strategy
from fsdpfn.testing import SpmdPool


def _factorisations(world: int):
    for dp, cp, tp in itertools.product(range(1, world + 1), repeat=3):
        if dp * cp * tp == world:
            yield dp, cp, tp


def build_all(world: int):
    out = []
    for dp, cp, tp in _factorisations(world):
        for strategy in (ff.ParallelStrategy(dp=dp, cp=cp, tp=tp),
                         ff.ParallelStrategy(dp=-1, cp=cp, tp=tp)):
            mesh = ff.build_mesh(strategy, device_type="cpu")
            out.append(((mesh.dp, mesh.cp, mesh.tp), tuple(mesh.device_mesh.shape),
                        (mesh.rank("dp"), mesh.rank("cp"), mesh.rank("tp")),
                        mesh.fsdp_mesh.size(), dist.get_world_size(mesh.group("tp"))))
    return out


def bad_mesh(world: int):
    messages = []
    for strategy in (ff.ParallelStrategy(dp=world + 1), ff.ParallelStrategy(dp=-1, tp=world + 1)):
        try:
            ff.build_mesh(strategy, device_type="cpu")
            messages.append(None)
        except ff.ConfigError as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_factorisation_builds(world, spmd1, spmd2, spmd4):
    pools = {1: spmd1, 2: spmd2, 4: spmd4}
    if world in pools:
        results = pools[world].run(build_all, args=(world,), timeout=120)
    else:
        with SpmdPool(world) as pool:
            results = pool.run(build_all, args=(world,), timeout=120)
    expected = list(_factorisations(world))
    for rank, res in enumerate(results):
        assert [r[0] for r in res[::2]] == expected
        assert [r[0] for r in res[1::2]] == expected  # dp=-1 resolves to the same shape
        for (dp, cp, tp), shape, coords, fsdp_size, tp_size in res:
            assert shape == (dp, cp, tp) and fsdp_size == dp * cp and tp_size == tp
            # row-major coordinates: rank = (d * cp + c) * tp + t
            d, c, t = coords
            assert (d * cp + c) * tp + t == rank


@pytest.mark.timeout(120)
def test_invalid_strategies_print_the_arithmetic(spmd2):
    for messages in spmd2.run(bad_mesh, args=(2,), timeout=60):
        assert messages[0] == ("ParallelStrategy: dp x cp x tp = 3 x 1 x 1 = 3, but the world "
                               "size is 2; set dp=-1 to use whatever is left")
        assert "dp=-1 takes world_size / (cp x tp) = 2 / (1 x 3)" in messages[1]


def test_resolve_strategy_arithmetic():
    assert resolve_strategy(ff.ParallelStrategy(dp=-1, tp=2), 8).dp == 4
    assert resolve_strategy(ff.ParallelStrategy(dp=2, cp=2, tp=2), 8).dp == 2
    with pytest.raises(ff.ConfigError, match=r"dp x cp x tp = 2 x 1 x 2 = 4, but the world size "
                                             r"is 8"):
        resolve_strategy(ff.ParallelStrategy(dp=2, tp=2), 8)
    with pytest.raises(ff.ConfigError, match=r"= 6 / \(1 x 4\), which is not a whole number"):
        resolve_strategy(ff.ParallelStrategy(tp=4), 6)
    with pytest.raises(ff.ConfigError, match="tp: must be >= 1, got 0"):
        ff.ParallelStrategy(tp=0)


def _group_count():
    from fsdpfn.testing.spmd import _groups

    ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    return len(_groups())


@pytest.mark.timeout(180)
def test_pool_restarts_ranks_that_pile_up_process_groups():
    """Each build_mesh leaves process groups (gloo: two polling threads each; a test session's
    thousand of them held a CI host's two cores in system time): a pool restarts its ranks once
    a call leaves more than max_groups, and the next call starts from none."""
    with SpmdPool(2, max_groups=3) as pool:
        counts = [pool.run(_group_count, timeout=60)[0] for _ in range(3)]
        assert counts[1] > counts[0] > 0  # groups pile up on live ranks
        assert counts[1] > 3 and pool.restarts == 1 and counts[2] == counts[0], counts


def _rank1_waits_forever():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        _waiting_here_on_purpose()
    return dist.get_rank()


def _waiting_here_on_purpose():
    import threading

    threading.Event().wait()


@pytest.mark.timeout(120)
def test_a_rank_past_its_timeout_is_reported_with_its_stack():
    """A hang is diagnosable from the failure alone: the timeout names the rank still running
    and prints where each of its threads waits."""
    from fsdpfn.testing.spmd import SpmdTimeout

    with SpmdPool(2) as pool:
        with pytest.raises(SpmdTimeout) as caught:
            pool.run(_rank1_waits_forever, timeout=5)
    message = str(caught.value)
    assert "ranks [1] did not finish within 5 s" in message, message
    assert "rank 1, still running; its threads" in message, message
    assert "_waiting_here_on_purpose" in message and "_rank1_waits_forever" in message, message


def _world_size():
    return dist.get_world_size()


@pytest.mark.timeout(120)
def test_ranks_start_again_on_a_fresh_port_when_theirs_was_taken(monkeypatch):
    """A port free when chosen can be bound by another test's process before rank 0 binds it
    (EADDRINUSE): the pool starts its ranks again on a fresh port instead of failing."""
    import socket

    from fsdpfn.testing import spmd
    from fsdpfn.wire.ports import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        first = [taken.getsockname()[1]]  # the first choice: in use when rank 0 binds it
        monkeypatch.setattr(spmd, "free_port", lambda: first.pop() if first else free_port())
        with SpmdPool(2, start_timeout=60) as pool:
            assert pool.run(_world_size, timeout=60) == [2, 2]
        assert not first  # the taken port was tried first
