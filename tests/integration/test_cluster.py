"""On a real local Dask cluster (worker processes advertising pool tags): the KV hand-off moves
the cache worker to worker, and stages land only on their pools."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from distributed import Scheduler

from flows.config import load_config
from flows.training.launch import make_cluster
from resources.pools import Stage, Tag, demand
from resources.worker import RollArcWorkerPlugin, plain, with_backend, with_envs
from tasks.env_steps import env_reset
from tasks.generation import decode, prefill, response_of
from tasks.policy import kv_geometry, load_tokenizer
from tasks.records import SamplingParams

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster():
    cfg = load_config(overrides=["cluster.dashboard_port=0"])
    handle = make_cluster(cfg, None)
    handle.client.register_plugin(RollArcWorkerPlugin(policy=cfg.policy.model_dump(),
                                                      hparams=cfg.trainer.hparams.model_dump()))
    yield cfg, handle
    handle.close()


def _transfer_log(dask_worker):
    return [dict(keys=dict(e["keys"]), total=e["total"], who=e["who"])
            for e in dask_worker.transfer_incoming_log]


def test_kv_handoff_moves_the_cache_between_worker_processes(cluster, policy):
    cfg, h = cluster
    c = h.client
    env_w, pre_w, dec_w = (h.workers_with(t)[0] for t in (Tag.CPU_ENV, Tag.GPU_COMPUTE,
                                                           Tag.GPU_BANDWIDTH))
    pids = c.run(os.getpid)
    assert len({pids[env_w], pids[pre_w], pids[dec_w]}) == 3

    tok = load_tokenizer(cfg.policy)
    layers, kv_heads, head_dim = kv_geometry(policy[0])
    per_token = layers * 2 * kv_heads * head_dim * 4  # float32 bytes
    params = SamplingParams(max_new_tokens=3)
    env_spec = cfg.env_tasks[0].env

    def sub(stage, adapter, fn, *args, worker, **kw):
        return c.submit(adapter, fn, *args, workers=[worker], allow_other_workers=False,
                        resources=demand(stage), pure=False, key=f"{stage.value}-kvtest-{len(kw)}-"
                        f"{np.random.randint(1 << 30)}", **kw)

    obs = sub(Stage.ENV_RESET, with_envs, env_reset, env_spec, 0, "kvtest.0", None, worker=env_w)
    pre0 = sub(Stage.PREFILL, with_backend, prefill, None, obs, worker=pre_w)
    dec0 = sub(Stage.DECODE, with_backend, decode, pre0, None, params=params, seed=0,
               worker=dec_w)
    sample0 = sub(Stage.DECODE, plain, response_of, dec0, worker=dec_w).result()
    n_prompt = len(obs.result().input_ids)
    # decode ran the tokens it sampled but the last (the next prefill reads it first)
    assert sample0.decode_tokens_processed == len(sample0.token_ids) - 1
    def recomputed(worker, stage):
        return c.submit(with_backend, lambda b: b.store.stats.recomputed_tokens,
                        workers=[worker], allow_other_workers=False, resources=demand(stage),
                        pure=False).result()

    before = recomputed(pre_w, Stage.PREFILL), recomputed(dec_w, Stage.DECODE)
    # second turn: the cache handle comes back from the decode worker to the prefill worker,
    # which holds the conversation's KV but for the tokens decode ran
    pre1 = sub(Stage.PREFILL, with_backend, prefill, dec0, obs, worker=pre_w)
    dec1 = sub(Stage.DECODE, with_backend, decode, pre1, dec0, params=params, seed=1,
               worker=dec_w)
    dec1_tokens = c.submit(lambda d: d.cache.n_tokens, dec1, workers=[dec_w], pure=False,
                           resources=demand(Stage.DECODE)).result()
    n0 = n_prompt + len(sample0.token_ids) - 1  # the cache after turn 0: all but the last token
    assert dec1_tokens == n0 + 1 + n_prompt + len(c.submit(
        lambda d: d.sample.token_ids, dec1, workers=[dec_w], pure=False,
        resources=demand(Stage.DECODE)).result()) - 1

    # what actually crosses the wire: the serialised result, dominated by the cache
    wire = c.submit(lambda p: len(pickle.dumps(p, protocol=5)), pre0, workers=[pre_w],
                    pure=False, resources=demand(Stage.PREFILL)).result()
    assert n_prompt * per_token <= wire <= n_prompt * per_token * 1.1 + 4096
    logs = c.run(_transfer_log)
    vocab = len(tok)
    # prefill -> decode: the new tokens' KV plus one row of logits
    moved = [e for e in logs[dec_w] if pre0.key in e["keys"]]
    assert moved and moved[0]["who"] == pre_w
    expect = n_prompt * per_token + vocab * 4
    assert expect <= moved[0]["keys"][pre0.key] <= expect * 1.1 + 2048
    # decode -> prefill: the handle (the conversation's tokens and the sample), not the cache
    back = [e for e in logs[pre_w] if dec0.key in e["keys"]]
    assert back and back[0]["who"] == dec_w
    assert back[0]["keys"][dec0.key] < n0 * per_token / 4
    # the prefill worker ran again only the tokens decode ran, the decode worker nothing
    after = recomputed(pre_w, Stage.PREFILL), recomputed(dec_w, Stage.DECODE)
    assert (after[0] - before[0], after[1] - before[1]) == (sample0.decode_tokens_processed, 0)
    # decode's own past cache was already local: never fetched by the decode worker
    assert not [e for e in logs[dec_w] if dec0.key in e["keys"]]
    assert obs.key not in {k for e in logs[dec_w] for k in e["keys"]}


def test_the_embedded_scheduler_keeps_short_logs_of_messages_and_tasks(cluster):
    """Dask's logs of recent messages and the dashboard's task stream are bounded (a long run's
    driver hosts the embedded scheduler; unbounded, they grow it step after step)."""
    from distributed.diagnostics.task_stream import TaskStreamPlugin

    from resources.cluster import DEBUG_LOG_LENGTH, TASK_STREAM_LENGTH

    def lengths(dask_scheduler):
        plugin = TaskStreamPlugin(dask_scheduler)  # what the dashboard and report install
        return plugin.buffer.maxlen, dask_scheduler.transition_log.maxlen

    _cfg, h = cluster
    assert h.client.run_on_scheduler(lengths) == (TASK_STREAM_LENGTH, DEBUG_LOG_LENGTH)


def test_the_embedded_clusters_worker_processes_are_watched_and_keep_freed_memory(cluster):
    """By default every worker process of the embedded cluster has the watchdog that writes
    its threads' stacks when its event loop stops turning (``cluster.stall_dump_s``, 30 s;
    tests/integration/test_stall_watch.py blocks one) and keeps up to 1 GiB of freed memory for
    reuse (``cluster.heap_keep_mb``; tests/unit/resources/test_heap.py)."""
    from resources.heap import PLUGIN_NAME as HEAP
    from resources.stall_watch import CALLBACK, TICKS_PER_PERIOD

    cfg, h = cluster
    assert (cfg.cluster.stall_dump_s, cfg.cluster.heap_keep_mb) == (30, 1024)
    settings = h.client.run(lambda dask_worker: (
        dask_worker.periodic_callbacks[CALLBACK].callback_time
        if CALLBACK in dask_worker.periodic_callbacks else None,
        dask_worker.plugins[HEAP].nbytes, dask_worker.plugins[HEAP].applied))
    assert len(settings) == len(h.worker_pool)
    assert set(settings.values()) == {(30_000 / TICKS_PER_PERIOD, 1 << 30, True)}


@pytest.mark.long
def test_a_killed_worker_whose_restart_is_slow_comes_back(tmp_path):
    """SpecCluster closes the Nanny of a lost worker that has not come back within
    distributed.deploy.lost-worker-timeout (15 s by default; 1 s here, against a 4 s restart):
    its pool stays empty for good. The embedded cluster waits as long as the run would.

    A Nanny closed while its worker restarts first lets the worker finish starting (Nanny.kill
    waits for it), so that worker can register for a moment before it is stopped: what tells
    the two apart is whether the pool still has its worker once the restart is over."""
    import time
    from signal import SIGKILL

    import dask
    from distributed import Client, Nanny, SpecCluster

    from resources.cluster import LOST_WORKER_TIMEOUT, keep_restarting_lost_workers

    marker = tmp_path / "slow"

    def kill_and_wait(keep: bool) -> bool:
        """Whether the pool has its worker 15 s after the kill (with ``keep``, as soon as it
        is back: nothing closes it before 30 s)."""
        marker.unlink(missing_ok=True)
        with dask.config.set({LOST_WORKER_TIMEOUT: "1s"}):
            if keep:
                keep_restarting_lost_workers(30)
            spec = {"w": {"cls": Nanny, "options": {
                "nthreads": 1, "preload": ["tests.slow_restart"], "silence_logs": 40,
                "env": {"ROLLARC_TEST_SLOW_START": str(marker)}}}}
            with SpecCluster(workers=spec, scheduler={"cls": Scheduler, "options": {
                    "dashboard_address": ":0"}}, silence_logs=40) as cluster, \
                    Client(cluster) as client:
                client.wait_for_workers(1, timeout=60)
                marker.write_text("4")
                ((killed, pid),) = client.run(os.getpid).items()
                os.kill(pid, SIGKILL)
                # the scheduler first drops the killed worker (on a busy machine it can still list
                # it a moment later); only a worker that registers after that has come back
                deadline = time.monotonic() + 15
                while killed in client.scheduler_info(n_workers=-1)["workers"]:
                    assert time.monotonic() < deadline, "the killed worker was never dropped"
                    time.sleep(0.1)
                while time.monotonic() < deadline:
                    time.sleep(0.5)
                    if keep and client.scheduler_info(n_workers=-1)["workers"]:
                        return "w" in cluster.workers
                return bool(client.scheduler_info(n_workers=-1)["workers"]
                            or "w" in cluster.workers)

    assert not kill_and_wait(keep=False)  # the failure, reproduced
    assert kill_and_wait(keep=True)
