"""Workers that advertise their hardware, and the pools the driver builds from them.

A worker of an external cluster is started with this module as its Dask preload::

    dask worker tcp://HOST:8786 --preload resources.hardware --hardware H800 --gpus 8 --role inference

(``dask worker`` hands the options it does not know to the preload's click command.) Without
``--hardware`` the worker detects its device: the first CUDA device's name mapped onto a catalog
profile, or the CPU profile without CUDA.

The advertisement travels as *startup information*: the preload adds an entry to the worker's
``startup_information`` (the hook Dask's own NVML GPU report uses), the worker sends it once when
it registers, the scheduler keeps it in the ``WorkerState.extra`` it returns, and
``Client.scheduler_info()`` lists it in each worker's entry under :data:`ADVERT_KEY`. The driver
reads every worker's advertisement in that one call; nothing runs on the workers per lookup.

On connecting, :func:`adopt_hardware` groups the advertising workers into pools by (profile,
gpus, role), lets the same router as the embedded cluster's tag them, and sets each worker's
Dask resources with ``Worker.set_resources`` (run on the worker, which tells the scheduler).
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import click
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from resources.catalog import CATALOG
from resources.pools import PoolSpec, Role, Tag

if TYPE_CHECKING:
    from distributed import Client, Worker

logger = logging.getLogger(__name__)

ADVERT_KEY = "rollarc_hardware"
CPU_PROFILE = "CPU"
# A GPU the catalog does not know is advertised as the catalog's slowest GPU, so the cost model
# never credits it with more FLOP/s or bandwidth than it may have.
FALLBACK_GPU_PROFILE = "A100"

# What the router must tag a pool with: its hardware and its job.
PoolRouter = Callable[[list[PoolSpec]], dict[str, list[Tag]]]


class Advert(BaseModel):
    """What one worker declares about itself."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    profile: str = Field(description="Hardware profile name (catalog or affinity.profiles)")
    gpus: int = Field(default=1, ge=1, description="Devices behind the worker")
    role: Role = Field(description="What the worker's pool is for")
    slots: int | None = Field(
        default=None,
        ge=1,
        description="Concurrent tasks (resource total); null: the worker's nthreads",
    )
    source: str = Field(default="declared", description="declared | detected | fallback")


def profile_for_gpu_name(name: str, catalog: Mapping[str, Any] = CATALOG) -> str | None:
    """The catalog profile a CUDA device name denotes, or None.

    Names are matched token by token ("NVIDIA H20" is H20, "NVIDIA H200 NVL" is H200,
    "NVIDIA A100-SXM4-80GB" is A100), so one profile's name never matches as another's prefix.
    """
    gpus = {n.upper(): n for n, p in catalog.items() if getattr(p, "accelerator", True)}
    for token in re.split(r"[^0-9A-Za-z]+", name.upper()):
        if token in gpus:
            return gpus[token]
    return None


def detect() -> tuple[str, int, str]:
    """This machine's profile, device count and how the profile was found."""
    try:
        import torch
    except ImportError:
        return CPU_PROFILE, 1, "detected"
    if not torch.cuda.is_available():
        return CPU_PROFILE, 1, "detected"
    name = torch.cuda.get_device_name(0)
    count = torch.cuda.device_count()
    profile = profile_for_gpu_name(name)
    if profile is None:
        logger.warning(
            "GPU %r matches no catalog profile (%s); advertising %s, the fallback. "
            "Pass --hardware NAME (defined under affinity.profiles if not in the "
            "catalog) to route on its real figures",
            name,
            ", ".join(n for n, p in CATALOG.items() if p.accelerator),
            FALLBACK_GPU_PROFILE,
        )
        return FALLBACK_GPU_PROFILE, count, "fallback"
    return profile, count, "detected"


def make_advert(
    hardware: str | None, gpus: int | None, role: str | None, slots: int | None
) -> Advert:
    """The advertisement of declared options, detecting what is left out. The role defaults to
    inference on a GPU and env on a CPU."""
    if hardware is None:
        profile, found_gpus, source = detect()
    else:
        profile, found_gpus, source = hardware, 1, "declared"
        if hardware not in CATALOG:
            logger.warning(
                "hardware %r is not in the built-in catalog: the driver's "
                "affinity.profiles must define it",
                hardware,
            )
    accelerator = CATALOG[profile].accelerator if profile in CATALOG else True
    default_role = Role.INFERENCE if accelerator else Role.ENV
    return Advert(
        profile=profile,
        gpus=gpus or found_gpus,
        role=Role(role or default_role),
        slots=slots,
        source=source,
    )


@click.command(name="resources.hardware")
@click.option(
    "--hardware",
    default=None,
    help="Profile name (H800, H20, H200, CPU, ...); "
    "default: detected from the first CUDA device, else CPU",
)
@click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    help="Devices behind this worker; default: the CUDA device count, else 1",
)
@click.option(
    "--role",
    type=click.Choice([r.value for r in Role]),
    default=None,
    help="Pool role; default: inference on a GPU, env on a CPU",
)
@click.option(
    "--slots",
    type=click.IntRange(min=1),
    default=None,
    help="Concurrent tasks (the resource total); default: the worker's nthreads",
)
def dask_setup(
    worker: Worker, hardware: str | None, gpus: int | None, role: str | None, slots: int | None
) -> None:
    """Dask preload: advertise this worker's hardware to the scheduler."""
    if not hasattr(worker, "startup_information"):
        raise click.UsageError(
            "resources.hardware is a worker preload (--preload), not a nanny or scheduler one"
        )
    advert = make_advert(hardware, gpus, role, slots)
    payload = advert.model_dump(mode="json")
    # Preloads start before the worker registers, so the entry goes with its registration.
    worker.startup_information[ADVERT_KEY] = lambda _worker: payload
    logger.info("advertising hardware %s", payload)


