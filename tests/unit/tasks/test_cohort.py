"""Cohorts are no barrier: a stage returns with the members done, the others are collected."""

import threading

import numpy as np
from distributed.protocol import dumps, loads, to_serialize

from tasks.cohort import (
    ENDED,
    Deferred,
    MemberError,
    Members,
    Phase,
    by_source,
    collect,
    decode_many,
    each,
    env_step_many,
    inputs,
    pending_members,
    prefill_many,
)
from tasks.env_steps import EnvRegistry, env_reset, env_step
from tasks.envs.frozenlake import FrozenLakeText
from tasks.envs.latency import RemoteLatency
from tasks.generation import decode, prefill, response_of
from tasks.policy import load_policy
from tasks.records import (
    DecodeOutput,
    EnvHandle,
    EnvObservation,
    KVCache,
    PrefillOutput,
    SamplingParams,
    TurnSample,
)
from tasks.specs import PolicySpec

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


def _threads_of(fn):
    """``fn`` recording the thread each call runs on."""
    seen: list[int] = []

    def wrapped(*args, **kwargs):
        seen.append(threading.get_ident())
        return fn(*args, **kwargs)

    return wrapped, seen


def _prefilled(backend, n):
    obs = [EnvObservation(handle=EnvHandle("w", f"e{i}"), text="", input_ids=[3, 6 + i, 7])
           for i in range(n)]
    return [prefill(backend, None, o) for o in obs]


def test_one_token_decodes_run_in_the_tasks_own_thread_and_sample_as_they_would_alone(make_backend):
    backend = make_backend()
    n, params = 6, [SamplingParams(max_new_tokens=1)] * 6
    pre = _prefilled(backend, n)
    fn, seen = _threads_of(decode)
    out = decode_many(backend, fn, pre, [None] * n, params, list(range(n)), [None] * n,
                      grace_s=GRACE)
    assert set(seen) == {threading.get_ident()}  # no forward pass to share: no thread each
    alone = [decode(backend, pre[i], None, params[i], i) for i in range(n)]
    assert [o.sample.token_ids for o in out] == [a.sample.token_ids for a in alone]


def test_longer_decodes_run_a_thread_each_to_share_the_engines_passes(make_backend):
    backend = make_backend(stop_ids=[])
    n, params = 4, [SamplingParams(max_new_tokens=3)] * 4
    pre = _prefilled(backend, n)
    fn, seen = _threads_of(decode)
    before = backend.engine.stats.forward_passes
    out = decode_many(backend, fn, pre, [None] * n, params, list(range(n)), [None] * n)
    assert threading.get_ident() not in seen and len(set(seen)) == n
    assert all(len(o.sample.token_ids) == 3 for o in out)
    # two tokens run per member (the last is left to the next prefill), in shared passes
    assert backend.engine.stats.forward_passes - before < 2 * n


def test_quick_environments_step_in_the_tasks_own_thread_and_waiting_ones_side_by_side():
    assert FrozenLakeText.quick_step and not getattr(RemoteLatency, "quick_step", False)
    _, tok = load_policy(PolicySpec(device="cpu"))
    lake = {"_component_": "tasks.envs.frozenlake.FrozenLakeText"}
    specs = {"quick": lake,
             "remote": {"_component_": "tasks.envs.latency.RemoteLatency", "env": lake,
                        "step_latency": 0.001}}
    for kind, spec in specs.items():
        registry = EnvRegistry("w")
        obs = [env_reset(registry, tok, spec, i, f"{kind}{i}") for i in range(3)]
        moves = [DecodeOutput(KVCache("k", [], 0), TurnSample(
            token_ids=[], logprobs=[], versions=[], text="right", stopped=True,
            context_full=False, decode_tokens_processed=0, oldest_version=0)) for _ in obs]
        fn, seen = _threads_of(env_step)
        out = env_step_many(registry, tok, fn, response_of, obs, moves, grace_s=GRACE)
        assert all(o.env_steps == 1 for o in out)
        inline = set(seen) == {threading.get_ident()}
        assert inline == (kind == "quick"), kind


def test_a_cohorts_results_cross_dask_as_one_pickle_whatever_path_made_them():
    """Dask serialises a plain list result element by element (a header and frames each); a
    stage's results are :class:`Members`, pickled whole, and arrive as they left."""
    _, tok = load_policy(PolicySpec(device="cpu"))
    registry = EnvRegistry("w")
    lake = {"_component_": "tasks.envs.frozenlake.FrozenLakeText"}
    obs = [env_reset(registry, tok, lake, i, f"m{i}") for i in range(3)]
    release = threading.Event()
    release.set()
    results = {
        "inline": env_step_many(registry, tok, lambda r, t, o, s: o.text, lambda d: d, obs,
                                ["right"] * 3, grace_s=GRACE),
        "threads": each(_held_member(release, slow=1), 3, Phase.DECODE, grace_s=GRACE),
        "barrier": each(_held_member(release, slow=1), 3),
        "collect": collect("no-such-handle", [0, 1], Phase.DECODE, GRACE),
    }
    for path, out in results.items():
        assert isinstance(out, Members), path
        frames = dumps({"data": to_serialize(out)})
        back = loads(frames)["data"]
        assert type(back) is Members and back == out, path
        assert len(frames) <= 3, (path, len(frames))  # a plain list: one frame per element more
    plain = dumps({"data": to_serialize(list(results["inline"]))})
    assert len(plain) > len(dumps({"data": to_serialize(results["inline"])}))


