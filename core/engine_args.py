"""vLLM's parallelism flags in an engine argument list (``engine.extra_args`` and the role lists).

kvrelay sets the tensor-parallel size itself (``engine.prefill_tp`` / ``engine.decode_tp``),
because both sides' connectors need it; the config refuses these flags where they would
bypass that (:class:`kvrelay.core.config.EngineConfig`).
"""

from __future__ import annotations

from collections.abc import Sequence

TP_FLAGS = ("--tensor-parallel-size", "-tp", "--tensor_parallel_size")
PARALLEL_FLAGS = (*TP_FLAGS, "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp",
                   "--pipeline_parallel_size", "--data_parallel_size")


def parallel_flag(args: Sequence[str]) -> str | None:
    """The first parallelism flag in a vLLM argument list with a size above 1, as given."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in PARALLEL_FLAGS:
            size = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if size.strip() not in ("1", ""):
                return f"{name} {size}"
    return None
