"""The kvrelay configuration of every stack a benchmark starts, set the way ``kvrelay up`` sets it.

One flag style across ``kvrelay bench``: each bench that starts kvrelay stacks takes
``--config FILE`` and the config tree's own flags (``--router.decode-first true``,
``--connector.sync-landed false``, ...), and they apply to every kvrelay system of the run.
What the bench itself must decide (ports, log and event paths, and the axis it compares,
such as ``--backends``) it sets over the file; flags given on the command line come last,
so a flag always wins.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvrelay.core import config as kcfg


def add_args(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and one flag per config key, as ``kvrelay up`` has them."""
    kcfg.add_config_args(p)


def build(args: argparse.Namespace, bench: dict[str, Any]) -> kcfg.KVRelayConfig:
    """The config of one system: the user's ``--config`` file, the bench's own ``bench`` data
    over it (nested sections merge), then the user's flags over both."""
    path = getattr(args, "config", None)
    data = merge(kcfg.read_yaml(path) if path else {}, bench)
    return kcfg.from_dict(kcfg.with_overrides(data, kcfg.flag_overrides(args)))


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on ``base``: mappings merge key by key, anything else replaces (new dicts)."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        out[key] = merge(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return out
