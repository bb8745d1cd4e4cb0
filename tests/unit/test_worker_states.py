"""An async worker's life as one state machine (train/asynchronous/worker_states.py):
every legal move and every illegal one, what the server's loop reads kept right as
workers move, the worker's reading of rank 0's replies against the server's table, the
end-of-run cases fixed in it, and the diagram in docs/architecture.md against the table."""

import collections
import random
import re

import pytest

from conftest import REPO
from mpitrain.train.asynchronous.worker_states import (AWAITED, DISMISSED, DONE, LOST, PARKED,
                                                       RECALLED, TAKERS, TRAINING, TRANSITIONS,
                                                       IllegalMove, WorkerState, WorkerStates,
                                                       after_reply, diagram)
from mpitrain.train.protocol import DIVERGED, DROPPED, FINAL, INTERRUPTED
from mpitrain.train.protocol import PARKED as PARKED_FLAG

STATES = list(WorkerState)
LEGAL = [(a, b) for a in STATES for b in TRANSITIONS[a]]
ILLEGAL = [(a, b) for a in STATES for b in STATES if b not in TRANSITIONS[a]]


def path_to(state: WorkerState) -> list:
    """The shortest list of moves from TRAINING to ``state`` (breadth first)."""
    paths, queue = {TRAINING: []}, collections.deque([TRAINING])
    while queue:
        here = queue.popleft()
        for there in TRANSITIONS[here]:
            if there not in paths:
                paths[there] = paths[here] + [there]
                queue.append(there)
    return paths[state]


def states_at(state: WorkerState, ranks=(1, 2, 3), rank=2) -> WorkerStates:
    """Workers ``ranks``, all TRAINING but ``rank``, brought to ``state`` by legal moves."""
    states = WorkerStates(ranks)
    for step in path_to(state):
        states.move(rank, step)
    return states


def test_the_table_names_every_state_once_and_only_states():
    assert set(TRANSITIONS) == set(STATES)
    assert all(set(moves) <= set(STATES) for moves in TRANSITIONS.values())
    assert all(isinstance(event, str) and event for moves in TRANSITIONS.values()
               for event in moves.values())


def test_every_state_is_reached_and_every_worker_can_end():
    """Each state is reachable from the start, and from each one the worker can reach
    an end (DONE or LOST): no state keeps the server waiting for ever. LOST is the end
    of every road."""
    assert all(state is TRAINING or path_to(state) for state in STATES)
    for state in STATES:
        reach, todo = {state}, [state]
        while todo:
            for there in TRANSITIONS[todo.pop()]:
                if there not in reach:
                    reach.add(there)
                    todo.append(there)
        assert reach & {DONE, LOST}, state
    assert TRANSITIONS[LOST] == {}


@pytest.mark.parametrize("start,to", LEGAL, ids=[f"{a.name}->{b.name}" for a, b in LEGAL])
def test_every_legal_move(start, to):
    states = states_at(start)
    states.move(2, to)
    assert states.of == {1: TRAINING, 2: to, 3: TRAINING}
    assert states.awaited == 2 + (to in AWAITED)
    assert states.dismissed == ([2] if to is DISMISSED else [])
    assert states.history[2][-1] is to and states.was(2, start)


@pytest.mark.parametrize("start,to", ILLEGAL, ids=[f"{a.name}->{b.name}" for a, b in ILLEGAL])
def test_every_illegal_move_is_refused_and_changes_nothing(start, to):
    states = states_at(start)
    before = (dict(states.of), states.awaited, list(states.dismissed),
              list(states.history[2]))
    with pytest.raises(IllegalMove, match=f"rank 2: no move from {start.name} to {to.name}"):
        states.move(2, to)
    assert (states.of, states.awaited, states.dismissed, states.history[2]) == before


def test_what_the_server_reads_follows_every_walk():
    """Random walks of five workers along the table: the counts the server's loop reads
    (kept as workers move) are always what the states say."""
    rng = random.Random(52)
    for _ in range(200):
        states, order = WorkerStates(range(1, 6)), []
        for _ in range(30):
            rank = rng.randrange(1, 6)
            moves = list(TRANSITIONS[states.of[rank]])
            if not moves:
                continue
            to = rng.choice(moves)
            if to is DISMISSED and states.of[rank] is not DISMISSED:
                order.append(rank)
            elif states.of[rank] is DISMISSED and to is not DISMISSED:
                order.remove(rank)
            states.move(rank, to)
            assert states.awaited == sum(s in AWAITED for s in states.of.values())
            assert sorted(states.dismissed) == states.ranks(DISMISSED)
            assert states.dismissed == order  # (in the order they were dismissed)
            assert states.all_lost() == all(s is LOST for s in states.of.values())


def test_ranks_and_history():
    states = WorkerStates([3, 1, 2])
    states.move(1, DISMISSED)
    states.move(1, DISMISSED)  # (a push it had in flight: no change)
    states.move(1, DONE)
    states.move(2, PARKED)
    assert states.ranks(TRAINING) == [3] and states.ranks(*TAKERS) == [3, 2]
    assert states.ranks(DONE, PARKED) == [1, 2]
    assert states.history[1] == [TRAINING, DISMISSED, DONE]
    assert states.was(1, DISMISSED) and not states.was(2, DISMISSED)
    assert states.awaited == 1 and not states.all_lost()
    with pytest.raises(IllegalMove, match="TRAINING -> DISMISSED -> DONE"):
        states.move(1, PARKED)


