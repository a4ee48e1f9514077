"""kvrelay prefill package."""
