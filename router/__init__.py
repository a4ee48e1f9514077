"""kvrelay router package."""