def read_adverts(workers: Mapping[str, Mapping[str, Any]]) -> dict[str, Advert]:
    """The advertisements in ``Client.scheduler_info()["workers"]``; a malformed one is
    logged and its worker treated as not advertising."""
    adverts = {}
    for addr, info in workers.items():
        raw = info.get(ADVERT_KEY)
        if raw is None:
            continue
        try:
            adverts[addr] = Advert.model_validate(raw)
        except ValidationError as exc:
            logger.warning("worker %s advertises malformed hardware %r: %s", addr, raw, exc)
    return adverts


def group_pools(
    adverts: Mapping[str, Advert],
    nthreads: Mapping[str, int],
) -> tuple[list[PoolSpec], dict[str, str], dict[str, int]]:
    """Pools of workers with the same (profile, gpus, role), named '<profile>-<role>' (with
    'x<gpus>' after the profile where two pools would share a name); returns the pools, each
    worker's pool and each worker's slots."""
    groups: dict[tuple[str, int, Role], list[str]] = defaultdict(list)
    for addr, a in adverts.items():
        groups[(a.profile, a.gpus, a.role)].append(addr)
    short = defaultdict(int)
    for profile, _, role in groups:
        short[(profile, role)] += 1
    slots = {addr: a.slots or max(int(nthreads.get(addr, 1)), 1) for addr, a in adverts.items()}
    pools, worker_pool = [], {}
    for (profile, gpus, role), addrs in sorted(groups.items()):
        size = f"x{gpus}" if short[(profile, role)] > 1 else ""
        name = f"{profile}{size}-{role.value}"
        pools.append(
            PoolSpec(
                name=name,
                profile=profile,
                role=role,
                workers=len(addrs),
                slots=max(slots[a] for a in addrs),
                gpus=gpus,
            )
        )
        worker_pool.update(dict.fromkeys(addrs, name))
    return pools, worker_pool, slots


def worker_resources(
    worker_pool: Mapping[str, str],
    slots: Mapping[str, int],
    tags: Mapping[str, list[Tag]],
    current: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, dict[str, float]]:
    """Each worker's Dask resources: its slots for each tag of its pool, and 0 for a tag it
    has now (``current``) that its pool no longer carries: a tag left from an earlier routing
    or a static --resources would otherwise still draw that stage's tasks."""
    current = current or {}
    out = {}
    for addr, pool in worker_pool.items():
        res = {str(t): 0.0 for t in Tag if current.get(addr, {}).get(str(t), 0) > 0}
        res.update({str(t): float(slots[addr]) for t in tags[pool]})
        out[addr] = res
    return out


def adopt_joiner(client: Client, address: str, workers: Mapping[str, Mapping[str, Any]],
                 pool_tags: Mapping[str, list[Tag]]) -> tuple[str, dict[str, float]] | None:
    """A worker advertising hardware joined a running run: tag it as the pool of its kind was
    tagged at connect time (the routing is not redone mid-run). ``workers`` is the scheduler's
    view, the joiner included. None: it advertises nothing, or hardware no pool has."""
    adverts = read_adverts(workers)
    if address not in adverts:
        return None
    nthreads = {a: int(w.get("nthreads", 1)) for a, w in workers.items()}
    _, worker_pool, slots = group_pools(adverts, nthreads)
    pool = worker_pool[address]
    if pool not in pool_tags:
        logger.warning("worker %s advertises %s, a kind no pool of this run has: left idle "
                       "until the next run routes it", address, pool)
        return None
    current = {address: workers[address].get("resources") or {}}
    res = worker_resources({address: pool}, slots, pool_tags, current)[address]
    client.run(_set_resources, resources=res, workers=[address])
    return pool, {k: v for k, v in res.items() if v > 0}


async def _set_resources(dask_worker: Worker, resources: dict[str, float]) -> None:
    # Worker.set_resources updates the worker's own accounting and then the scheduler's;
    # setting only the scheduler's would leave the worker refusing the tasks it is sent.
    await dask_worker.set_resources(**resources)


def adopt_hardware(
    client: Client, workers: Mapping[str, Mapping[str, Any]], route_pools: PoolRouter
) -> dict[str, tuple[str, dict[str, float]]]:
    """Pool, route and tag the advertising workers; returns worker -> (pool, resources)."""
    adverts = read_adverts(workers)
    if not adverts:
        return {}
    nthreads = {a: int(w.get("nthreads", 1)) for a, w in workers.items()}
    pools, worker_pool, slots = group_pools(adverts, nthreads)
    members = defaultdict(list)
    for addr, pool in worker_pool.items():
        members[pool].append(addr)
    logger.info("hardware pools: %s", {p.name: sorted(members[p.name]) for p in pools})
    if not any(p.role in (Role.INFERENCE, Role.ALL) for p in pools):
        raise ValueError(
            "workers advertise hardware but none with role inference or all: "
            f"{sorted(members)}; start the GPU workers with --preload "
            "resources.hardware --role inference too"
        )
    tags = route_pools(pools)
    logger.info("hardware pool tags: %s", {p: [t.value for t in ts] for p, ts in tags.items()})
    current = {a: w.get("resources") or {} for a, w in workers.items()}
    resources = worker_resources(worker_pool, slots, tags, current)
    for addr, res in resources.items():
        client.run(_set_resources, resources=res, workers=[addr])
    return {addr: (worker_pool[addr], resources[addr]) for addr in worker_pool}
