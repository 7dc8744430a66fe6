"""Cohorts: one Dask task runs one stage for several trajectories at once.

A Dask task costs about a millisecond of scheduler and worker time whatever it computes; a turn of
the tiny policy computes for about as long. The rollout driver therefore submits the turns that
are ready at the same moment, on the same workers, as one *cohort*: one env_reset, prefill,
decode and env_step task for all of them. Inside a task the members run concurrently (a thread
each), so the inference backend batches their forward passes into shared ones and remote
environments wait side by side; each member's result, or its error, has its own slot, so one
member's failure never fails the others.

Members refer to earlier results by ``(list, index)`` pairs: Dask resolves the future inside the
pair to the earlier cohort's result list, and :func:`pick` takes the member's element.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

_POOL = ThreadPoolExecutor(max_workers=256, thread_name_prefix="rollarc-cohort")


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


def pick(ref: Any) -> Any:
    """A member's value: ``(list, index)`` from an earlier cohort, or the value itself."""
    if isinstance(ref, tuple):
        results, index = ref
        return results[index]
    return ref


def _guard(fn: Callable[[int], Any], i: int) -> Any:
    try:
        return fn(i)
    except Exception as exc:  # the member's own failure, reported in its slot
        return MemberError.of(exc)


def each(fn: Callable[[int], Any], n: int) -> list[Any]:
    """``fn(i)`` for every member, concurrently when there are several."""
    if n == 1:
        return [_guard(fn, 0)]
    return list(_POOL.map(lambda i: _guard(fn, i), range(n)))


def _shape(shape: Any) -> dict:
    """A turn's virtual lengths go only where there are some (stage functions written before
    emulated devices need not take them)."""
    return {"shape": shape} if shape is not None else {}


def _failed(*values: Any) -> MemberError | None:
    return next((v for v in values if isinstance(v, MemberError)), None)


def env_reset_many(registry, tokenizer, reset_fn, specs: list[dict], seeds: list[int],
                   instance_ids: list[str], system_prompt: str | None) -> list:
    return each(lambda i: reset_fn(registry, tokenizer, specs[i], seeds[i], instance_ids[i],
                                   system_prompt), len(specs))


def prefill_many(backend, prefill_fn, pasts: list, observations: list, shapes: list) -> list:
    def one(i):
        past, obs = pick(pasts[i]), pick(observations[i])
        return _failed(past, obs) or prefill_fn(backend, past, obs, **_shape(shapes[i]))

    return each(one, len(observations))


def decode_many(backend, decode_fn, prefilled: list, pasts: list, params: list, seeds: list,
                shapes: list) -> list:
    def one(i):
        past = pick(pasts[i])
        return _failed(prefilled[i], past) or decode_fn(backend, prefilled[i], past, params[i],
                                                        seeds[i], **_shape(shapes[i]))

    return each(one, len(prefilled))


def env_step_many(registry, tokenizer, step_fn, response_fn, observations: list,
                  decoded: list) -> list:
    def one(i):
        obs = pick(observations[i])
        return _failed(obs, decoded[i]) or step_fn(registry, tokenizer, obs,
                                                   response_fn(decoded[i]))

    return each(one, len(decoded))
