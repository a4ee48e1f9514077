"""The engine fingerprint: what makes KV bytes exchangeable between two engines.

Everything that changes a prompt's KV bytes is in it, so a redeploy that changes any of them
never reads the old KV from the disk or Redis tiers: the model and its weights (the
hub snapshot commit it loaded, or for a local directory a digest of its weight files' bytes), dtype, KV layout and
cache dtype, block size and chunk size, quantization, rope scaling, ``hf_overrides``, the
TP rank, and the operator's ``store.epoch``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import xxhash

from kvrelay.common.keys import Fingerprint
from kvrelay.common.private_files import read_small, write_atomic
from kvrelay.core.config import KVRelayConfig

log = logging.getLogger("kvrelay.fingerprint")
_BLOCK = 8 << 20            # bytes hashed per read
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DIGEST_CACHE = Path.home() / ".cache" / "kvrelay" / "weight-digests.json"


def engine_fingerprint(vllm_config: Any, layout: Any, cfg: KVRelayConfig | None = None,
                       isa: str | None = None) -> Fingerprint:
    """This worker's fingerprint (see :class:`kvrelay.common.keys.Fingerprint`).

    ``layout`` is the worker's :class:`kvrelay.kernels.blocks.KVLayout`; ``cfg`` adds ``chunk_tokens``
    and ``store.epoch``. On a CPU the layout names the attention ISA vLLM's CPU backend writes
    the cache with (``isa``; detected as vLLM detects it when None): engines on hosts whose ISAs
    differ (AMX, AVX-512, NEON...) exchange no KV."""
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    kv_layout = f"{layout.device.type}:{list(layout.block_shape())}"
    if layout.device.type == "cpu":
        kv_layout += f":{isa if isa is not None else cpu_attention_isa(vllm_config, layout)}"
    return Fingerprint(model=str(mc.model), dtype=str(layout.dtype),
                       kv_layout=kv_layout,
                       block_size=vllm_config.cache_config.block_size, num_layers=layout.num_layers,
                       bytes_per_block=layout.bytes_per_block, tp_rank=getattr(pc, "rank", 0),
                       tp_size=pc.tensor_parallel_size,
                       chunk_tokens=cfg.chunk_tokens if cfg is not None else 0,
                       weights=weights_identity(str(mc.model), getattr(mc, "revision", None)),
                       kv_settings=kv_settings(vllm_config),
                       epoch=cfg.store.epoch if cfg is not None else 0)


def cpu_attention_isa(vllm_config: Any, layout: Any) -> str:
    """The ISA vLLM's CPU attention backend picks for this engine's cache ("amx", "vec", "vec16",
    "neon"...), asked of vLLM itself; "unknown" where this vLLM has no such choice."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(layout.dtype, vllm_config.cache_config.block_size,
                                 vllm_config.model_config.get_head_size(),
                                 getattr(vllm_config.cache_config, "cache_dtype", None)))
    except (ImportError, AttributeError, NotImplementedError, RuntimeError, TypeError) as exc:
        log.info("fingerprint: the CPU attention ISA is unknown (%s)", exc)
        return "unknown"


def kv_settings(vllm_config: Any) -> str:
    """The engine settings besides the weights that change KV bytes, as canonical JSON."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    hf = getattr(mc, "hf_config", None)
    settings = {"quantization": getattr(mc, "quantization", None),
                "rope_scaling": getattr(hf, "rope_scaling", None) or getattr(mc, "rope_scaling", None),
                "hf_overrides": getattr(mc, "hf_overrides", None),
                "cache_dtype": getattr(cc, "cache_dtype", None)}
    return json.dumps(settings, sort_keys=True, default=str)


def weights_identity(model: str, revision: str | None, hub_cache: str | None = None) -> str:
    """The weights' identity: for a local directory ``files:<digest>`` of its config and the full
    bytes of every weight file (:func:`_files_digest`); for a hub model ``hub:<commit>``, the
    snapshot commit the engine loaded (resolved from the local hub cache, so an unpinned
    ``org/name`` that moved on is another identity); ``rev:<revision>`` if that cannot be
    resolved but a revision was given; "" when nothing is known."""
    path = Path(model).expanduser()
    if path.is_dir():
        return f"files:{_files_digest(str(path.resolve()))}"
    commit = _hub_commit(model, revision, hub_cache)
    if commit:
        return f"hub:{commit}"
    return f"rev:{revision}" if revision else ""


def _hub_commit(model: str, revision: str | None, hub_cache: str | None) -> str | None:
    """The commit of the cached snapshot ``model@revision`` resolves to (no network), or None."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(model, revision=revision, cache_dir=hub_cache, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to resolve means "unknown", as for a bare name
        log.warning("fingerprint: cannot resolve the snapshot of %s@%s in the hub cache (%s); its stored KV is "
                    "keyed by the revision name only", model, revision or "main", type(exc).__name__)
        return None
    return Path(path).name


def _files_digest(directory: str) -> str:
    """A digest of ``directory``'s config.json and of the full bytes of each weight file (xxh3-128,
    several GB/s). A file's digest is remembered per (size, mtime, ctime, inode) in the user's
    cache, so a restart reads nothing again; any write to a file changes its ctime."""
    h = hashlib.sha256()
    for f in sorted(Path(directory).iterdir()):
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES):
            h.update(f"{f.name}\x1f{_file_digest(f)}".encode())
    return h.hexdigest()[:32]


@functools.cache
def _file_digest(f: Path) -> str:
    st = f.stat()
    key = f"{f.resolve()}\x1f{st.st_size}\x1f{st.st_mtime_ns}\x1f{st.st_ctime_ns}\x1f{st.st_ino}"
    known = _digest_cache()
    if key in known:
        return known[key]
    h = xxhash.xxh3_128()
    with f.open("rb") as fh:
        while block := fh.read(_BLOCK):
            h.update(block)
    known[key] = digest = h.hexdigest()
    with contextlib.suppress(OSError):
        DIGEST_CACHE.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(DIGEST_CACHE, json.dumps(known).encode())
    return digest


def _digest_cache() -> dict[str, str]:
    data = read_small(DIGEST_CACHE, limit=4 << 20, owners=(os.geteuid(),))
    try:
        known = json.loads(data) if data else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in known.items()} if isinstance(known, dict) else {}
