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

Each function runs in its own pool of worker processes (spawned, like sandboxes), as many as its
concurrency. A cold start is a new process's first import of the handler module and its set-up;
``init_delay_s`` adds to it and ``latency_s`` adds to every call (standing in for a remote
service: the caller waits, no core is burnt). Function definitions come from the SAM template
(:func:`LambdaEmulator.from_template`), so the emulation runs what would be deployed.

Command line: ``python -m resources.lambda_emulator --port 3001`` (Ctrl-C stops it).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import random
import struct
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from resources.lambda_management import FunctionCatalog, Reply, function_name, invoked_function
from resources.lambda_management import unknown as unknown_route
from resources.net import warn_if_exposed

logger = logging.getLogger(__name__)

SYNC_PAYLOAD_LIMIT = 6 * 1024 * 1024
ASYNC_PAYLOAD_LIMIT = 1024 * 1024
LOG_TAIL_BYTES = 4096
MB_PER_VCPU = 1769  # Lambda allocates one vCPU per 1,769 MB of memory


@dataclass
class FunctionSpec:
    """One Lambda function: its name, handler path, timeout, memory and environment."""

    name: str
    handler: str
    timeout_s: float = 60.0
    memory_mb: int = 1024
    environment: dict[str, str] = field(default_factory=dict)
    # what the management API describes (resources.lambda_management)
    runtime: str | None = "python3.12"
    package_type: str = "Zip"
    description: str = ""
    architectures: tuple[str, ...] = ("x86_64",)
    tracing: str = "PassThrough"
    logical_id: str = ""
    image_uri: str | None = None


# -- a sandbox: one process that runs one function's handler, one invocation at a time ----------
def _write_frame(f, data: bytes) -> None:
    f.write(struct.pack("<Q", len(data)))
    f.write(data)


def _read_frame(f) -> bytes | None:
    head = f.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    data = f.read(n)
    return data if len(data) == n else None


class _Capture(io.TextIOBase):
    """The sandbox's stdout and stderr: what a handler writes during one invocation (loggers
    created at import time included, since they hold this very stream)."""

    def __init__(self) -> None:
        self._buf = io.StringIO()

    def write(self, s: str) -> int:
        return self._buf.write(s)

    def take(self) -> str:
        text, self._buf = self._buf.getvalue(), io.StringIO()
        return text


@dataclass
class EmulatedContext:
    """The attributes of Lambda's context object that handlers and powertools read."""

    function_name: str
    memory_limit_in_mb: int
    invoked_function_arn: str
    aws_request_id: str
    deadline_ms: float
    function_version: str = "$LATEST"
    log_group_name: str = ""
    log_stream_name: str = ""

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int(self.deadline_ms - time.time() * 1000))


def _sandbox_main() -> int:
    """The sandbox process: read (header, payload) frames, answer (header, body) frames."""
    from tasks.components import resolve

    out = os.fdopen(os.dup(1), "wb")
    inp = sys.stdin.buffer
    capture = _Capture()
    sys.stdout = sys.stderr = capture
    handler = None
    while True:
        raw = _read_frame(inp)
        payload = _read_frame(inp) if raw is not None else None
        if payload is None:
            return 0
        req = json.loads(raw)
        init_ms = None
        if handler is None:  # cold start: import the handler's module and run its set-up
            t = time.perf_counter()
            time.sleep(req["init_delay_s"])
            try:
                handler = resolve(req["handler"])
            except Exception:
                traceback.print_exc()
                raise
            init_ms = (time.perf_counter() - t) * 1000
        ctx = EmulatedContext(req["function"], req["memory_mb"], req["arn"], req["request_id"],
                              deadline_ms=time.time() * 1000 + req["timeout_s"] * 1000,
                              log_group_name=f"/aws/lambda/{req['function']}")
        t = time.perf_counter()
        error = None
        try:
            body = json.dumps(handler(json.loads(payload), ctx)).encode()
        except Exception as exc:
            error = "Unhandled"
            body = json.dumps({"errorMessage": str(exc), "errorType": type(exc).__name__,
                               "requestId": req["request_id"],
                               "stackTrace": traceback.format_tb(exc.__traceback__)}).encode()
            traceback.print_exc()
        reply = {"error": error, "duration_ms": (time.perf_counter() - t) * 1000,
                 "init_ms": init_ms, "log": capture.take()}
        _write_frame(out, json.dumps(reply).encode())
        _write_frame(out, body)
        out.flush()


