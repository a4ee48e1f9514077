"""The benchmark harnesses behind ``kvrelay bench``.

Owns the transfer, end-to-end, goodput, multi-turn, router and breakdown benchmarks, the
sender-in-a-process peer, vLLM's fixed NixlConnector baseline (``fair_nixl``) and the
throwaway redis-server the benchmarks and tests share (``local_redis``). Each writes JSON
and a PNG and states its figures as ratios within one run.

May import: every package below it - not the CLI.
"""
