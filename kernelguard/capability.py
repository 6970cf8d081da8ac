"""One value type for a CUDA compute capability, parsed once at the boundary (CLI, config, probe).

Every other module compares ``ComputeCapability`` values; nobody re-parses "9.0a" or "sm_90" strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError

# Compute capabilities NVIDIA has shipped GPUs (or Jetson/Tegra parts) for. A value outside this set is a typo
# ("--arch 9.5", "--arch 90.0"), and silently checking against it would give a meaningless verdict.
KNOWN_CAPABILITIES: frozenset[tuple[int, int]] = frozenset({
    (3, 0), (3, 2), (3, 5), (3, 7), (5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5),
    (8, 0), (8, 6), (8, 7), (8, 8), (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1),
})
# "a": arch-specific features (sm_90a, sm_100a, sm_120a); "f": family-portable (sm_100f, CUDA 12.9+).
_SUFFIX_FROM = {"a": 9, "f": 10}

_PATTERN = re.compile(r"^(?:sm_?|compute_?)?(?P<major>\d{1,2})(?:\.?(?P<minor>\d))(?P<suffix>[af]?)$")

EXAMPLES = "9.0 (H100/H200), 8.0 (A100), 8.9 (L4/L40), 10.0 (B200), 12.0 (RTX 50xx)"


@dataclass(frozen=True, slots=True, order=True)
class ComputeCapability:
    major: int
    minor: int
    suffix: str = ""  # "", "a" or "f"

    @classmethod
    def parse(cls, value: object, *, source: str = "--arch") -> ComputeCapability:
        """Accept 9.0, "9.0", "90", "sm_90", "sm90a", "9.0a", "compute_90"; reject what no GPU has."""
        if isinstance(value, ComputeCapability):
            return value
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise _bad(value, source, "a compute capability such as \"9.0\"")
        text = (f"{value:.1f}" if isinstance(value, float) else str(value)).strip().lower()
        match = _PATTERN.match(text.replace(" ", ""))
        if match is None:
            raise _bad(value, source, "a compute capability such as \"9.0\"")
        major, minor, suffix = int(match["major"]), int(match["minor"]), match["suffix"]
        if (major, minor) not in KNOWN_CAPABILITIES:
            raise _bad(value, source, "the compute capability of a real NVIDIA GPU")
        if suffix and major < _SUFFIX_FROM[suffix]:
            raise _bad(value, source, f"a capability with an '{suffix}' variant (sm_{_SUFFIX_FROM[suffix]}0 or newer)")
        return cls(major, minor, suffix)

    @classmethod
    def from_tuple(cls, capability: tuple[int, int]) -> ComputeCapability:
        """From torch.cuda.get_device_capability(); trusted, so not checked against the known list."""
        return cls(int(capability[0]), int(capability[1]))

    @property
    def base(self) -> ComputeCapability:
        """The chip without the 'a'/'f' code variant: sm_90a and sm_90 are the same GPU."""
        return ComputeCapability(self.major, self.minor)

    @property
    def sm(self) -> str:
        return f"sm_{self.major}{self.minor}{self.suffix}"

    def as_tuple(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{self.suffix}"


def _bad(value: object, source: str, expected: str) -> ConfigError:
    return ConfigError(
        f"{source} {value!r} is not {expected}.",
        fix=f"use e.g. {source} 9.0; known values: {EXAMPLES}",
        details={"source": source, "value": repr(value)},
    )


def parse_all(values: object, *, source: str = "--arch") -> tuple[ComputeCapability, ...]:
    """A string or a list of them, deduplicated in order."""
    items = [values] if isinstance(values, (str, int, float, ComputeCapability)) else values
    if not isinstance(items, (list, tuple)):
        raise _bad(values, source, "a compute capability or a list of them")
    return tuple(dict.fromkeys(ComputeCapability.parse(v, source=source) for v in items))
