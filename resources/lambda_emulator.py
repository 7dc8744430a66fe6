"""A local emulation of the AWS Lambda Invoke API, for boto3 with ``endpoint_url``.

It serves ``POST /2015-03-31/functions/{name}/invocations`` on 127.0.0.1 (another address is
logged as reachable from other machines) the way Lambda does, so the reward client's code path
is the one that talks to AWS:

- ``X-Amz-Invocation-Type``: ``RequestResponse`` (200 and the handler's JSON), ``Event`` (202;
  runs in the background, queued rather than throttled, as Lambda queues async events) and
  ``DryRun`` (204);
- a handler exception: 200 with ``X-Amz-Function-Error: Unhandled`` and the error JSON
  ``{errorMessage, errorType, requestId, stackTrace}``; a handler running past the function's
  timeout is stopped with ``Task timed out after N seconds``;
- ``ResourceNotFoundException`` (404) for an unknown function, ``RequestTooLargeException`` (413)
  over the payload limit (6 MB sync, 1 MB async), ``InvalidRequestContentException`` (400) for a
  body that is not JSON, and ``TooManyRequestsException`` (429) when more synchronous calls arrive
  than the function's concurrency;
- ``X-Amz-Log-Type: Tail``: the last 4 KB of the invocation's output, base64, ending with a
  ``REPORT`` line that carries ``Init Duration`` on a cold start, as Lambda writes it;
- ``GetFunction``, ``GetFunctionConfiguration`` and ``ListFunctions``
  (:mod:`resources.lambda_management`), so that ``aws lambda list-functions --endpoint-url ...``
  works; any other route answers with Lambda's JSON error shape.

Each function runs in its own pool of worker processes (spawned, like sandboxes:
:mod:`resources.lambda_sandbox`), as many as its concurrency; this module holds the functions,
their concurrency slots and warm sandboxes, and the service's life cycle and counts, while
:mod:`resources.lambda_http` holds the routes, status codes and headers. A cold start is a
new process's first import of the handler module and its set-up; ``init_delay_s`` adds to it
and ``latency_s`` adds to every call (standing in for a remote service: the caller waits, no
core is burnt). Function definitions come from the SAM template
(:func:`LambdaEmulator.from_template`), so the emulation runs what would be deployed.

Command line: ``python -m resources.lambda_emulator --port 3001`` (Ctrl-C stops it).
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time
from collections import Counter
from http.server import ThreadingHTTPServer
from pathlib import Path

from resources.lambda_http import make_server
from resources.lambda_management import FunctionCatalog
from resources.lambda_sandbox import FunctionSpec, Sandbox
from resources.net import warn_if_exposed

logger = logging.getLogger(__name__)

SYNC_PAYLOAD_LIMIT = 6 * 1024 * 1024
ASYNC_PAYLOAD_LIMIT = 1024 * 1024
MB_PER_VCPU = 1769  # Lambda allocates one vCPU per 1,769 MB of memory


# -- the service: functions, their concurrency slots and warm sandboxes ------------------------
class _Function:
    """A function's concurrency slots and its warm sandboxes."""

    def __init__(self, spec: FunctionSpec, concurrency: int, init_timeout_s: float):
        self.spec = spec
        self.concurrency = concurrency
        self.init_timeout_s = init_timeout_s
        self.slots = threading.BoundedSemaphore(concurrency)
        self._idle: list[Sandbox] = []
        self._all: list[Sandbox] = []
        self._lock = threading.Lock()
        self.env = dict(os.environ) | dict(spec.environment)
        # match torch/BLAS threads to the vCPUs the memory size buys, as in a Lambda sandbox
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, round(spec.memory_mb / MB_PER_VCPU))))
        # the handler's modules import as they do in the caller (what spawn would pass on)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [p for p in sys.path if p and os.path.isdir(p)]
            + [self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)

    def acquire(self) -> Sandbox:
        """A warm sandbox if one is idle, else a new one (a cold start)."""
        with self._lock:
            while self._idle:
                sb = self._idle.pop()
                if sb.alive:
                    return sb
            sb = Sandbox(self.spec, self.env)
            self._all.append(sb)
            return sb

    def release(self, sb: Sandbox) -> None:
        with self._lock:
            if sb.alive:
                self._idle.append(sb)
            else:
                self._all.remove(sb)

    def close(self) -> None:
        with self._lock:
            for sb in self._all:
                sb.close()
            self._all.clear()
            self._idle.clear()


