"""The OpenAI-compatible router in front of the prefill and decode pools.

Owns the aiohttp app (``app``), the engine client that talks to nodes (``upstream``), the
pools, health checks and policies (``pools``), the cache-aware chunk index
(``cache_index``), DNS discovery (``discovery``), API keys, rate limits and admission
(``limits``), request checks (``validate``), what can be split and how (``split``), the
split and decode-path flows (``split_path``, ``job``), moving an answer to another decode
node mid-stream (``migration``), the per-node circuit breaker (``breaker``), the OpenAI
bodies it builds (``responses``) and its metrics (``metrics``).

May import: ``kvrelay.core`` (config, params, logs - not the connector base),
``kvrelay.store`` (events), ``kvrelay.common``. No torch, no vLLM, no engine packages.
"""
