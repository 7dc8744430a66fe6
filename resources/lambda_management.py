"""The read-only part of Lambda's management API, for the emulation of
:mod:`resources.lambda_emulator`: ``GetFunction``, ``GetFunctionConfiguration`` and
``ListFunctions``, in the JSON shapes of botocore's service model (``lambda/2015-03-31``), so
that the AWS CLI and boto3 code written against AWS work unchanged::

    aws lambda list-functions --endpoint-url http://127.0.0.1:3001
    aws lambda get-function --function-name rollarc-reward --endpoint-url http://127.0.0.1:3001

Functions are those of the SAM template, with the runtime, handler, memory size, timeout,
environment, architectures and tracing mode it gives them (Globals applied). What only a
deployment knows is filled the way a SAM deployment fills it: ``$LATEST``, state ``Active``,
the ``lambda:createdBy: SAM`` tag. ``CodeSha256`` and ``CodeSize`` are those of the handler's
module source, the code the emulation runs; ``Concurrency`` is the emulation's limit per
function, the one its throttling enforces. Any other route answers with Lambda's JSON error
shape (``x-amzn-ErrorType`` and ``{"Type", "message"}``), never an HTML page.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

API = "/2015-03-31/functions"
_FUNCTION = re.compile(rf"^{API}/([^/]+)$")
_CONFIGURATION = re.compile(rf"^{API}/([^/]+)/configuration$")
_INVOKE = re.compile(rf"^{API}/([^/]+)/invocations$")
LATEST = "$LATEST"
MAX_ITEMS = 10_000  # ListFunctions' MaxItems range is 1-10000, 50 when not given
DEFAULT_MAX_ITEMS = 50


@dataclass(frozen=True)
class Reply:
    """What the HTTP handler sends: a status, a JSON body, and for an error its type."""

    status: int
    body: dict
    error_type: str | None = None


def error(status: int, error_type: str, message: str) -> Reply:
    """Lambda's error shape (botocore's rest-json parser reads the type from the header)."""
    return Reply(status, {"Type": "User", "message": message}, error_type)


def function_name(segment: str) -> tuple[str, str | None]:
    """A path's FunctionName: a name, ``name:qualifier``, or a full or partial ARN
    (``arn:aws:lambda:REGION:ACCOUNT:function:NAME[:QUALIFIER]``, ``ACCOUNT:function:NAME``);
    the name and the qualifier it carries (None: none)."""
    parts = unquote(segment).split(":")
    if "function" in parts:  # an ARN, full or partial
        parts = parts[parts.index("function") + 1:]
    return parts[0], (parts[1] if len(parts) > 1 else None)


def invoked_function(path: str) -> str | None:
    """The FunctionName of an Invoke path (None: not one)."""
    m = _INVOKE.match(urlparse(path).path)
    return None if m is None else m.group(1)


def _module_source(handler: str) -> bytes:
    """The source of the handler's module (``pkg.module.function``), empty if not found."""
    module = handler.rsplit(".", 1)[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return b""
    origin = getattr(spec, "origin", None)
    return Path(origin).read_bytes() if origin and Path(origin).is_file() else b""


class FunctionCatalog:
    """The template's functions as Lambda's management API describes them."""

    def __init__(self, specs: list, region: str, account: str, concurrency: int):
        self.specs = {s.name: s for s in specs}
        self.region, self.account, self.concurrency = region, account, concurrency
        self.last_modified = time.strftime("%Y-%m-%dT%H:%M:%S.000+0000", time.gmtime())
        self._code = {s.name: _module_source(s.handler) for s in specs}

    def arn(self, name: str) -> str:
        return f"arn:aws:lambda:{self.region}:{self.account}:function:{name}"

    def configuration(self, name: str) -> dict:
        """A ``FunctionConfiguration``."""
        s, code = self.specs[name], self._code[name]
        image = s.package_type == "Image"
        config = {
            "FunctionName": s.name,
            "FunctionArn": self.arn(s.name),
            "Role": f"arn:aws:iam::{self.account}:role/{s.logical_id or s.name}Role",
            "CodeSize": len(code),
            "Description": s.description,
            "Timeout": int(s.timeout_s),
            "MemorySize": int(s.memory_mb),
            "LastModified": self.last_modified,
            "CodeSha256": base64.b64encode(hashlib.sha256(code).digest()).decode(),
            "Version": LATEST,
            "Environment": {"Variables": dict(s.environment)},
            "TracingConfig": {"Mode": "Active" if s.tracing == "Active" else "PassThrough"},
            "RevisionId": str(uuid.uuid5(uuid.NAMESPACE_URL, self.arn(s.name)
                                         + self.last_modified)),
            "State": "Active",
            "LastUpdateStatus": "Successful",
            "PackageType": s.package_type,
            "Architectures": list(s.architectures) or ["x86_64"],
            "EphemeralStorage": {"Size": 512},
            "SnapStart": {"ApplyOn": "None", "OptimizationStatus": "Off"},
            "LoggingConfig": {"LogFormat": "Text", "LogGroup": f"/aws/lambda/{s.name}"},
        }
        if image:  # an image function has no Runtime or Handler: its command is the handler
            config["ImageConfigResponse"] = {"ImageConfig": {"Command": [s.handler]}}
        else:
            config["Runtime"] = s.runtime
            config["Handler"] = s.handler
        return config

    def function(self, name: str) -> dict:
        """A ``GetFunctionResponse``."""
        s = self.specs[name]
        code = ({"RepositoryType": "ECR", "ImageUri": s.image_uri,
                 "ResolvedImageUri": s.image_uri} if s.package_type == "Image"
                else {"RepositoryType": "S3"})
        return {"Configuration": self.configuration(name), "Code": code,
                "Tags": {"lambda:createdBy": "SAM"},
                "Concurrency": {"ReservedConcurrentExecutions": self.concurrency}}

    def list_functions(self, marker: str | None, max_items: int) -> dict:
        """A ``ListFunctionsResponse`` page: functions by name from ``marker`` on."""
        names = sorted(self.specs)
        start = names.index(marker) if marker in names else 0
        page = names[start:start + max_items]
        out: dict = {"Functions": [self.configuration(n) for n in page]}
        if start + max_items < len(names):
            out["NextMarker"] = names[start + max_items]
        return out

    # -- routes --------------------------------------------------------------------------------
    def get(self, path: str) -> Reply:
        """A GET request of the management API."""
        url = urlparse(path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if url.path.rstrip("/") == API:
            return self._list(query)
        for pattern, describe in ((_CONFIGURATION, self.configuration),
                                  (_FUNCTION, self.function)):
            m = pattern.match(url.path)
            if m is None:
                continue
            name, qualifier = function_name(m.group(1))
            qualifier = query.get("Qualifier", qualifier)
            if name not in self.specs or qualifier not in (None, LATEST):
                return error(404, "ResourceNotFoundException", "Function not found: "
                             f"{self.arn(name)}{':' + qualifier if qualifier else ''}")
            return Reply(200, describe(name))
        return unknown("GET", path)

    def _list(self, query: dict[str, str]) -> Reply:
        raw = query.get("MaxItems", str(DEFAULT_MAX_ITEMS))
        if not raw.isdigit() or not 1 <= int(raw) <= MAX_ITEMS:
            return error(400, "InvalidParameterValueException",
                         f"1 validation error detected: Value '{raw}' at 'maxItems' failed to "
                         f"satisfy constraint: Member must have value between 1 and {MAX_ITEMS}")
        marker = query.get("Marker")
        if marker is not None and marker not in self.specs:
            return error(400, "InvalidParameterValueException", f"Invalid marker: {marker}")
        return Reply(200, self.list_functions(marker, int(raw)))


def unknown(method: str, path: str) -> Reply:
    """A route the emulation does not serve (Lambda's answer to an unknown operation)."""
    return error(404, "UnknownOperationException",
                 f"Unknown operation {method} {urlparse(path).path} (the emulation serves "
                 "Invoke, GetFunction, GetFunctionConfiguration and ListFunctions)")
