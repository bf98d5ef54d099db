"""The supervisor's transition table, every transition and every ignored pair, its policies, with a fake clock."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chestnut.backend.errors import Layer
from chestnut.msgs.schema import log
from chestnut.node.supervisor import (
    PRECONDITIONS,
    PUBLISHED,
    RUNS_PRIMARY,
    SERVING,
    TRANSITIONS,
    WORKER_STATES,
    Action,
    Backoff,
    Event,
    Source,
    State,
    Supervisor,
    SupervisorConfig,
    Transition,
    fill_node_state,
)

S, E, A = State, Event, Action
SEC = 1_000_000_000
MS = 1_000_000

# ---------------------------------------------------------------- the table, written out as the contract

FAIL = (S.DEGRADED, A.BACK_OFF)
EXPECTED: dict[tuple[State, Event], tuple[State, Action]] = {
    (S.STARTING, E.FALLBACK_READY): (S.QUALIFYING, A.SPAWN_WORKER),
    (S.QUALIFYING, E.QUALIFIED): (S.LOADING, A.LOAD_PRIMARY),
    (S.QUALIFYING, E.DOCK_ABSENT): FAIL,
    (S.QUALIFYING, E.QUALIFY_FAILED): FAIL,
    (S.QUALIFYING, E.PRIMARY_FAULT): FAIL,
    (S.QUALIFYING, E.WORKER_DIED): FAIL,
    (S.LOADING, E.LOADED): (S.AWAITING_SWITCH, A.START_SHADOW),
    (S.LOADING, E.LOAD_FAILED): FAIL,
    (S.LOADING, E.PRIMARY_FAULT): FAIL,
    (S.LOADING, E.WORKER_DIED): FAIL,
    (S.ACTIVE, E.PRIMARY_FAULT): FAIL,
    (S.ACTIVE, E.WORKER_DIED): FAIL,
    (S.ACTIVE, E.DEADLINE_MISS_RUN): FAIL,
    (S.DEGRADED, E.RETRY_DUE): (S.LOOKING, A.LOOK_FOR_DOCK),
    (S.LOOKING, E.DOCK_FOUND): (S.REQUALIFYING, A.SPAWN_WORKER),
    (S.LOOKING, E.DOCK_ABSENT): FAIL,
    (S.REQUALIFYING, E.QUALIFIED): (S.RELOADING, A.LOAD_PRIMARY),
    (S.REQUALIFYING, E.DOCK_ABSENT): FAIL,
    (S.REQUALIFYING, E.QUALIFY_FAILED): FAIL,
    (S.REQUALIFYING, E.PRIMARY_FAULT): FAIL,
    (S.REQUALIFYING, E.WORKER_DIED): FAIL,
    (S.RELOADING, E.LOADED): (S.SHADOWING, A.START_SHADOW),
    (S.RELOADING, E.LOAD_FAILED): FAIL,
    (S.RELOADING, E.PRIMARY_FAULT): FAIL,
    (S.RELOADING, E.WORKER_DIED): FAIL,
    (S.SHADOWING, E.SHADOW_AGREED): (S.AWAITING_SWITCH, A.NONE),
    (S.SHADOWING, E.SHADOW_DISAGREED): FAIL,
    (S.SHADOWING, E.PRIMARY_FAULT): FAIL,
    (S.SHADOWING, E.WORKER_DIED): FAIL,
    (S.SHADOWING, E.DEADLINE_MISS_RUN): FAIL,
    (S.AWAITING_SWITCH, E.CONSUMER_ALLOWS_SWITCH): (S.ACTIVE, A.SERVE_PRIMARY),
    (S.AWAITING_SWITCH, E.SHADOW_DISAGREED): FAIL,
    (S.AWAITING_SWITCH, E.PRIMARY_FAULT): FAIL,
    (S.AWAITING_SWITCH, E.WORKER_DIED): FAIL,
    (S.AWAITING_SWITCH, E.DEADLINE_MISS_RUN): FAIL,
    **{(s, E.STOP): (S.STOPPING, A.STOP) for s in State if s is not S.STOPPING},
    **{(s, E.FALLBACK_FAILED): (S.STOPPING, A.ABORT) for s in State if s is not S.STOPPING},
}


def test_the_table_is_exactly_the_contract():
    assert TRANSITIONS == EXPECTED


def test_every_state_is_published_as_a_schema_state():
    assert set(PUBLISHED) == set(State)
    assert set(PUBLISHED.values()) == set(log.NodeState.State.schema.enumerants)
    assert {s for s in State if s.published == "recovering"} == {S.REQUALIFYING, S.RELOADING, S.SHADOWING,
                                                                  S.AWAITING_SWITCH}


def test_the_primary_serves_only_in_active():
    assert {s for s, src in SERVING.items() if src is Source.PRIMARY} == {S.ACTIVE}
    assert {s for s, src in SERVING.items() if src is Source.NONE} == {S.STARTING, S.STOPPING}
    assert RUNS_PRIMARY == {S.ACTIVE, S.SHADOWING, S.AWAITING_SWITCH} and RUNS_PRIMARY <= WORKER_STATES


def test_every_state_is_reachable_and_every_non_final_state_can_stop():
    reachable, frontier = {S.STARTING}, [S.STARTING]
    while frontier:
        s = frontier.pop()
        for (src, _e), (dst, _a) in TRANSITIONS.items():
            if src is s and dst not in reachable:
                reachable.add(dst)
                frontier.append(dst)
    assert reachable == set(State)


# ---------------------------------------------------------------- driving the machine to each state


def drive(state: State, engaged: bool = False) -> tuple[Supervisor, int]:
    """A supervisor brought to ``state`` through real events; returns it and the current time."""
    sup = Supervisor(0, SupervisorConfig(shadow_frames=2))
    t = 1 * SEC
    if state is S.AWAITING_SWITCH or engaged:
        sup.consumer(True, False, t)
    if state is S.STARTING:
        return sup, t
    if state is S.STOPPING:
        sup.handle(E.STOP, t)
        return sup, t
    sup.handle(E.FALLBACK_READY, t)
    if state is S.QUALIFYING:
        return sup, t
    if state in (S.LOADING, S.AWAITING_SWITCH, S.ACTIVE):
        sup.handle(E.QUALIFIED, t)
        if state is not S.LOADING:
            sup.handle(E.LOADED, t)
        assert sup.state is state
        return sup, t
    sup.handle(E.DOCK_ABSENT, t, "no dock")
    if state is S.DEGRADED:
        return sup, t
    t = sup.retry_at_ns
    sup.tick(t)
    if state is S.LOOKING:
        return sup, t
    sup.handle(E.DOCK_FOUND, t)
    if state is not S.REQUALIFYING:
        sup.handle(E.QUALIFIED, t)
    if state is S.SHADOWING:
        sup.handle(E.LOADED, t)
    assert sup.state is state
    return sup, t


@pytest.mark.parametrize("state", list(State))
def test_drive_reaches_every_state(state):
    assert drive(state)[0].state is state


@pytest.mark.parametrize(("state", "event"), sorted(TRANSITIONS, key=lambda k: (k[0].value, k[1].value)))
def test_every_transition(state, event):
    sup, t = drive(state)
    if event is E.SHADOW_AGREED:  # derived events: meet their preconditions
        sup.shadow_run = sup.config.shadow_frames
    if event is E.CONSUMER_ALLOWS_SWITCH:
        sup.switch_allowed = True
    if event is E.RETRY_DUE:
        t = sup.retry_at_ns
    seen: list[Transition] = []
    sup.on_transition = seen.append
    ts = sup.handle(event, t + 5 * MS, "why", Layer.GPU)
    to_state, action = EXPECTED[(state, event)]
    first = ts[0]
    assert (first.from_state, first.event, first.to_state, first.action) == (state, event, to_state, action)
    assert first.at_ns == t + 5 * MS and first.layer is Layer.GPU
    assert first.reason.startswith(f"{event.value} (gpu): why")
    assert seen == ts and list(sup.history)[-len(ts):] == ts
    chained = to_state is S.AWAITING_SWITCH and sup.switch_allowed
    assert sup.state is (S.ACTIVE if chained else to_state)
    assert [x.event for x in ts] == [event] + ([E.CONSUMER_ALLOWS_SWITCH] if chained else [])
    assert sup.since_ns == t + 5 * MS and sup.reason == ts[-1].reason
    if action is A.BACK_OFF:
        assert first.retry_at_ns == t + 5 * MS + int(first.backoff_s * SEC) and sup.retry_at_ns == first.retry_at_ns
        assert first.reason.endswith(f"; retry in {first.backoff_s:g} s")
    else:
        assert first.retry_at_ns is None and first.backoff_s is None


IGNORED = sorted(((s, e) for s in State for e in Event if (s, e) not in TRANSITIONS),
                 key=lambda k: (k[0].value, k[1].value))


@pytest.mark.parametrize(("state", "event"), IGNORED)
def test_every_other_pair_is_ignored_and_counted(state, event):
    sup, t = drive(state)
    before = (sup.state, sup.since_ns, sup.reason, sup.retry_at_ns, len(sup.history))
    assert sup.handle(event, t + 1, "late news") == []
    assert (sup.state, sup.since_ns, sup.reason, sup.retry_at_ns, len(sup.history)) == before
    assert sup.ignored[(state, event)] == 1


def test_derived_events_are_refused_until_their_precondition_holds():
    assert set(PRECONDITIONS) == {E.SHADOW_AGREED, E.CONSUMER_ALLOWS_SWITCH, E.RETRY_DUE}
    sup, t = drive(S.SHADOWING)  # shadow_frames=2
    sup.shadow_run = 1
    assert sup.handle(E.SHADOW_AGREED, t) == [] and sup.ignored[(S.SHADOWING, E.SHADOW_AGREED)] == 1
    sup, t = drive(S.AWAITING_SWITCH)  # engaged, not allowing
    assert sup.handle(E.CONSUMER_ALLOWS_SWITCH, t) == [] and sup.state is S.AWAITING_SWITCH
    sup, t = drive(S.DEGRADED)
    assert sup.handle(E.RETRY_DUE, sup.retry_at_ns - 1) == [] and sup.state is S.DEGRADED
    assert sup.ignored[(S.DEGRADED, E.RETRY_DUE)] == 1


def test_stopping_is_final():
    assert {e for (s, e) in TRANSITIONS if s is S.STOPPING} == set()


# ---------------------------------------------------------------- scenarios


def test_start_with_a_dock_and_no_consumer_goes_active():
    sup = Supervisor(0)
    assert (sup.state, sup.serving, sup.reason) == (S.STARTING, Source.NONE, "node starting: warming the fallback")
    assert [t.action for t in sup.handle(E.FALLBACK_READY, 1 * SEC)] == [A.SPAWN_WORKER]
    assert sup.serving is Source.FALLBACK and sup.wants_worker and not sup.runs_primary
    sup.handle(E.QUALIFIED, 2 * SEC)
    ts = sup.handle(E.LOADED, 3 * SEC, "warm-up fingerprint matched")
    assert [(t.to_state, t.action, t.reason) for t in ts] == [
        (S.AWAITING_SWITCH, A.START_SHADOW, "loaded: warm-up fingerprint matched"),
        (S.ACTIVE, A.SERVE_PRIMARY, "consumer_allows_switch: consumer not engaged"),
    ]
    assert (sup.serving, sup.since_ns, sup.restarts) == (Source.PRIMARY, 3 * SEC, 0)


def test_a_dock_absent_at_start_serves_the_fallback_and_keeps_looking_with_back_off():
    sup = Supervisor(0)
    sup.handle(E.FALLBACK_READY, 0)
    (t,) = sup.handle(E.DOCK_ABSENT, 0, "usb_ids: no Chestnut dock found")
    assert t.reason == "dock_absent: usb_ids: no Chestnut dock found; retry in 1 s"
    assert sup.state.published == "degraded" and sup.serving is Source.FALLBACK and not sup.wants_worker
    delays = [t.backoff_s]
    now = 0
    for _ in range(7):
        assert sup.tick(sup.retry_at_ns - 1) == []
        now = sup.retry_at_ns
        (look,) = sup.tick(now)
        assert (look.to_state, look.action, look.reason) == (S.LOOKING, A.LOOK_FOR_DOCK,
                                                              "retry_due: back-off over; looking for the dock")
        assert sup.serving is Source.FALLBACK
        (t,) = sup.handle(E.DOCK_ABSENT, now + 2 * MS)
        delays.append(t.backoff_s)
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    assert sup.spawns == 1  # the looks spawned nothing


def fault_to_degraded(sup: Supervisor, t: int) -> Transition:
    (tr,) = sup.handle(E.PRIMARY_FAULT, t, "fence_stall: Wait timeout: 3000 ms", Layer.GPU)
    return tr


def recover_to_shadowing(sup: Supervisor) -> int:
    t = sup.retry_at_ns
    sup.tick(t)
    sup.handle(E.DOCK_FOUND, t)
    sup.handle(E.QUALIFIED, t + 100 * MS)
    sup.handle(E.LOADED, t + 200 * MS)
    assert sup.state is S.SHADOWING and sup.runs_primary and sup.serving is Source.FALLBACK
    return t + 200 * MS


def test_recovery_returns_to_the_primary_after_k_agreeing_shadow_frames():
    sup, t = drive(S.ACTIVE)
    sup.config = SupervisorConfig()  # 20 shadow frames
    tr = fault_to_degraded(sup, t + 10 * SEC)
    assert tr.reason == "primary_fault (gpu): fence_stall: Wait timeout: 3000 ms; retry in 1 s"
    assert sup.serving is Source.FALLBACK
    t = recover_to_shadowing(sup)
    assert sup.restarts == 1
    for i in range(19):
        assert sup.shadow(True, t + i * 50 * MS) == []
    ts = sup.shadow(True, t + 19 * 50 * MS)
    assert [(x.to_state, x.reason) for x in ts] == [
        (S.AWAITING_SWITCH, "shadow_agreed: primary agreed with the fallback on 20 consecutive shadow frames"),
        (S.ACTIVE, "consumer_allows_switch: consumer not engaged")]


def test_one_disagreeing_shadow_frame_sends_the_node_back_to_degraded():
    sup, _ = drive(S.ACTIVE)
    fault_to_degraded(sup, 5 * SEC)
    t = recover_to_shadowing(sup)
    sup.shadow(True, t)
    (tr,) = sup.shadow(False, t + 50 * MS, "prob: 3 value(s) differ from the fallback")
    assert (tr.to_state, tr.reason) == (S.DEGRADED, "shadow_disagreed: prob: 3 value(s) differ from the fallback; "
                                                    "retry in 2 s")
    t = recover_to_shadowing(sup)
    assert sup.shadow_run == 0  # the count starts over


def test_the_return_waits_while_the_consumer_is_engaged():
    sup, t = drive(S.SHADOWING, engaged=True)  # shadow_frames=2
    assert sup.consumer(True, False, t) == []
    sup.shadow(True, t)
    (tr,) = sup.shadow(True, t + 50 * MS)
    assert tr.to_state is S.AWAITING_SWITCH and sup.state.published == "recovering"
    assert sup.serving is Source.FALLBACK and sup.runs_primary
    assert sup.shadow(True, t + 100 * MS) == [] and sup.consumer(True, False, t + 120 * MS) == []
    (tr,) = sup.consumer(True, True, t + 150 * MS)
    assert (tr.to_state, tr.action, tr.reason) == (S.ACTIVE, A.SERVE_PRIMARY,
                                                   "consumer_allows_switch: consumer allows the switch")


def test_a_consumer_that_disengages_allows_the_switch():
    sup, t = drive(S.AWAITING_SWITCH)
    assert sup.state is S.AWAITING_SWITCH and sup.consumer_engaged
    (tr,) = sup.consumer(False, False, t + 1)
    assert tr.to_state is S.ACTIVE and tr.reason == "consumer_allows_switch: consumer not engaged"


def test_a_disagreement_while_waiting_for_the_consumer_fails_over():
    sup, t = drive(S.AWAITING_SWITCH)
    (tr,) = sup.shadow(False, t + 1)
    assert tr.to_state is S.DEGRADED


def test_shadow_frames_outside_recovery_count_nothing():
    sup, t = drive(S.ACTIVE)
    assert sup.shadow(True, t) == [] and sup.shadow_run == 0
    assert sup.shadow(False, t) == [] and sup.ignored[(S.ACTIVE, E.SHADOW_DISAGREED)] == 1


def test_back_off_resets_after_a_stable_period_in_active():
    sup, t = drive(S.ACTIVE)
    delays = []
    for _ in range(2):  # two short activations: 1 s, 2 s
        delays.append(fault_to_degraded(sup, t + 1 * SEC).backoff_s)
        t = recover_to_shadowing(sup)
        sup.shadow(True, t)
        sup.shadow(True, t)
        assert sup.state is S.ACTIVE
    delays.append(fault_to_degraded(sup, t + 60 * SEC).backoff_s)  # served 60 s: stable
    assert delays == [1, 2, 1]


def test_flapping_raises_the_back_off_until_a_stable_period():
    sup, t = drive(S.ACTIVE)
    delays = []
    for _ in range(4):
        delays.append(fault_to_degraded(sup, t + 1 * SEC).backoff_s)
        t = recover_to_shadowing(sup)
        sup.shadow(True, t)
        sup.shadow(True, t)
    assert delays == [1, 2, 300, 300]  # the 3rd failover within 600 s marks flapping
    assert sup.backoff.flapping
    delays.append(fault_to_degraded(sup, t + 61 * SEC).backoff_s)
    assert delays[-1] == 1 and not sup.backoff.flapping


def test_backoff_policy_numbers():
    b = Backoff(SupervisorConfig())
    assert [b.next_delay_s() for _ in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    b.flapping = True
    assert b.next_delay_s() == 300
    b.reset()
    assert b.next_delay_s() == 1
    with pytest.raises(ValueError, match="shadow_frames"):
        SupervisorConfig(shadow_frames=0)
    with pytest.raises(ValueError, match="backoff_initial_s"):
        SupervisorConfig(backoff_initial_s=40)


def test_a_dead_workers_late_news_is_ignored():
    sup, t = drive(S.ACTIVE)
    fault_to_degraded(sup, t)
    assert sup.handle(E.WORKER_DIED, t + 1) == [] and sup.handle(E.LOADED, t + 2) == []
    assert sup.state is S.DEGRADED and sup.ignored[(S.DEGRADED, E.WORKER_DIED)] == 1


def test_no_usable_fallback_aborts():
    sup = Supervisor(0)
    (tr,) = sup.handle(E.FALLBACK_FAILED, 1, "fallback model missing: /x.onnx")
    assert (tr.to_state, tr.action) == (S.STOPPING, A.ABORT) and sup.serving is Source.NONE


def test_fill_node_state_round_trips():
    sup, t = drive(S.SHADOWING)
    msg = log.Event.new_message()
    fill_node_state(msg.init("nodeState"), sup)
    with log.Event.from_bytes(msg.to_bytes()) as r:
        n = r.nodeState
        assert (str(n.state), n.reason, n.since, n.restarts) == ("recovering", "loaded", t, 1)


def test_history_is_bounded():
    sup = Supervisor(0)
    sup.handle(E.FALLBACK_READY, 0)
    for i in range(100):
        sup.handle(E.QUALIFY_FAILED if sup.state is S.QUALIFYING else E.DOCK_ABSENT, i)
        sup.tick(sup.retry_at_ns)
    assert len(sup.history) == 64


# ---------------------------------------------------------------- properties over random inputs

# The next happy-path input for the current state; in ACTIVE: serve for the given dwell (ms), then a fault.
ADVANCE = st.tuples(st.just("advance"), st.integers(0, 60_000))
DISRUPT = st.one_of(
    st.tuples(st.just("event"), st.sampled_from([e for e in Event if e not in (E.STOP, E.FALLBACK_FAILED)])),
    st.tuples(st.just("shadow"), st.booleans()),
    st.tuples(st.just("consumer"), st.tuples(st.booleans(), st.booleans())),
    st.tuples(st.just("wait"), st.integers(0, 120_000)),  # ms
)
INPUTS = st.integers(0, 99).flatmap(lambda r: ADVANCE if r < 85 else DISRUPT)  # mostly the happy path


@settings(max_examples=300, deadline=None)
@given(st.lists(INPUTS, min_size=10, max_size=150), st.booleans())
def test_policy_invariants_over_random_inputs(script, stop_at_end):
    cfg = SupervisorConfig(shadow_frames=3, stable_after_s=30.0)
    sup = Supervisor(0, cfg)
    now = 0
    agreed_since_shadowing = 0
    awaiting_from_shadow = False
    last_delay = 0.0
    active_since = 0

    def check(ts):
        nonlocal agreed_since_shadowing, awaiting_from_shadow, last_delay, active_since
        for t in ts:
            if t.to_state is S.SHADOWING:
                agreed_since_shadowing = 0
            if t.to_state is S.AWAITING_SWITCH:
                awaiting_from_shadow = t.from_state is S.SHADOWING
            if t.to_state is S.ACTIVE:
                active_since = t.at_ns
                assert t.from_state is S.AWAITING_SWITCH and t.event is E.CONSUMER_ALLOWS_SWITCH
                assert sup.switch_allowed
                if awaiting_from_shadow:  # a return: K agreeing shadow frames first
                    assert agreed_since_shadowing >= cfg.shadow_frames
            if t.action is A.BACK_OFF:
                stable = t.from_state is S.ACTIVE and t.at_ns - active_since >= cfg.stable_after_s * SEC
                if stable:  # a reset: back to the initial delay
                    assert t.backoff_s == cfg.backoff_initial_s
                else:  # monotone until a reset
                    assert t.backoff_s >= last_delay
                last_delay = t.backoff_s
                assert t.backoff_s <= max(cfg.backoff_max_s, cfg.flap_backoff_s)
        assert (sup.serving is Source.PRIMARY) == (sup.state is S.ACTIVE)
        assert sup.state is not S.DEGRADED or sup.retry_at_ns is not None

    happy = {S.STARTING: E.FALLBACK_READY, S.QUALIFYING: E.QUALIFIED, S.LOADING: E.LOADED, S.LOOKING: E.DOCK_FOUND,
             S.REQUALIFYING: E.QUALIFIED, S.RELOADING: E.LOADED}
    for kind, arg in script:
        if kind == "advance":
            if sup.state in happy:
                kind, arg = "event", happy[sup.state]
            elif sup.state is S.DEGRADED:
                kind, arg = "wait", (sup.retry_at_ns - now) // MS + 1
            elif sup.state is S.AWAITING_SWITCH:
                kind, arg = "consumer", (False, False)
            elif sup.state is S.ACTIVE:
                now += arg * MS
                kind, arg = "event", E.PRIMARY_FAULT
            else:
                kind, arg = "shadow", True
        if kind == "event":
            check(sup.handle(arg, now))
        elif kind == "shadow":
            if arg and sup.state in (S.SHADOWING, S.AWAITING_SWITCH):
                agreed_since_shadowing += 1
            elif not arg:
                agreed_since_shadowing = 0
            check(sup.shadow(arg, now))
        elif kind == "consumer":
            check(sup.consumer(*arg, now))
        else:
            now += arg * MS
            check(sup.tick(now))
    if stop_at_end:
        sup.handle(E.STOP, now)
        assert sup.state is S.STOPPING and sup.serving is Source.NONE
        for e in Event:
            assert sup.handle(e, now + 1) == []