def test_who_is_awaited_and_who_takes_a_lost_workers_steps():
    assert AWAITED == {TRAINING, RECALLED, DISMISSED}
    assert TAKERS == AWAITED | {PARKED}


# ---- the end-of-run cases that were fixed in this machine ----------------------------
def test_a_parked_worker_takes_a_lost_workers_steps():
    """973c8cd: rank 2 finishes while others train, is parked, and takes a share of
    lost rank 3's steps (the run made its planned updates). The server's books along
    the way: rank 2 is awaited again once recalled."""
    states = WorkerStates([1, 2, 3])
    states.move(2, PARKED)
    assert states.awaited == 2
    states.move(3, LOST)
    states.move(2, RECALLED)
    assert states.awaited == 2 and states.ranks(*AWAITED) == [1, 2]
    states.move(2, TRAINING)
    states.move(2, DONE)
    states.move(1, DONE)
    assert states.awaited == 0 and states.history[2] == [TRAINING, PARKED, RECALLED,
                                                         TRAINING, DONE]


def test_a_final_push_answered_parked_keeps_the_worker():
    """d579029 and 700acf8: a worker that waits for each reply took the PARKED reply to
    its FINAL push for its end and left, and every worker was lost when the steps came
    to it. PARKED after a FINAL push is PARKED; only FINAL ends it."""
    assert after_reply(PARKED_FLAG, pushed_final=True) is PARKED
    assert after_reply(FINAL, pushed_final=True) is DONE


def test_a_parked_worker_stopped_at_the_end_is_lost():
    """912cf1d: a parked worker holds no lease, so no liveness check covered it; given
    its final reply at the end but stopped on the server's host, it counts lost."""
    states = states_at(PARKED)
    states.move(2, DONE)
    states.move(2, LOST)
    assert states.history[2] == [TRAINING, PARKED, DONE, LOST]


# ---- the worker's side --------------------------------------------------------------
REPLIES = [(0, "a lease"), (PARKED_FLAG, "PARKED"), (FINAL, "FINAL"),
           (FINAL | INTERRUPTED, "FINAL|INTERRUPTED"), (FINAL | DIVERGED, "FINAL|DIVERGED"),
           (FINAL | DROPPED, "FINAL|DROPPED")]


@pytest.mark.parametrize("flags,expected", [
    (0, TRAINING), (PARKED_FLAG, PARKED), (FINAL, DONE), (FINAL | INTERRUPTED, DONE),
    (FINAL | DIVERGED, DONE), (FINAL | DROPPED, LOST), (DROPPED, LOST)])
def test_what_a_reply_to_a_final_push_means(flags, expected):
    assert after_reply(flags, pushed_final=True) is expected


@pytest.mark.parametrize("flags,expected", [
    (FINAL, DISMISSED), (FINAL | INTERRUPTED, DISMISSED), (FINAL | DIVERGED, DISMISSED),
    (FINAL | DROPPED, LOST), (DROPPED, LOST)])
def test_what_the_servers_word_means_to_a_worker_that_did_not_push_final(flags, expected):
    assert after_reply(flags, pushed_final=False) is expected


@pytest.mark.parametrize("flags", [0, PARKED_FLAG])
def test_a_worker_is_parked_or_recalled_only_after_its_final_push(flags):
    with pytest.raises(IllegalMove, match="did not push FINAL"):
        after_reply(flags, pushed_final=False)


def reachable(start: WorkerState, end: WorkerState) -> bool:
    seen, todo = set(), [start]
    while todo:
        for there in TRANSITIONS[todo.pop()]:
            if there == end:
                return True
            if there not in seen:
                seen.add(there)
                todo.append(there)
    return False


@pytest.mark.parametrize("flags,name", REPLIES, ids=[n for _, n in REPLIES])
def test_the_workers_reading_agrees_with_the_servers_table(flags, name):
    """Every state a worker reads from a reply, after its FINAL push (it is TRAINING to
    the server, or PARKED when it listens on), is one the server's table reaches from
    there (a lease after a FINAL push: through RECALLED); so is DISMISSED, for a worker
    stopped by the server's word."""
    for now in (TRAINING, PARKED):
        assert reachable(now, after_reply(flags, pushed_final=True)), (now, name)
    if flags & (FINAL | DROPPED):
        assert reachable(TRAINING, after_reply(flags, pushed_final=False)), name


# ---- the diagram in docs/architecture.md --------------------------------------------
def test_the_diagram_in_the_docs_is_the_table():
    """docs/architecture.md's diagram under "The async worker's life" is
    :func:`diagram`'s (on a change of the table, paste the block this prints)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## The async worker's life", 1)
    assert len(section) == 2, "docs/architecture.md has no section \"The async worker's life\""
    found = re.search(r"```mermaid\n(.*?)```", section[1], re.S)
    assert found, "no mermaid block in \"The async worker's life\""
    assert found.group(1) == diagram(), "\n```mermaid\n" + diagram() + "```"


def test_the_diagram_has_every_move_once():
    edges = [line for line in diagram().splitlines() if "-->" in line and "[*]" not in line]
    assert len(edges) == len(LEGAL) == len(set(edges))
