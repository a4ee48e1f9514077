"""Moving engine blocks: gather (blocks -> contiguous chunk) and scatter (chunk -> blocks).

Owns ``KVLayout`` (the CPU, FlashAttention, FlashInfer and MLA cache shapes: ``layout``),
the pure-torch reference kernels and their dispatch (``blocks``) and the Triton kernels,
used on CUDA and tested against the reference (``cuda``). Knows nothing of stores or wires.

May import: ``kvrelay.common``, torch (and Triton on CUDA).
"""

# No guard against the old top-level name here, unlike the other rooms: Hugging Face's
# ``kernels`` distribution has this name, and transformers probes ``import kernels`` at import
# time. From the repository root this folder answers that probe, and must stay inert (it has
# no ``__version__``, so transformers treats it as unusable and moves on).
