"""kvrelay: disaggregated prefill/decode serving for vLLM.

The ``kvrelay`` package is the command line (:mod:`kvrelay.cli`), the top floor:
nothing imports it. The README's code map lists every package, what it owns and
what it may import.
"""

__version__ = "0.1.0"
