"""Cohorts: one Dask task runs one stage for several trajectories at once.

A Dask task costs about a millisecond of scheduler and worker time whatever it computes; a turn of
the tiny policy computes for about as long. The rollout driver therefore submits the turns that
are ready at the same moment, on the same workers, as one *cohort*: one env_reset, prefill,
decode and env_step task for all of them. Inside a task the members run concurrently (a thread
each), so the inference backend batches their forward passes into shared ones and remote
environments wait side by side; each member's result, or its error, has its own slot, so one
member's failure never fails the others.

Members refer to earlier results by index into the task's ``sources``, the earlier cohorts'
result lists, each passed once (:func:`by_source`): Dask resolves each future among the sources
once, and the graph carries one dependency per earlier cohort rather than a nested task per
member (a cohort's arguments cost the driver, the scheduler and the worker as many graph nodes
as they hold).

A cohort is not a barrier. A stage task returns once a member is done and either no other member
finished within ``grace_s`` after the last one, or the first one done has waited
:data:`HOLD_FRACTION` of its own stage time (at least ``2 x grace_s``): members finishing in the
engine's consecutive batched forward passes leave together, a straggler holds no one. The
members still running go on in the background on that worker and come back as
:class:`Deferred` markers, which the later stages pass through; the driver picks them up with
:func:`collect` on the same worker, which returns under the same rule. The engine, not the
cohort, batches the forward passes; a backend that offers ``members(n)`` (the ``hf`` engine) is
told of a stage's members first, so that their requests, queued one thread after another, share
a pass. ``grace_s=None`` keeps a stage waiting for every member (a
barrier per cohort per turn: the baseline the benchmark measures it with).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from enum import Enum
from typing import Any

_POOL = ThreadPoolExecutor(max_workers=256, thread_name_prefix="rollarc-cohort")
# members still running after their stage task returned, by handle: (registered at, {index:
# future}); taken by ``collect``. Entries nobody collects (a driver that gave up on them) are
# dropped after PENDING_TTL_S.
_PENDING: dict[str, tuple[float, dict[int, Future]]] = {}
_PENDING_LOCK = threading.Lock()
PENDING_TTL_S = 3600.0
# the most a finished member waits for its mates, as a share of its own stage time
HOLD_FRACTION = 0.25


class Members(list):
    """A stage's results, one slot per member: a list Dask pickles whole. A plain ``list``
    task result is serialised element by element (``distributed``'s ``to_serialize`` iterates
    lists, a header and frames per element), which for a cohort of ~50 small records cost two
    to three times the CPU of one pickle, on the worker sending it and the one receiving it."""

    __slots__ = ()


class Phase(Enum):
    """The stage a deferred member was still running."""

    ENV_RESET = "env_reset"
    PREFILL = "prefill"
    DECODE = "decode"
    ENV_STEP = "env_step"


@dataclass(frozen=True)
class Deferred:
    """A member still running ``phase`` in the background on the worker that returned this:
    :func:`collect` there with ``handle`` and ``index`` takes its result."""

    phase: Phase
    handle: str
    index: int


@dataclass(frozen=True)
class Ended:
    """A look-ahead turn whose turn before ended the episode (done, or the context full):
    nothing ran, and the driver ignores it."""


ENDED = Ended()


def ended(obs: Any) -> bool:
    """Whether ``obs`` (a turn's answer) ends its episode whatever the driver makes of it."""
    return bool(getattr(obs, "done", False) or getattr(getattr(obs, "sample", None),
                                                       "context_full", False))


@dataclass
class MemberError:
    """A member's stage raised: its type and message (the others went on)."""

    error: str

    @classmethod
    def of(cls, exc: BaseException) -> MemberError:
        return cls(f"{type(exc).__name__}: {str(exc)[:300]}")


def close_after(registry: Any, env_close: Callable[..., bool], handle: Any,
                created: Any = None) -> bool:
    """``env_close`` of an instance, run once ``created`` (the reset that creates it, passed
    as a future) has run: a trajectory abandoned while its reset was still running must not
    leave the instance behind."""
    return env_close(registry, handle)


def by_source(refs: list[Any]) -> tuple[list[Any], list[tuple[int, Any]]]:
    """Members' inputs as one task argument ``(sources, items)``: each ``(results, index)``
    pair (``results`` an earlier cohort's future, or its list) becomes ``(k, index)``, element
    ``index`` of ``sources[k]``, where ``sources`` holds each ``results`` once; any other input
    ``value`` becomes ``(-1, value)``. Plain tuples of ints cost the graph least (a dataclass
    per member costs the driver about twice as much to submit)."""
    sources: list[Any] = []
    at: dict[Any, int] = {}
    items: list[tuple[int, Any]] = []
    for ref in refs:
        if isinstance(ref, tuple):
            results, index = ref
            k = at.setdefault(getattr(results, "key", None) or id(results), len(sources))
            if k == len(sources):
                sources.append(results)
            items.append((k, index))
        else:
            items.append((-1, ref))
    return sources, items


def inputs(arg: Any) -> list[Any]:
    """Each member's input: from ``(sources, items)`` (:func:`by_source`, its sources resolved
    by Dask), or a plain list of the inputs themselves."""
    if isinstance(arg, tuple):
        sources, items = arg
        return [sources[k][x] if k >= 0 else x for k, x in items]
    return arg


def _guard(fn: Callable[[int], Any], i: int) -> Any:
    try:
        return fn(i)
    except Exception as exc:  # the member's own failure, reported in its slot
        return MemberError.of(exc)


def each(fn: Callable[[int], Any], n: int, phase: Phase | None = None,
         grace_s: float | None = None, inline: bool = False) -> Members:
    """``fn(i)`` for every member, concurrently when there are several. With ``grace_s``, the
    members not done when the task returns (see the module docstring) are :class:`Deferred`
    markers of ``phase``. ``inline``: one after another in the calling thread, for members
    that neither wait nor share a forward pass (each is done when the task returns)."""
    if n == 1 or inline:
        return Members(_guard(fn, i) for i in range(n))
    started = time.monotonic()
    futures = {i: _POOL.submit(_guard, fn, i) for i in range(n)}
    if grace_s is None or phase is None:
        return Members(futures[i].result() for i in range(n))
    return _drain(futures, phase, uuid.uuid4().hex, grace_s, started)


def _drain(futures: dict[int, Future], phase: Phase, handle: str, grace_s: float,
           started: float) -> Members:
    """The results of ``futures`` (index -> future) in index order, under the rule of the
    module docstring; the rest as markers, registered under ``handle``."""
    pending = set(futures.values())
    _done, pending = wait(pending, return_when=FIRST_COMPLETED)
    first = time.monotonic()
    deadline = first + max(2 * grace_s, HOLD_FRACTION * (first - started))
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        more, pending = wait(pending, timeout=min(grace_s, left), return_when=FIRST_COMPLETED)
        if not more:
            break
    later = {i: f for i, f in futures.items() if not f.done()}
    if later:
        now = time.monotonic()
        with _PENDING_LOCK:
            for h in [h for h, (at, _f) in _PENDING.items() if now - at > PENDING_TTL_S]:
                del _PENDING[h]
            _PENDING[handle] = (now, later)
    return Members(Deferred(phase, handle, i) if i in later else f.result()
                   for i, f in sorted(futures.items()))


def collect(handle: str, indices: list[int], phase: Phase, grace_s: float) -> Members:
    """The deferred members ``indices`` of ``handle``, aligned with ``indices``, under the same
    rule as a stage (those still running stay deferred). A handle this worker does not hold
    (it restarted) fails those members with a reason."""
    with _PENDING_LOCK:
        _at, held = _PENDING.get(handle, (0.0, {}))
        futures = {i: held[i] for i in indices if i in held}
    missing = [i for i in indices if i not in futures]
    out = dict.fromkeys(missing, MemberError(
        f"DeferredLost: {phase.value} of this member is not held here any more"))
    if futures:
        drained = _drain(futures, phase, handle, grace_s, time.monotonic())
        with _PENDING_LOCK:  # what _drain registered again is still pending; the rest is taken
            _at, held = _PENDING.get(handle, (0.0, {}))
            for i, f in futures.items():
                if f.done():
                    held.pop(i, None)
            if not held:
                _PENDING.pop(handle, None)
        out |= dict(zip(sorted(futures), drained, strict=True))
    return Members(out[i] for i in indices)


def pending_members() -> int:
    """Members of this worker still running in the background (for tests and reports)."""
    with _PENDING_LOCK:
        return sum(len(f) for _at, f in _PENDING.values())


def _shape(shape: Any) -> dict:
    """A turn's virtual lengths go only where there are some (stage functions written before
    emulated devices need not take them)."""
    return {"shape": shape} if shape is not None else {}


def _failed(*values: Any) -> MemberError | Deferred | Ended | None:
    """An input that ends the member's stage at once: an earlier failure, an earlier stage
    still running (passed on to the driver), or an episode already over."""
    return next((v for v in values if isinstance(v, MemberError | Deferred | Ended)), None)


def env_reset_many(registry, tokenizer, reset_fn, specs: list[dict], seeds: list[int],
                   instance_ids: list[str], system_prompt: str | None,
                   grace_s: float | None = None) -> list:
    return each(lambda i: reset_fn(registry, tokenizer, specs[i], seeds[i], instance_ids[i],
                                   system_prompt), len(specs), Phase.ENV_RESET, grace_s)


def _on_backend(backend, fn: Callable[[int], Any], n: int, phase: Phase,
                grace_s: float | None) -> list[Any]:
    """:func:`each` of ``fn``, with the members announced to a backend that batches the calls
    of concurrent members (``members(n)``, the ``hf`` engine's) so that they share its passes."""
    members = getattr(backend, "members", None)
    if n == 1 or members is None:
        return each(fn, n, phase, grace_s)
    with members(n) as run:
        return each(lambda i: run(fn, i), n, phase, grace_s)


def prefill_many(backend, prefill_fn, pasts, observations, shapes: list,
                 grace_s: float | None = None) -> list:
    """``pasts`` and ``observations``: the members' inputs (:func:`inputs`)."""
    pasts, observations = inputs(pasts), inputs(observations)

    def one(i):
        past, obs = pasts[i], observations[i]
        if ended(obs):  # a look-ahead turn after the episode's last
            return ENDED
        return _failed(past, obs) or prefill_fn(backend, past, obs, **_shape(shapes[i]))

    together = getattr(prefill_fn, "together", None)
    if together is not None and len(observations) > 1:
        out = _prefill_together(backend, together, pasts, observations)
        if out is not None:
            return out
    return _on_backend(backend, one, len(observations), Phase.PREFILL, grace_s)


def _prefill_together(backend, together: Callable, pasts: list, observations: list
                      ) -> Members | None:
    """The members' prefills through the stage function's batched form ``together``
    (:func:`tasks.generation.prefill_together`), all done when it returns; None where the
    backend has none."""
    out = Members(ENDED if ended(obs) else _failed(past, obs)
                  for past, obs in zip(pasts, observations, strict=True))
    live = [i for i, o in enumerate(out) if o is None]
    if not live:
        return out
    try:
        results = together(backend, [pasts[i] for i in live], [observations[i] for i in live])
    except Exception as exc:  # the pass failed: every member it held
        results = [exc] * len(live)
    if results is None:
        return None
    for i, r in zip(live, results, strict=True):
        out[i] = MemberError.of(r) if isinstance(r, Exception) else r
    return out


def decode_many(backend, decode_fn, prefilled: list, pasts, params: list, seeds: list,
                shapes: list, grace_s: float | None = None) -> list:
    pasts = inputs(pasts)

    def one(i):
        past = pasts[i]
        return _failed(prefilled[i], past) or decode_fn(backend, prefilled[i], past, params[i],
                                                        seeds[i], **_shape(shapes[i]))

    inline = getattr(backend, "decodes_inline", None)
    if inline is not None and all(inline(p) for p in params):
        return each(one, len(prefilled), inline=True)
    return _on_backend(backend, one, len(prefilled), Phase.DECODE, grace_s)


def _quick_step(registry, obs: Any) -> bool:
    """Whether the member's step is quick (``quick_step`` declared by its environment's own
    class: a subclass, which may wait in its ``step``, declares it again), or fails at once."""
    if isinstance(obs, MemberError | Deferred | Ended):
        return True
    try:
        env = registry.get(obs.handle.instance_id)
    except KeyError:  # not live here: the member's step fails at once
        return True
    return bool(vars(type(env)).get("quick_step", False))


def env_step_many(registry, tokenizer, step_fn, response_fn, observations,
                  decoded: list, grace_s: float | None = None) -> list:
    observations = inputs(observations)

    def one(i):
        obs = observations[i]
        return _failed(obs, decoded[i]) or step_fn(registry, tokenizer, obs,
                                                   response_fn(decoded[i]))

    # a thread each lets waiting steps overlap; quick ones go one after another, a thread each
    # costing more than the step
    inline = all(_quick_step(registry, o) for o in observations)
    return each(one, len(decoded), Phase.ENV_STEP, grace_s, inline=inline)