class _Sandbox:
    """The parent's handle on one sandbox process. A sandbox that overruns its deadline is
    killed, as Lambda stops a timed-out execution environment."""

    def __init__(self, spec: FunctionSpec, env: dict[str, str]):
        self.spec = spec
        self.fresh = True
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resources.lambda_emulator", "--sandbox"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def call(self, req: dict, payload: bytes, deadline_s: float) -> tuple[dict, bytes]:
        fired = threading.Event()

        def kill():
            fired.set()
            self.proc.kill()

        timer = threading.Timer(deadline_s, kill)
        timer.start()
        try:
            _write_frame(self.proc.stdin, json.dumps(req).encode())
            _write_frame(self.proc.stdin, payload)
            self.proc.stdin.flush()
            raw = _read_frame(self.proc.stdout)
            body = _read_frame(self.proc.stdout) if raw is not None else None
        except (BrokenPipeError, OSError):
            raw = body = None
        finally:
            timer.cancel()
        self.fresh = False
        if raw is None or body is None:
            self.close()
            if fired.is_set():
                msg, kind = f"Task timed out after {self.spec.timeout_s:.2f} seconds", \
                    "Sandbox.Timedout"
            else:
                msg, kind = f"sandbox exited with code {self.proc.poll()}", "Runtime.ExitError"
            return ({"error": "Unhandled", "duration_ms": deadline_s * 1000, "init_ms": None,
                     "log": "", "dead": True},
                    json.dumps({"errorMessage": msg, "errorType": kind,
                                "requestId": req["request_id"]}).encode())
        return json.loads(raw), body

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


# -- the service ----------------------------------------------------------------------------------
class _Function:
    """A function's concurrency slots and its warm sandboxes."""

    def __init__(self, spec: FunctionSpec, concurrency: int, init_timeout_s: float):
        self.spec = spec
        self.concurrency = concurrency
        self.init_timeout_s = init_timeout_s
        self.slots = threading.BoundedSemaphore(concurrency)
        self._idle: list[_Sandbox] = []
        self._all: list[_Sandbox] = []
        self._lock = threading.Lock()
        self.env = dict(os.environ) | dict(spec.environment)
        # match torch/BLAS threads to the vCPUs the memory size buys, as in a Lambda sandbox
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, round(spec.memory_mb / MB_PER_VCPU))))
        # the handler's modules import as they do in the caller (what spawn would pass on)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [p for p in sys.path if p and os.path.isdir(p)]
            + [self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)

    def acquire(self) -> _Sandbox:
        """A warm sandbox if one is idle, else a new one (a cold start)."""
        with self._lock:
            while self._idle:
                sb = self._idle.pop()
                if sb.alive:
                    return sb
            sb = _Sandbox(self.spec, self.env)
            self._all.append(sb)
            return sb

    def release(self, sb: _Sandbox) -> None:
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A caller that closed its kept-alive connection is no error (socketserver would print
        a traceback to stderr); anything else is logged."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):
            logger.debug("connection from %s closed by the caller", client_address)
            return
        logger.exception("request from %s failed", client_address)


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
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._events: list[threading.Thread] = []
        # injected faults (FaultsConfig.reward's fields): rates of each kind, one draw per call
        self.faults = dict(faults or {})
        self._fault_rng = random.Random(self.faults.get("seed", 0))

    @classmethod
    def from_template(cls, template: str | Path | None = None, **kwargs) -> LambdaEmulator:
        """The functions of a SAM template (default: ``resources/lambda/template.yaml``)."""
        from resources.lambda_build import DEFAULT_TEMPLATE, function_specs, load_sam_template

        specs = function_specs(load_sam_template(template or DEFAULT_TEMPLATE))
        return cls([FunctionSpec(name, s["handler"], s["timeout_s"], s["memory_mb"],
                                 s["environment"], s["runtime"], s["package_type"],
                                 s["description"], tuple(s["architectures"]), s["tracing"],
                                 s["logical_id"], s["image_uri"])
                    for name, s in specs.items()], **kwargs)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> LambdaEmulator:
        emulator = self

        class Handler(_InvokeHandler):
            pass

        Handler.emulator = emulator
        warn_if_exposed("the Lambda emulation (it runs reward functions for any caller)",
                        self.host)
        self._server = _Server((self.host, self.port), Handler)
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

    def _count(self, key: str, n: int = 1) -> None:
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
                self._count(f"injected_{kind}")
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
        self._count("invocations")
        if error:
            self._count("function_errors")
        if init_ms is not None:
            self._count("cold_starts")
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


