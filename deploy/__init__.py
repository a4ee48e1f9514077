"""Operator tools (the top floor): the local stack launcher, the tiny model and warmup.

The shell scripts next to this package (``setup.sh``, ``quickstart.sh``, the pool
launchers) drive the same code through the ``kvrelay`` CLI. Nothing below this floor
imports it.
"""
