"""The HTTP front of the local Lambda emulation (:mod:`resources.lambda_emulator`): Lambda's
routes, status codes, headers and JSON error shapes.

``POST /2015-03-31/functions/{name}/invocations`` checks the call as Lambda does (an unknown
function, an invocation type, the payload limit, a body that is not JSON, injected faults, the
function's concurrency) before it hands the payload to the emulator, and answers with the
handler's JSON, ``X-Amz-Function-Error`` and, for ``X-Amz-Log-Type: Tail``, the invocation's
log tail. ``GET`` serves the management API (:mod:`resources.lambda_management`); any other
route answers with Lambda's JSON error. Connections are kept alive: boto3 reuses its pooled
connections.
"""

from __future__ import annotations

import base64
import json
import logging
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from resources.lambda_management import (
    FunctionCatalog,
    Reply,
    function_name,
    invoked_function,
)
from resources.lambda_management import unknown as unknown_route

logger = logging.getLogger(__name__)

LOG_TAIL_BYTES = 4096


class LambdaService(Protocol):
    """What the HTTP front asks of the service behind it
    (:class:`resources.lambda_emulator.LambdaEmulator`): its functions, each with a
    ``slots`` semaphore of its concurrency, and how to run one."""

    catalog: FunctionCatalog
    functions: dict[str, Any]
    faults: dict
    sync_payload_limit: int
    async_payload_limit: int

    def count(self, key: str, n: int = 1) -> None: ...

    def arn(self, name: str) -> str: ...

    def draw_fault(self) -> str | None: ...

    def run(self, fn: Any, payload: bytes, request_id: str) -> tuple[bytes, str | None, str]: ...

    def run_event(self, fn: Any, payload: bytes, request_id: str) -> None: ...


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


def make_server(emulator: LambdaService, host: str, port: int) -> ThreadingHTTPServer:
    """A threading HTTP server on ``(host, port)`` that serves ``emulator``'s functions."""

    class Handler(InvokeHandler):
        pass

    Handler.emulator = emulator
    return _Server((host, port), Handler)


class InvokeHandler(BaseHTTPRequestHandler):
    """One request to the emulation; :func:`make_server` binds ``emulator`` on a subclass."""

    protocol_version = "HTTP/1.1"  # keep-alive: boto3 reuses its pooled connections
    # TCP_NODELAY: the headers and the body go out in two writes, and with Nagle's algorithm the
    # body waited for the caller's delayed ACK of the headers, about 40 ms on every call
    disable_nagle_algorithm = True
    emulator: LambdaService

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
            em.count("not_found")
            return self._error(404, "ResourceNotFoundException",
                               f"Function not found: {em.arn(name)}", request_id)
        itype = self.headers.get("X-Amz-Invocation-Type", "RequestResponse")
        if itype not in ("RequestResponse", "Event", "DryRun"):
            em.count("bad_request")
            return self._error(400, "InvalidParameterValueException",
                               f"invalid invocation type {itype}", request_id)
        limit = em.async_payload_limit if itype == "Event" else em.sync_payload_limit
        if len(payload) > limit:
            em.count("too_large")
            return self._error(413, "RequestTooLargeException",
                               f"Request must be smaller than {limit} bytes for the "
                               f"InvokeFunction operation", request_id)
        if itype == "DryRun":
            em.count("dry_run")
            return self._reply(204, b"", {"x-amzn-RequestId": request_id})
        try:
            json.loads(payload or b"{}")
        except ValueError:
            em.count("bad_request")
            return self._error(400, "InvalidRequestContentException",
                               "Could not parse request body into json", request_id)
        payload = payload or b"{}"
        if itype == "Event":
            em.count("event")
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
            em.count("throttles")
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
