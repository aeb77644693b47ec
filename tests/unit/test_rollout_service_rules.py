"""Server mode's pure rules: routing, the submission gate, the replay buffer, dynamic sampling, replica health,
when a replacement joins."""

from __future__ import annotations

import pytest

from hybridflow.rollout.buffer import ReplayBuffer, informative, may_submit, staleness_histogram
from hybridflow.rollout.routing import RequestRouter
from hybridflow.rollout.service import replica_join, replica_verdict

pytestmark = pytest.mark.unit


# --------------------------------------------------------------------------- routing


def test_requests_go_to_the_replica_with_the_fewest_in_flight_tokens() -> None:
    router = RequestRouter([0, 1, 2])
    assert [router.route(f"r{i}", tokens) for i, tokens in enumerate([100, 10, 10, 5])] == [0, 1, 2, 1]
    assert [router.in_flight_tokens(r) for r in (0, 1, 2)] == [100, 15, 10]
    router.finished("r0")  # replica 0 is free again: the least loaded
    assert router.route("r4", 1) == 0


def test_a_session_stays_on_its_replica_until_it_leaves_the_routing() -> None:
    router = RequestRouter([0, 1])
    first = router.route("turn1", 50, session_id="s")
    router.route("other", 10)  # the other replica now has less load...
    assert router.route("turn2", 50, session_id="s") == first  # ...but the session keeps its replica
    reopened = router.remove(first)
    assert sorted(map(str, reopened)) == ["turn1", "turn2"]
    assert router.route("turn3", 50, session_id="s") != first


def test_a_removed_replica_hands_back_its_open_requests_and_a_new_one_joins_empty() -> None:
    router = RequestRouter([0, 1])
    for i in range(4):
        router.route(f"r{i}", 10)
    assert sorted(map(str, router.remove(1))) == ["r1", "r3"]
    assert router.replicas == [0]
    router.add(1)
    assert router.in_flight_tokens(1) == 0 and router.route("r9", 1) == 1
    with pytest.raises(ValueError, match="routed already"):
        router.route("r0", 1)
    with pytest.raises(ValueError, match="in the routing already"):
        router.add(0)
    with pytest.raises(RuntimeError, match="no rollout replica"):
        RequestRouter([]).route("x", 1)


# --------------------------------------------------------------------------- the gate and the buffer


@pytest.mark.parametrize(
    ("staleness", "version", "expected"),
    [(0, 0, 4), (0, 3, 16), (2, 0, 12), (2, 5, 32)],
)
def test_the_gate_allows_k_steps_ahead_of_the_trainer(staleness: int, version: int, expected: int) -> None:
    """At most (v + 1 + k) * B groups accepted or on the way: with k = 0, exactly the next step's batch."""
    allowed = 0
    while may_submit(
        accepted_or_on_the_way=allowed, trainer_version=version, max_staleness=staleness, groups_per_step=4
    ):
        allowed += 1
    assert allowed == expected


def test_a_step_takes_the_oldest_groups_and_drops_the_ones_past_the_bound() -> None:
    buffer: ReplayBuffer[str] = ReplayBuffer(max_staleness=2)
    for name, oldest in [("a", 3), ("b", 1), ("c", 3), ("d", 0), ("e", 2)]:
        buffer.put(name, oldest_version=oldest, newest_version=oldest)
    assert buffer.ready(3, trainer_version=3)  # d (3 stale) is dropped by the check
    assert buffer.dropped_stale == 1
    taken = buffer.take(2, trainer_version=3)
    assert [g.payload for g in taken] == ["b", "e"]  # the oldest first
    assert [g.payload for g in buffer.groups] == ["a", "c"]  # the rest keep their arrival order
    with pytest.raises(RuntimeError, match="2 groups in the buffer, 3 asked for"):
        buffer.take(3, trainer_version=3)


def test_dynamic_sampling_keeps_groups_whose_rewards_differ() -> None:
    assert informative([0.0, 1.0, 1.0])
    assert not informative([1.0, 1.0, 1.0])
    assert not informative([0.5])
    assert not informative([0.2, 0.2 + 1e-9])


def test_the_staleness_histogram_counts_samples_and_refuses_a_broken_bound() -> None:
    metrics = staleness_histogram([0, 2, 2, 1], max_staleness=2)
    assert metrics == {
        "staleness/mean": 1.25,
        "staleness/max": 2.0,
        "staleness/samples/0": 1.0,
        "staleness/samples/1": 1.0,
        "staleness/samples/2": 2.0,
    }
    with pytest.raises(RuntimeError, match="3 updates stale"):
        staleness_histogram([3], max_staleness=2)


# --------------------------------------------------------------------------- replica health


def test_a_replica_is_replaced_when_silent_or_without_progress_while_it_has_work() -> None:
    def verdict(answer: float, progress: float, work: bool) -> str | None:
        return replica_verdict(
            now=100.0, last_answer_at=answer, last_progress_at=progress, has_work=work, timeout_seconds=30
        )

    assert verdict(99, 99, True) is None
    assert verdict(99, 10, False) is None  # idle for long, but it had nothing to do
    assert verdict(99, 60, True) == "produced no token for 40 s with work queued"
    assert verdict(60, 99, False) == "answered no poll for 40 s"


def test_a_replacement_joins_at_the_first_look_after_every_rank_loaded() -> None:
    """Asked at each step boundary (and while the controller waits): a t_g-2 replica whose ranks
    load at looks 2 and 3 joins at look 3, the one after which it serves, not at a later push."""

    def join(loaded: int, failed: bool = False, serving: bool = False) -> str:
        return replica_join(serving=serving, ranks=2, ranks_loaded=loaded, start_failed=failed)

    looks = [join(loaded) for loaded in (0, 1, 2, 2)]
    assert looks == ["loading", "loading", "join", "join"]
    assert looks.index("join") == 2  # the first look with both ranks loaded
    assert join(2, serving=True) == "serving"  # in the routing already: nothing to join
    # A rank that failed to start: started again at once, not after the other rank's load.
    assert join(1, failed=True) == "failed" and join(0, failed=True) == "failed"
    assert replica_join(serving=False, ranks=1, ranks_loaded=1, start_failed=False) == "join"