class LambdaEmulator:
    """The Lambda Invoke API on a local port, running handlers in sandbox processes."""

    def __init__(self, functions: list[FunctionSpec], host: str = "127.0.0.1", port: int = 0,
                 concurrency: int = 4, latency_s: float = 0.0, init_delay_s: float = 0.0,
                 sync_payload_limit: int = SYNC_PAYLOAD_LIMIT,
                 async_payload_limit: int = ASYNC_PAYLOAD_LIMIT, region: str = "us-east-1",
                 account: str = "000000000000", init_timeout_s: float = 120.0,
                 faults: dict | None = None):
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.functions = {f.name: _Function(f, concurrency, init_timeout_s) for f in functions}
        self.catalog = FunctionCatalog(functions, region, account, concurrency)
        self.host, self.port = host, port
        self.latency_s, self.init_delay_s = latency_s, init_delay_s
        self.sync_payload_limit, self.async_payload_limit = sync_payload_limit, async_payload_limit
        self.region, self.account = region, account
        self._stats: Counter[str] = Counter()
        self._running = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._events: list[threading.Thread] = []
        # injected faults (FaultsConfig.reward's fields): rates of each kind, one draw per call
        self.faults = dict(faults or {})
        self._fault_rng = random.Random(self.faults.get("seed", 0))

    @classmethod
    def from_template(cls, template: str | Path | None = None, **kwargs) -> LambdaEmulator:
        """The functions of a SAM template (default: ``resources/lambda/template.yaml``)."""
        from resources.lambda_template import DEFAULT_TEMPLATE, function_specs, load_sam_template

        specs = function_specs(load_sam_template(template or DEFAULT_TEMPLATE))
        return cls([FunctionSpec(name, s["handler"], s["timeout_s"], s["memory_mb"],
                                 s["environment"], s["runtime"], s["package_type"],
                                 s["description"], tuple(s["architectures"]), s["tracing"],
                                 s["logical_id"], s["image_uri"])
                    for name, s in specs.items()], **kwargs)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> LambdaEmulator:
        warn_if_exposed("the Lambda emulation (it runs reward functions for any caller)",
                        self.host)
        self._server = make_server(self, self.host, self.port)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="lambda-emulator")
        self._thread.start()
        logger.info("Lambda emulation at %s: functions %s, concurrency %d", self.url,
                    sorted(self.functions), next(iter(self.functions.values())).concurrency
                    if self.functions else 0)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for t in self._events:
            t.join(timeout=30)
        for fn in self.functions.values():
            fn.close()

    def __enter__(self) -> LambdaEmulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stats(self) -> dict[str, int]:
        """Counts: invocations (handler runs), throttles, function_errors, cold_starts,
        not_found, too_large, bad_request, event, dry_run, max_concurrent."""
        with self._lock:
            return dict(self._stats)

    def count(self, key: str, n: int = 1) -> None:
        """Adds ``n`` to one of the counts of :meth:`stats`."""
        with self._lock:
            self._stats[key] += n

    # -- invocation --------------------------------------------------------------------------
    def draw_fault(self) -> str | None:
        """The fault injected into the next synchronous call, if any (counted in stats)."""
        f = self.faults
        with self._lock:
            u = self._fault_rng.random()
        for kind in ("throttle", "error_5xx", "timeout", "function_error"):
            rate = float(f.get(f"{kind}_rate", 0.0))
            if u < rate:
                self.count(f"injected_{kind}")
                return kind
            u -= rate
        return None

    def arn(self, name: str) -> str:
        return f"arn:aws:lambda:{self.region}:{self.account}:function:{name}"

    def run(self, fn: _Function, payload: bytes, request_id: str):
        """One invocation in a sandbox; the caller holds a concurrency slot."""
        with self._lock:
            self._running += 1
            self._stats["max_concurrent"] = max(self._stats["max_concurrent"], self._running)
        try:
            if self.latency_s:
                time.sleep(self.latency_s)
            sb = fn.acquire()
            cold = sb.fresh
            req = {"handler": fn.spec.handler, "function": fn.spec.name, "arn": self.arn(fn.spec.name),
                   "request_id": request_id, "memory_mb": fn.spec.memory_mb,
                   "timeout_s": fn.spec.timeout_s, "init_delay_s": self.init_delay_s if cold else 0}
            deadline = fn.spec.timeout_s + (fn.init_timeout_s + self.init_delay_s if cold else 0)
            try:
                reply, body = sb.call(req, payload, deadline)
            finally:
                fn.release(sb)
            error, log, duration_ms, init_ms = (reply["error"], reply["log"], reply["duration_ms"],
                                                reply["init_ms"])
        finally:
            with self._lock:
                self._running -= 1
        self.count("invocations")
        if error:
            self.count("function_errors")
        if init_ms is not None:
            self.count("cold_starts")
        report = (f"REPORT RequestId: {request_id}\tDuration: {duration_ms:.2f} ms\t"
                  f"Billed Duration: {max(1, round(duration_ms))} ms\t"
                  f"Memory Size: {fn.spec.memory_mb} MB")
        if init_ms is not None:
            report += f"\tInit Duration: {init_ms:.2f} ms"
        log = f"START RequestId: {request_id} Version: $LATEST\n{log}END RequestId: " \
              f"{request_id}\n{report}\n"
        return body, error, log

    def run_event(self, fn: _Function, payload: bytes, request_id: str) -> None:
        """An asynchronous invocation: queued until a slot is free, never throttled."""
        def worker():
            with fn.slots:
                self.run(fn, payload, request_id)

        t = threading.Thread(target=worker, daemon=True, name=f"event-{request_id}")
        self._events = [e for e in self._events if e.is_alive()] + [t]
        t.start()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--template", default=None, help="SAM template (default: the project's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=3001)
    p.add_argument("--concurrency", type=int, default=4, help="sandboxes per function")
    p.add_argument("--latency-s", type=float, default=0.0, help="added to every call")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    em = LambdaEmulator.from_template(args.template, host=args.host, port=args.port,
                                      concurrency=args.concurrency, latency_s=args.latency_s)
    em.start()
    print(f"Lambda Invoke API at {em.url} (functions: {', '.join(sorted(em.functions))})")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        em.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
