"""kvrelay decode package."""
