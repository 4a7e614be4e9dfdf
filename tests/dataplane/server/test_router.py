"""The A/B router: pure functions, checked statistically and for consistent-hashing movement."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from modelfleet.dataplane.manifest import Routing, ServedModel, ServedVersion
from modelfleet.dataplane.server.router import (
    RouteError,
    RoutingTable,
    route,
    split_model_field,
    sticky_choice,
    sticky_key,
)


def table(
    weights: dict[str, int], *, sticky: str = "none", shadow: dict[str, int] | None = None
) -> RoutingTable:
    shadow = shadow or {}
    versions = [
        ServedVersion(name=name, weight=w, artifact=f"/m/{name}", shadow_percent=shadow.get(name, 0))
        for name, w in weights.items()
    ]
    return RoutingTable.from_model(
        ServedModel(name="chat", versions=versions, routing=Routing(stickyBy=sticky))
    )


def within(count: int, n: int, p: float, sigmas: float = 4.5) -> bool:
    """Binomial count within `sigmas` standard deviations of n*p (fails by chance ~1e-5)."""
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_split_model_field():
    assert split_model_field("chat") == ("chat", None)
    assert split_model_field("chat@v2") == ("chat", "v2")
    assert split_model_field("org/chat@v2") == ("org/chat", "v2")


@pytest.mark.parametrize("weights", [{"a": 50, "b": 50}, {"a": 90, "b": 10}, {"a": 20, "b": 30, "c": 50}])
def test_weighted_split_matches_weights(weights):
    n = 5000
    rng = random.Random()  # unseeded on purpose: the bounds must hold for any run
    counts = Counter(route(table(weights), rng=rng).version for _ in range(n))
    for name, w in weights.items():
        assert within(counts[name], n, w / 100), (name, counts)


def test_zero_weight_version_gets_no_traffic_but_can_be_pinned():
    t = table({"a": 100, "b": 0})
    assert {route(t).version for _ in range(2000)} == {"a"}
    decision = route(t, pinned="b")
    assert (decision.version, decision.reason) == ("b", "pin")


def test_all_zero_weights_refuse_unless_pinned():
    t = table({"a": 0, "b": 0})
    with pytest.raises(RouteError) as info:
        route(t)
    assert info.value.status == 503
    assert "pin one with 'model@version'" in str(info.value)
    assert route(t, pinned="a").version == "a"


def test_unknown_pin_is_404_listing_versions():
    with pytest.raises(RouteError, match="no version 'zz'; known versions: a, b") as info:
        route(table({"a": 50, "b": 50}), pinned="zz")
    assert info.value.status == 404
    assert info.value.code == "model_not_found"


def test_sticky_key_is_stable_and_split_by_weight():
    t = table({"a": 70, "b": 30}, sticky="user")
    keys = [f"user-{i}" for i in range(4000)]
    first = {k: route(t, key=k).version for k in keys}
    assert all(route(t, key=k, rng=random.Random(i)).version == first[k] for i, k in enumerate(keys[:500]))
    assert all(route(t, key=k).reason == "sticky" for k in keys[:10])
    assert within(sum(v == "a" for v in first.values()), len(keys), 0.7)


def moved_fraction(before: RoutingTable, after: RoutingTable, keys: list[str]) -> tuple[float, Counter]:
    moves = Counter()
    for k in keys:
        old, new = sticky_choice(before, k), sticky_choice(after, k)
        if old != new:
            moves[(old, new)] += 1
    return sum(moves.values()) / len(keys), moves


def test_weight_change_moves_only_the_needed_keys_between_two_versions():
    keys = [f"session-{i}" for i in range(10000)]
    fraction, moves = moved_fraction(table({"a": 50, "b": 50}), table({"a": 60, "b": 40}), keys)
    # The minimum possible is the weight difference (10%); every move goes from b to a.
    assert set(moves) == {("b", "a")}
    assert abs(fraction - 0.10) < 0.015


def test_weight_change_with_three_versions_moves_few_keys():
    keys = [f"k{i}" for i in range(10000)]
    fraction, moves = moved_fraction(
        table({"a": 40, "b": 30, "c": 30}), table({"a": 40, "b": 40, "c": 20}), keys
    )
    # Minimum is 10% (c -> b). Rendezvous hashing moves ~13.5%, far below a re-shuffle (~66%); no key
    # moves to the version that shrank, and none leaves the one that grew.
    assert 0.09 < fraction < 0.16, fraction
    assert all(new != "c" and old != "b" for (old, new) in moves)


def test_adding_a_canary_only_takes_keys_for_itself():
    keys = [f"k{i}" for i in range(10000)]
    _, moves = moved_fraction(table({"a": 100, "b": 0}), table({"a": 95, "b": 5}), keys)
    assert set(moves) == {("a", "b")}
    assert within(moves[("a", "b")], len(keys), 0.05)


def test_sticky_key_sources():
    by_user = table({"a": 100}, sticky="user")
    by_header = table({"a": 100}, sticky="header:X-Session-Id")
    plain = table({"a": 100})
    assert sticky_key(by_user, user="alice", headers={}) == "alice"
    assert sticky_key(by_user, user=None, headers={}) is None
    assert sticky_key(by_header, user="alice", headers={"x-session-id": "s1"}) == "s1"
    assert sticky_key(by_header, user="alice", headers={}) is None
    assert sticky_key(plain, user="alice", headers={"x-session-id": "s1"}) is None


def test_shadow_share_and_never_to_the_primary():
    t = table({"a": 100, "b": 0}, shadow={"b": 20})
    n = 5000
    decisions = [route(t) for _ in range(n)]
    assert within(sum("b" in d.shadows for d in decisions), n, 0.2)
    pinned = [route(t, pinned="b") for _ in range(200)]
    assert all(d.shadows == () for d in pinned)


def test_long_version_names_with_a_common_prefix_hash_independently():
    a, b = "release-2026-11-22-candidate-a", "release-2026-11-22-candidate-b"
    t = table({a: 50, b: 50}, sticky="user")
    keys = [f"k{i}" for i in range(4000)]
    assert within(sum(sticky_choice(t, k) == a for k in keys), len(keys), 0.5)


class FixedDraws(random.Random):
    """An rng whose random() returns the given values in turn."""

    def __init__(self, *draws: float) -> None:
        super().__init__()
        self.draws = list(draws)

    def random(self) -> float:
        return self.draws.pop(0)


def test_weighted_interval_edges_belong_to_the_next_version():
    """Version i owns draws in [cumulative[i-1], cumulative[i]) / total: a zero-weight version owns none,
    not even its own edge."""
    from modelfleet.dataplane.server.router import weighted_choice

    t = table({"a": 50, "b": 50})
    assert [weighted_choice(t, d) for d in (0.0, 0.4999, 0.5, 0.9999)] == ["a", "a", "b", "b"]
    assert weighted_choice(table({"off": 0, "on": 100}), 0.0) == "on"
    assert weighted_choice(table({"a": 30, "off": 0, "c": 70}), 0.3) == "c"


def test_sticky_routing_never_picks_a_zero_weight_version():
    t = table({"off": 0, "on": 100}, sticky="user")
    assert {sticky_choice(t, f"user-{i}") for i in range(200)} == {"on"}
    with pytest.raises(RouteError) as info:
        sticky_choice(table({"a": 0, "b": 0}, sticky="user"), "alice")
    assert info.value.status == 503


def test_only_versions_with_a_shadow_share_are_shadows():
    t = table({"a": 50, "b": 50, "c": 0}, shadow={"c": 25})
    assert t.shadows == (("c", 25),)
    assert table({"a": 50, "b": 50}).shadows == ()


def test_shadow_share_is_half_open():
    """A copy goes to a shadow when 100 * draw < percent: a draw of exactly percent/100 sends none."""
    t = table({"a": 100, "b": 0}, shadow={"b": 25})
    assert route(t, rng=FixedDraws(0.0, 0.2499)).shadows == ("b",)
    assert route(t, rng=FixedDraws(0.0, 0.25)).shadows == ()


def test_a_header_name_without_header_stickiness_is_ignored():
    plain = RoutingTable(
        model="chat",
        versions=("a",),
        weights=(100,),
        cumulative=(100,),
        sticky_kind="none",
        sticky_header="x-session-id",
        shadows=(),
        salts=(b"a",),
    )
    assert sticky_key(plain, user="alice", headers={"x-session-id": "s1"}) is None


def test_weights_and_shares_of_one_count():
    """A weight or shadow share of 1 is traffic like any other (the limits are "more than 0")."""
    assert table({"a": 100, "b": 0}, shadow={"b": 1}).shadows == (("b", 1),)
    t = table({"a": 1, "b": 99}, sticky="user")
    # 3,000 users: none of them on "a" has a chance of 0.99 ** 3000, about 1e-13.
    assert "a" in {sticky_choice(t, f"user-{i}") for i in range(3000)}


def test_a_draw_of_one_goes_to_the_last_version():
    """The guard for a draw whose product with the total rounds up to the last edge."""
    from modelfleet.dataplane.server.router import weighted_choice

    assert weighted_choice(table({"a": 20, "b": 30, "c": 50}), 1.0) == "c"


def test_sticky_choices_are_the_same_in_every_release():
    """Replicas of two releases side by side (a rolling upgrade) must send a user to the same version:
    the hash is pinned here, so changing it (salt, digest size) shows as a test failure."""
    t = table({"a": 50, "b": 50}, sticky="user")
    assert "".join(sticky_choice(t, f"user-{i}") for i in range(24)) == "abbaabbbaabbbababaaabbaa"
