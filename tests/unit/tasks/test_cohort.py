"""Cohorts are no barrier: a stage returns with the members done, the others are collected."""

import threading

from tasks.cohort import (
    Deferred,
    MemberError,
    Phase,
    collect,
    decode_many,
    each,
    pending_members,
)

# long enough for the members that are not held to finish together on a loaded machine; the
# held one waits for its event whatever the grace
GRACE = 1.0


def _held_member(release: threading.Event, slow: int):
    def fn(i):
        if i == slow:
            assert release.wait(30)
        return i * 10
    return fn


def test_a_stage_returns_with_the_members_done_and_defers_the_one_still_running():
    release = threading.Event()
    out = each(_held_member(release, slow=2), 4, Phase.DECODE, grace_s=GRACE)
    assert out[:2] + out[3:] == [0, 10, 30]
    marker = out[2]
    assert isinstance(marker, Deferred) and marker.phase is Phase.DECODE and marker.index == 2
    assert pending_members() >= 1
    release.set()
    assert collect(marker.handle, [2], Phase.DECODE, GRACE) == [20]
    # taken: the worker holds nothing more of that handle
    again = collect(marker.handle, [2], Phase.DECODE, GRACE)
    assert isinstance(again[0], MemberError) and "not held" in again[0].error


def test_a_collect_of_a_member_still_running_defers_it_again_under_the_same_handle():
    release = threading.Event()
    out = each(_held_member(release, slow=0), 2, Phase.PREFILL, grace_s=GRACE)
    marker = out[0]
    # nothing of the collected member is done yet: the collect waits for it, so run it aside
    result: list = []
    t = threading.Thread(target=lambda: result.extend(
        collect(marker.handle, [0], Phase.PREFILL, GRACE)))
    t.start()
    release.set()
    t.join(30)
    assert result == [0]


def test_the_barrier_baseline_waits_for_every_member():
    release = threading.Event()
    threading.Timer(0.05, release.set).start()
    assert each(_held_member(release, slow=1), 3, Phase.ENV_STEP, grace_s=None) == [0, 10, 20]


def test_a_member_deferred_upstream_passes_through_without_holding_its_mates():
    upstream = Deferred(Phase.PREFILL, "h", 0)
    seen = []

    def decode(backend, prefilled, past, params, seed):
        seen.append(prefilled)
        return "tokens"

    out = decode_many(None, decode, [upstream, "kv"], [None, None], [None, None], [1, 2],
                      [None, None], grace_s=GRACE)
    assert out == [upstream, "tokens"] and seen == ["kv"]


def test_a_members_failure_stays_in_its_slot():
    def fn(i):
        if i == 1:
            raise ValueError("bad action")
        return i

    out = each(fn, 3, Phase.ENV_STEP, grace_s=GRACE)
    assert out[0] == 0 and out[2] == 2
    assert isinstance(out[1], MemberError) and "bad action" in out[1].error
