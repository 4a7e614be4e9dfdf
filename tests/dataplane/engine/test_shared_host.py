"""Host memory the engine shares with its helper processes by name: where a tensor lies in it, and the
same bytes seen through a mapping by that name (as a grammar process maps a decode graph's mirror)."""

from __future__ import annotations

import torch
from modelfleet.dataplane.engine.shared_host import attach, place_of, shared_bytes


def test_a_view_of_shared_bytes_is_found_where_it_lies_and_seen_by_name():
    memory = shared_bytes(4096, pinned=False)
    words = memory[1024:].view(torch.int32)  # a view at an offset, as a packed mirror's last buffer
    place = place_of(words)
    assert place is not None and place.offset == 1024
    assert place_of(torch.zeros(4, dtype=torch.int32)) is None  # memory of its own
    mapped = attach(place.name)
    there = torch.frombuffer(mapped, dtype=torch.int32, count=8, offset=place.offset)
    there[:] = torch.arange(8, dtype=torch.int32)  # written through the name, read through the view
    assert words[:8].tolist() == list(range(8))
    words[0] = 42
    assert there[0] == 42
