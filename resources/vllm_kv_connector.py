"""A vLLM KV connector that hands one prompt's KV from a prefill engine to a decode engine.

The ``vllm`` backend's prefill and decode run on different workers, each with its own vLLM
engine. With ``handoff="shared_storage"`` the prefill engine writes the prompt's KV to a
directory both engines see, and the decode engine loads it instead of recomputing it. This
module is that connector, built on vLLM's v1 connector API
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) and derived from its reference
``ExampleConnector`` (``.../v1/example_connector.py``), with what a training loop needs on top:

- **Per request, by key.** Nothing is stored or loaded unless the request asks, through
  ``SamplingParams(extra_args={"kv_transfer_params": {...}})`` (``vllm/v1/request.py`` reads
  ``kv_transfer_params`` from ``extra_args``): ``{STORE: key}`` on the prefill request,
  ``{LOAD: key}`` on the decode request. The caller puts the weight version in the key and
  removes entries when done (:func:`remove_entry`), so KV of older weights is never picked up by
  another request and files do not pile up.
- **One aligned length.** An entry holds the prompt's first ``(len(prompt) - 1) // block_size
  * block_size`` tokens, whole blocks only (the last prompt token is always computed by the
  consumer, as vLLM's scheduler requires). The lookup and the load use that same length and the
  lookup checks the manifest (length, block size, a hash of those token ids) and every layer's
  file, so a prompt of ``k * block_size + 1`` tokens, or a key that is absent, is a miss: the
  consumer recomputes, the engine never fails.
- **Atomic entries.** Layers are written into a temporary folder that is renamed into place
  once the forward pass has saved them all (``wait_for_save``), so a reader sees a whole entry
  or none.
- **Only what is missing is loaded.** Blocks the consumer's own prefix cache holds are left as
  they are; a read error reports the blocks as invalid, and with
  ``kv_load_failure_policy="recompute"`` vLLM recomputes them.

Layout: one folder per key with ``manifest.json`` and one ``<layer>.safetensors`` per attention
layer holding the entry's blocks as vLLM's per-layer paged view indexes them (``[blocks, kv
heads, block size, 2 * head size]`` on CPU), as ``ExampleConnector`` does. The directory must be
one both engines see: any local path when they share a machine, a shared filesystem otherwise.
Both engines need the same block size and KV dtype. Counters per engine are in
:data:`HANDOFF_STATS` (the engine core runs in the caller's process).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

STORE = "rollarc_store"  # kv_transfer_params key: store this prompt's KV under the value
LOAD = "rollarc_load"  # kv_transfer_params key: load this prompt's KV from the value
LOADED = "rollarc_loaded"  # in a finished request's kv_transfer_params: tokens loaded
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

# engine_id -> counters: stored, stored_tokens, loads, loaded_tokens, load_misses, load_errors
HANDOFF_STATS: dict[str, Counter] = {}


def handoff_config(directory: str | os.PathLike, engine_id: str | None = None
                   ) -> KVTransferConfig:
    """The ``KVTransferConfig`` of an engine that both stores and loads through ``directory``
    (a failed load is recomputed, never an error)."""
    return KVTransferConfig(
        kv_connector=SharedStorageHandoff.__name__, kv_connector_module_path=__name__,
        kv_role="kv_both", kv_load_failure_policy="recompute",
        engine_id=engine_id or uuid.uuid4().hex,
        kv_connector_extra_config={"shared_storage_path": str(directory)})


def aligned_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """How many leading prompt tokens an entry holds: whole blocks, the last token excluded."""
    return max(0, num_prompt_tokens - 1) // block_size * block_size


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key):
        raise ValueError(f"bad hand-off key {key!r}: letters, digits, '.', '_', '-' only")
    return key


def entry_path(directory: str | os.PathLike, key: str) -> Path:
    return Path(directory) / check_key(key)


def read_manifest(directory: str | os.PathLike, key: str) -> dict | None:
    """The entry's manifest, or None when it is absent or unreadable."""
    try:
        return json.loads((entry_path(directory, key) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def remove_entry(directory: str | os.PathLike, key: str) -> None:
    shutil.rmtree(entry_path(directory, key), ignore_errors=True)


def _ids_hash(token_ids: list[int]) -> str:
    return hashlib.sha256(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()
                          ).hexdigest()


@dataclass
class _Transfer:
    key: str
    block_ids: list[int]  # the request's blocks that the entry covers, in order
    first_block: int  # blocks before it are not copied (loads: the local prefix cache has them)
    num_tokens: int
    ids_hash: str = ""


@dataclass
class HandoffMetadata(KVConnectorMetadata):
    stores: list[_Transfer] = field(default_factory=list)
    loads: list[_Transfer] = field(default_factory=list)


class SharedStorageHandoff(ExampleConnector):
    """``ExampleConnector`` made per request, keyed, block-aligned and atomic (module doc)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._dir = Path(self._storage_path)
        self._dir.mkdir(parents=True, exist_ok=True)
        self.stats = HANDOFF_STATS.setdefault(str(self._kv_transfer_config.engine_id), Counter())
        # scheduler side: request id -> planned load (key, tokens in the entry)
        self._planned: dict[str, tuple[str, int]] = {}
        self._loads: dict[str, _Transfer] = {}  # allocated, waiting for build_connector_meta
        self._loaded: dict[str, tuple[int, set[int]]] = {}  # tokens and blocks, until finished
        # worker side
        self._writing: dict[str, Path] = {}  # key -> temporary folder of this step's stores
        self._load_errors: set[int] = set()

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        self._planned.pop(request.request_id, None)
        key = (request.kv_transfer_params or {}).get(LOAD)
        if not key:
            return 0, False
        n = self._lookup(key, list(request.prompt_token_ids or []))
        if n == 0:
            self.stats["load_misses"] += 1
            return 0, False
        self._planned[request.request_id] = (key, n)
        return max(0, n - num_computed_tokens), False

    def _lookup(self, key: str, prompt: list[int]) -> int:
        """Tokens of ``prompt`` the entry ``key`` holds (0: none usable)."""
        try:
            path = entry_path(self._dir, key)
        except ValueError:
            return 0
        manifest = read_manifest(self._dir, key)
        n = aligned_tokens(len(prompt), self._block_size)
        if (manifest is None or manifest.get("block_size") != self._block_size
                or manifest.get("num_tokens") != n or n == 0
                or manifest.get("ids_hash") != _ids_hash(prompt[:n])):
            return 0
        layers = manifest.get("layers") or []
        if not layers or not all((path / f"{name}.safetensors").is_file() for name in layers):
            return 0
        return n

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        planned = self._planned.pop(request.request_id, None)
        if planned is None or num_external_tokens <= 0:
            return
        key, n = planned
        block_ids = blocks.get_block_ids()[0][:n // self._block_size]
        first = (n - num_external_tokens) // self._block_size
        self._loads[request.request_id] = _Transfer(key, list(block_ids), first, n)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = HandoffMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            load = self._loads.pop(new_req.req_id, None)
            if load is not None:
                meta.loads.append(load)
                self._note_load(new_req.req_id, load)
                continue
            key = (self._params_of(new_req) or {}).get(STORE)
            prompt = list(new_req.prompt_token_ids or [])
            n = aligned_tokens(len(prompt), self._block_size)
            if key and n:
                meta.stores.append(_Transfer(check_key(key),
                                             list(new_req.block_ids[0][:n // self._block_size]),
                                             0, n, _ids_hash(prompt[:n])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            load = self._loads.pop(req_id, None)
            if load is None:
                continue
            if req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                load.block_ids = list(cached.new_block_ids[i][0][:len(load.block_ids)])
            meta.loads.append(load)
            self._note_load(req_id, load)
        return meta

    def _params_of(self, new_req) -> dict[str, Any] | None:
        params = getattr(new_req, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        return extra.get("kv_transfer_params")

    def _note_load(self, req_id: str, load: _Transfer) -> None:
        tokens = (len(load.block_ids) - load.first_block) * self._block_size
        self._loaded[req_id] = (tokens, set(load.block_ids[load.first_block:]))
        self.stats["loads"] += 1

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = set(connector_output.invalid_block_ids or ())
        if not invalid:
            return
        for req_id, (_, blocks) in list(self._loaded.items()):
            if blocks & invalid:  # vLLM recomputes them ("recompute" policy)
                self._loaded[req_id] = (0, set())

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._planned.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        loaded = self._loaded.pop(request.request_id, None)
        if loaded is None:
            return False, None
        self.stats["loaded_tokens"] += loaded[0]
        return False, {LOADED: loaded[0]}

    # -- worker side --------------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HandoffMetadata)
        if not meta.loads or forward_context.attn_metadata is None:
            return
        layers = {name: layer.kv_cache for name, layer in forward_context.no_compile_layers.items()
                  if getattr(layer, "kv_cache", None) is not None}
        for load in meta.loads:
            dst = torch.tensor(load.block_ids[load.first_block:], dtype=torch.long)
            try:
                path = entry_path(self._dir, load.key)
                for name, kv_layer in layers.items():
                    src = safetensors.torch.load_file(str(path / f"{name}.safetensors"))["kv"]
                    if src.shape[0] != len(load.block_ids) or src.shape[1:] != kv_layer.shape[1:]:
                        raise ValueError(f"layer {name}: entry of shape {tuple(src.shape)}, "
                                         f"cache blocks of {tuple(kv_layer.shape[1:])}")
                    kv_layer[dst.to(kv_layer.device)] = src[load.first_block:].to(
                        kv_layer.device, kv_layer.dtype)
            except Exception:  # the scheduler recomputes these blocks
                logger.exception("could not load hand-off entry %s", load.key)
                self.stats["load_errors"] += 1
                self._load_errors.update(load.block_ids[load.first_block:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HandoffMetadata)
        for store in meta.stores:
            tmp = self._writing.get(store.key)
            if tmp is None:
                tmp = self._dir / f"{TMP_PREFIX}{store.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                tmp.mkdir(parents=True)
                self._writing[store.key] = tmp
            blocks = torch.tensor(store.block_ids, dtype=torch.long, device=kv_layer.device)
            safetensors.torch.save_file({"kv": kv_layer[blocks].detach().cpu().contiguous()},
                                        str(tmp / f"{layer_name}.safetensors"))

    def wait_for_save(self) -> None:
        """Publish this step's entries: manifest last, then one rename into place."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, HandoffMetadata)
        for store in meta.stores:
            tmp = self._writing.pop(store.key, None)
            if tmp is None:
                continue
            layers = sorted(p.name.removesuffix(".safetensors") for p in tmp.glob("*.safetensors"))
            (tmp / MANIFEST).write_text(json.dumps(dict(
                num_tokens=store.num_tokens, block_size=self._block_size,
                ids_hash=store.ids_hash, layers=layers)))
            try:
                tmp.rename(entry_path(self._dir, store.key))
            except OSError:  # an entry of that key exists already: keep it
                shutil.rmtree(tmp, ignore_errors=True)
                continue
            self.stats["stored"] += 1
            self.stats["stored_tokens"] += store.num_tokens

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
