"""fsdpfn.wire.lifeline.freeze_long_lived: what is alive when a long-running process of ours has set
up leaves the collector's reach, what was already garbage is freed first, and what comes later
is collected as before."""

from __future__ import annotations

import gc
import weakref

import pytest

from fsdpfn.wire.lifeline import freeze_long_lived


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def unfrozen():
    """No automatic collection inside the test (it would free the garbage the freeze's own
    collection must free), and nothing frozen before or after it."""
    gc.unfreeze()
    gc.disable()
    yield
    gc.enable()
    gc.unfreeze()  # the permanent generation back to the collector for the tests after this


def test_garbage_before_is_freed_what_lives_is_frozen_and_later_garbage_is_collected(unfrozen):
    dead = weakref.ref(_Node())  # cyclic garbage already: freed by the collection first
    frozen_before = gc.get_freeze_count()
    freeze_long_lived()
    assert dead() is None
    assert gc.get_freeze_count() > frozen_before
    later = weakref.ref(_Node())
    assert later() is not None  # a cycle: not freed by reference counting
    gc.collect()
    assert later() is None  # objects made after the freeze are collected as before


def test_a_full_collection_after_the_freeze_walks_only_what_came_later(unfrozen):
    keep = [_Node() for _ in range(50_000)]  # a setup's long-lived objects
    tracked = len(gc.get_objects())
    freeze_long_lived()
    assert len(gc.get_objects()) < tracked - 50_000  # out of every generation the collector walks
    assert all(n.me is n for n in keep)  # frozen, not freed
