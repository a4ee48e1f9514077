"""kvrelay bench package."""
