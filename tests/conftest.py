"""Shared fixtures: long-lived CPU rank pools (gloo), one per world size, reused across tests."""

from __future__ import annotations

import os

import pytest

from fsdpfn.testing import SpmdPool

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _pool(world_size: int):
    pool = SpmdPool(world_size, pg_timeout=120.0)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def spmd1():
    yield from _pool(1)


@pytest.fixture(scope="session")
def spmd2():
    yield from _pool(2)


@pytest.fixture(scope="session")
def spmd4():
    yield from _pool(4)
