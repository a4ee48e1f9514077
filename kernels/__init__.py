"""kvrelay kernels package."""