def test_a_prefills_small_arrays_travel_inside_the_pickle_and_large_ones_as_frames():
    """Each out-of-band buffer is a read of its own for the receiving worker: a cohort of the
    tiny policy's prefills goes as one frame; a large KV keeps its zero-copy frame."""
    rng = np.random.default_rng(0)

    def out(tokens):
        return PrefillOutput(kv_new=rng.random((2, 2, 2, tokens, 16), dtype=np.float32),
                             last_logits=rng.random(300, dtype=np.float32), n_past=4,
                             n_new=tokens, policy_version=1, key="k", input_ids=[5] * tokens)

    def frames(x):
        return dumps({"data": to_serialize(x)})

    empty = len(frames(Members()))
    for tokens, own_frames in ((12, 0), (2000, 20)):  # KV of 6 KiB in the pickle; 1 MiB a frame
        sent = Members(out(tokens) for _ in range(20))
        assert len(frames(sent)) == empty + own_frames
        got = loads(frames(sent))["data"]
        for a, b in zip(sent, got, strict=True):
            assert b.kv_new.flags.writeable and b.last_logits.flags.writeable
            np.testing.assert_array_equal(a.kv_new, b.kv_new)
            np.testing.assert_array_equal(a.last_logits, b.last_logits)
            assert (b.n_past, b.n_new, b.input_ids) == (a.n_past, a.n_new, a.input_ids)


def test_a_look_ahead_turn_after_the_episodes_end_runs_nothing_and_says_so():
    """The members' next turn, submitted ahead: a member whose turn before ended its episode
    (done, or the context full) is not prefilled, decoded or stepped; its mates are."""
    def sample(context_full=False):
        return TurnSample(token_ids=[5], logprobs=[0.0], versions=[0], text="right",
                          stopped=False, context_full=context_full, decode_tokens_processed=0)

    done = EnvObservation(EnvHandle("w", "a"), "", [3], terminated=True, sample=sample())
    full = EnvObservation(EnvHandle("w", "b"), "", [3], sample=sample(context_full=True))
    going = EnvObservation(EnvHandle("w", "c"), "", [3, 4], sample=sample())
    ran = []

    def prefill_fn(backend, past, obs):
        ran.append(obs.handle.instance_id)
        return "kv"

    turns = [done, full, going]
    pre = prefill_many(None, prefill_fn, [None] * 3, by_source([(turns, i) for i in range(3)]),
                       [None] * 3, grace_s=GRACE)
    assert pre == [ENDED, ENDED, "kv"] and ran == ["c"]
    out = decode_many(None, lambda *a: "tokens", pre, [None] * 3, [None] * 3, [1, 2, 3],
                      [None] * 3, grace_s=GRACE)
    assert out == [ENDED, ENDED, "tokens"]
    steps = env_step_many(EnvRegistry("w"), None, lambda *a: "stepped", lambda d: d, turns, out,
                          grace_s=GRACE)
    assert steps == [ENDED, ENDED, "stepped"]


def test_members_inputs_carry_each_earlier_result_once_and_resolve_per_member():
    turns, caches = ["t0", "t1", "t2"], ["k0", "k1"]
    arg = by_source([(turns, 2), (caches, 1), None, (turns, 0), "obs"])
    sources, _items = arg
    assert sources == [turns, caches]  # each once, however many members read it
    assert inputs(arg) == ["t2", "k1", None, "t0", "obs"]
    assert inputs(["a", None]) == ["a", None]  # a plain list: the inputs themselves


def test_a_cohorts_prefill_on_the_hf_backend_runs_in_one_pass_from_the_tasks_thread(
        make_backend, obs):
    """The default stage function's batched form: the members' prefills queued together from
    the task's thread (no thread each), one forward pass, the same outputs as member by member;
    a member's own failure (nothing to read) and an ended episode stay in their slots. A stage
    function of one's own runs member by member."""
    backend = make_backend()
    prompts = [[3, 6, 7, 4], [3, 8, 9, 10, 11, 4], [3, 12, 4]]
    first = [prefill(backend, None, obs(p)) for p in prompts]
    pasts = [DecodeOutput(KVCache(f.key, f.input_ids + [5], len(f.input_ids)), None)
             for f in first]
    # the second member has no token to read: none pending in its cache, none observed
    pasts[1] = DecodeOutput(KVCache(first[1].key, first[1].input_ids, 6), None)
    nxt = [obs([6, 7]), obs([]), obs([8, 9, 10])]
    ended_obs = EnvObservation(EnvHandle("w", "e"), "", [3], terminated=True,
                               sample=TurnSample([5], [0.0], [0], "", False, False, 0))
    threads = []
    real = backend.prefill_many

    def prefill_many_seen(*args):
        threads.append(threading.current_thread())
        return real(*args)

    backend.prefill_many = prefill_many_seen
    passes = backend.engine.stats.forward_passes
    out = prefill_many(backend, prefill, [*pasts, None], [*nxt, ended_obs], [None] * 4)
    assert threads == [threading.current_thread()] and isinstance(out, Members)
    assert backend.engine.stats.forward_passes == passes + 1
    assert isinstance(out[1], MemberError) and "new token" in out[1].error
    assert out[3] is ENDED
    # member by member (a stage function without a batched form; the store holds the same):
    # the same outputs, the same failure
    own = prefill_many(backend, lambda b, past, o: prefill(b, past, o), pasts, nxt, [None] * 3)
    assert threads == [threading.current_thread()]
    assert isinstance(own[1], MemberError) and "new token" in own[1].error
    for i in (0, 2):
        assert out[i].n_past == own[i].n_past and out[i].input_ids == own[i].input_ids
        np.testing.assert_allclose(out[i].kv_new, own[i].kv_new, atol=1e-5)
        np.testing.assert_allclose(out[i].last_logits, own[i].last_logits, atol=1e-5)