class _InvokeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: boto3 reuses its pooled connections
    emulator: LambdaEmulator

    def log_message(self, format, *args):  # route the server's access log to logging
        logger.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None):
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the caller gave up (read timeout)
            logger.debug("caller closed the connection before the response")

    def _error(self, status: int, error_type: str, message: str, request_id: str,
               extra: dict | None = None, headers: dict[str, str] | None = None):
        body = json.dumps({"Type": "User", "message": message} | (extra or {})).encode()
        self._reply(status, body, {"x-amzn-ErrorType": error_type,
                                   "x-amzn-RequestId": request_id} | (headers or {}))

    def _send(self, reply: Reply, request_id: str) -> None:
        if reply.error_type is not None:
            return self._error(reply.status, reply.error_type, reply.body["message"], request_id)
        self._reply(reply.status, json.dumps(reply.body).encode(),
                    {"x-amzn-RequestId": request_id})

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def do_GET(self):
        """GetFunction, GetFunctionConfiguration, ListFunctions."""
        self._body()  # read, so that the kept-alive connection stays in step
        self._send(self.emulator.catalog.get(self.path), str(uuid.uuid4()))

    def _unknown(self):  # what the emulation does not serve, as Lambda's JSON error
        self._body()
        self._send(unknown_route(self.command, self.path), str(uuid.uuid4()))

    do_PUT = do_DELETE = do_PATCH = _unknown

    def do_HEAD(self):
        self._reply(404, b"", {"x-amzn-ErrorType": "UnknownOperationException"})

    def do_POST(self):
        em = self.emulator
        request_id = str(uuid.uuid4())
        payload = self._body()
        segment = invoked_function(self.path)
        if segment is None:
            return self._send(unknown_route("POST", self.path), request_id)
        name, _ = function_name(segment)  # a name, "name:qualifier", or an ARN
        fn = em.functions.get(name)
        if fn is None:
            em._count("not_found")
            return self._error(404, "ResourceNotFoundException",
                               f"Function not found: {em.arn(name)}", request_id)
        itype = self.headers.get("X-Amz-Invocation-Type", "RequestResponse")
        if itype not in ("RequestResponse", "Event", "DryRun"):
            em._count("bad_request")
            return self._error(400, "InvalidParameterValueException",
                               f"invalid invocation type {itype}", request_id)
        limit = em.async_payload_limit if itype == "Event" else em.sync_payload_limit
        if len(payload) > limit:
            em._count("too_large")
            return self._error(413, "RequestTooLargeException",
                               f"Request must be smaller than {limit} bytes for the "
                               f"InvokeFunction operation", request_id)
        if itype == "DryRun":
            em._count("dry_run")
            return self._reply(204, b"", {"x-amzn-RequestId": request_id})
        try:
            json.loads(payload or b"{}")
        except ValueError:
            em._count("bad_request")
            return self._error(400, "InvalidRequestContentException",
                               "Could not parse request body into json", request_id)
        payload = payload or b"{}"
        if itype == "Event":
            em._count("event")
            em.run_event(fn, payload, request_id)
            return self._reply(202, b"", {"x-amzn-RequestId": request_id})
        fault = em.draw_fault() if em.faults else None
        if fault == "throttle":
            return self._error(429, "TooManyRequestsException", "Rate Exceeded.", request_id,
                               {"Reason": "ConcurrentInvocationLimitExceeded"},
                               {"Retry-After": "1"})
        if fault == "error_5xx":
            return self._error(500, "ServiceException", "Internal error (injected).",
                               request_id)
        if fault in ("function_error", "timeout"):
            message, error_type = "injected function error", "InjectedFault"
            if fault == "timeout":  # the function ran past its Timeout: Lambda's answer
                seconds = float(em.faults.get("timeout_s", 0.0))
                time.sleep(seconds)
                message = f"{request_id} Task timed out after {seconds:.2f} seconds"
                error_type = "Sandbox.Timedout"
            body = json.dumps({"errorMessage": message, "errorType": error_type,
                               "requestId": request_id, "stackTrace": []})
            return self._reply(200, body.encode(), {
                "x-amzn-RequestId": request_id, "X-Amz-Function-Error": "Unhandled"})
        if not fn.slots.acquire(blocking=False):
            em._count("throttles")
            return self._error(429, "TooManyRequestsException", "Rate Exceeded.", request_id,
                               {"Reason": "ReservedFunctionConcurrentInvocationLimitExceeded"},
                               {"Retry-After": "1"})
        try:
            body, error, log = em.run(fn, payload, request_id)
        finally:
            fn.slots.release()
        headers = {"x-amzn-RequestId": request_id, "X-Amz-Executed-Version": "$LATEST"}
        if error:
            headers["X-Amz-Function-Error"] = error
        if self.headers.get("X-Amz-Log-Type") == "Tail":
            headers["X-Amz-Log-Result"] = base64.b64encode(
                log.encode()[-LOG_TAIL_BYTES:]).decode()
        self._reply(200, body, headers)


def main(argv: list[str] | None = None) -> int:
    import argparse

    if argv is None and sys.argv[1:] == ["--sandbox"]:
        return _sandbox_main()
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
