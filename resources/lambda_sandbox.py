"""A Lambda execution environment of the local emulation (:mod:`resources.lambda_emulator`): one
process that runs one function's handler, one invocation at a time.

The parent writes a (header, payload) frame per invocation on the sandbox's stdin and reads a
(header, body) frame back from its stdout; each frame is its byte length (8 bytes, little
endian) and its bytes. A sandbox's first invocation is its cold start: it imports the handler's
module and runs its set-up. Whatever the handler writes to stdout or stderr during an
invocation comes back as that invocation's log. A sandbox that overruns its deadline is killed,
as Lambda stops a timed-out execution environment.

The parent starts it with ``python -m resources.lambda_sandbox``.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field


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


def write_frame(f, data: bytes) -> None:
    f.write(struct.pack("<Q", len(data)))
    f.write(data)


def read_frame(f) -> bytes | None:
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


def sandbox_main() -> int:
    """The sandbox process: read (header, payload) frames, answer (header, body) frames."""
    from tasks.components import resolve

    out = os.fdopen(os.dup(1), "wb")
    inp = sys.stdin.buffer
    capture = _Capture()
    sys.stdout = sys.stderr = capture
    handler = None
    while True:
        raw = read_frame(inp)
        payload = read_frame(inp) if raw is not None else None
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
        write_frame(out, json.dumps(reply).encode())
        write_frame(out, body)
        out.flush()


class Sandbox:
    """The parent's handle on one sandbox process. A sandbox that overruns its deadline is
    killed, as Lambda stops a timed-out execution environment."""

    def __init__(self, spec: FunctionSpec, env: dict[str, str]):
        self.spec = spec
        self.fresh = True
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resources.lambda_sandbox"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def call(self, req: dict, payload: bytes, deadline_s: float) -> tuple[dict, bytes]:
        fired = threading.Event()

        def kill():
            fired.set()
            self.proc.kill()

        timer = threading.Timer(deadline_s, kill)
        timer.start()
        try:
            write_frame(self.proc.stdin, json.dumps(req).encode())
            write_frame(self.proc.stdin, payload)
            self.proc.stdin.flush()
            raw = read_frame(self.proc.stdout)
            body = read_frame(self.proc.stdout) if raw is not None else None
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


if __name__ == "__main__":
    sys.exit(sandbox_main())
