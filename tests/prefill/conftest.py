"""The prefill connector's unit tests bind its store-lookup socket where vLLM's local sockets
go (``VLLM_RPC_BASE_PATH``): a short temporary directory per test, so none is left in ``/tmp``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _own_rpc_path(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(short_tmp))
