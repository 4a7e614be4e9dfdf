"""The serving heap kept out of the collector's full passes: what freeze leaves alone, what reclaim frees."""

from __future__ import annotations

import gc
import weakref

import pytest
from modelfleet.dataplane import heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture(autouse=True)
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_keeps_what_exists_out_of_collections_and_reclaim_frees_cycles_among_it():
    node = Node()
    gone = weakref.ref(node)
    assert heap.freeze() >= 1 and gc.is_tracked(node)
    del node
    gc.collect()
    assert gone() is not None, "a frozen cycle is left to reclaim"
    assert heap.reclaim() >= 1
    assert gone() is None
    assert gc.get_freeze_count() > 0, "what remains is frozen again"


def test_freeze_with_collect_freezes_no_garbage():
    node = Node()
    gone = weakref.ref(node)
    del node
    heap.freeze(collect=True)
    assert gone() is None


def test_objects_made_after_a_freeze_are_collected_as_ever():
    heap.freeze()
    node = Node()
    gone = weakref.ref(node)
    del node
    gc.collect()
    assert gone() is None
