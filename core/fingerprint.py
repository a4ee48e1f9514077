"""The engine fingerprint: what makes KV bytes exchangeable between two engines.

Everything that changes a prompt's KV bytes is in it, so a redeploy that changes any of them
never reads the old KV from the disk or Redis tiers: the model and its weights (the
revision, or for a local directory a digest of its weight files), dtype, KV layout and
cache dtype, block size and chunk size, quantization, rope scaling, ``hf_overrides``, the
TP rank, and the operator's ``store.epoch``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from kvrelay.common.keys import Fingerprint
from kvrelay.core.config import KVRelayConfig

_SAMPLE = 1 << 20           # bytes read from each end of a weight file
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def engine_fingerprint(vllm_config: Any, layout: Any, cfg: KVRelayConfig | None = None) -> Fingerprint:
    """This worker's fingerprint (see :class:`kvrelay.common.keys.Fingerprint`).

    ``layout`` is the worker's :class:`kvrelay.kernels.blocks.KVLayout`; ``cfg`` adds ``chunk_tokens``
    and ``store.epoch``."""
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    return Fingerprint(model=str(mc.model), dtype=str(layout.dtype),
                       kv_layout=f"{layout.device.type}:{list(layout.block_shape())}",
                       block_size=vllm_config.cache_config.block_size, num_layers=layout.num_layers,
                       bytes_per_block=layout.bytes_per_block, tp_rank=getattr(pc, "rank", 0),
                       tp_size=pc.tensor_parallel_size,
                       chunk_tokens=cfg.chunk_tokens if cfg is not None else 0,
                       weights=weights_identity(str(mc.model), getattr(mc, "revision", None)),
                       kv_settings=kv_settings(vllm_config),
                       epoch=cfg.store.epoch if cfg is not None else 0)


def kv_settings(vllm_config: Any) -> str:
    """The engine settings besides the weights that change KV bytes, as canonical JSON."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    hf = getattr(mc, "hf_config", None)
    settings = {"quantization": getattr(mc, "quantization", None),
                "rope_scaling": getattr(hf, "rope_scaling", None) or getattr(mc, "rope_scaling", None),
                "hf_overrides": getattr(mc, "hf_overrides", None),
                "cache_dtype": getattr(cc, "cache_dtype", None)}
    return json.dumps(settings, sort_keys=True, default=str)


def weights_identity(model: str, revision: str | None) -> str:
    """``rev:<revision>`` for a hub model pinned to one; for a local directory a digest of its
    config and of each weight file's size and first and last MiB (a full hash of many GB would
    cost minutes at every start); "" when neither is known."""
    path = Path(model).expanduser()
    if path.is_dir():
        return f"files:{_files_digest(str(path.resolve()))}"
    return f"rev:{revision}" if revision else ""


@functools.cache
def _files_digest(directory: str) -> str:
    h = hashlib.sha256()
    root = Path(directory)
    for f in sorted(root.iterdir()):
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES):
            size = f.stat().st_size
            h.update(f"{f.name}\x1f{size}".encode())
            with f.open("rb") as fh:
                h.update(fh.read(_SAMPLE))
                fh.seek(max(0, size - _SAMPLE))
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()[:32]
