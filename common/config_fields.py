"""The config types every section of kvrelay's one tree is built from.

Every section is a frozen ``msgspec.Struct`` that forbids unknown fields (:class:`Section`),
so a typo such as ``pool_byte:`` is an error that names the key. Sizes accept integers or
strings with a binary or decimal suffix (``"256MiB"``, ``"1GB"``; :func:`parse_size`).
Durations are seconds (float). Each package owns and defines its own sections from these;
:mod:`kvrelay.core.config` composes them into the one tree.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from kvrelay.common.errors import ConfigError

MiB = 1 << 20


Positive = Annotated[int, msgspec.Meta(gt=0)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
Share = Annotated[float, msgspec.Meta(ge=0, le=1)]
Size = int | str

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
          "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40}


def parse_size(value: int | str, key: str = "size") -> int:
    """``"256MiB"`` -> 268435456. Raises :class:`ConfigError` naming ``key``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(value)
    unit = (m.group(2) or "").lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"{key}: cannot parse size {value!r} (try 1048576, '1MiB' or '1MB')")
    return int(float(m.group(1)) * _UNITS[unit])


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: strict keys; ``*_bytes`` fields are parsed sizes."""

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if name.endswith("_bytes"):
                value = getattr(self, name)
                msgspec.structs.force_setattr(self, name, parse_size(value, name))
