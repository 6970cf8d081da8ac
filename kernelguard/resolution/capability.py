"""One value type for a CUDA compute capability, parsed once at the boundary (CLI, config, probe).

Every other module compares ``ComputeCapability`` values; nobody re-parses "9.0a" or "sm_90" strings. The code
a CUDA binary carries (SASS ``sm_90a``, PTX ``compute_80``, read by :mod:`kernelguard.resolution.providers.fatbin`) is a
:class:`CodeTarget`, and :func:`code_runs_on` holds the rules for which GPUs it serves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from kernelguard.errors import ConfigError

__all__ = [
    "EXAMPLES",
    "KNOWN_CAPABILITIES",
    "PTX",
    "SASS",
    "CodeTarget",
    "ComputeCapability",
    "code_runs_on",
    "parse_all",
]

# Compute capabilities NVIDIA has shipped GPUs (or Jetson/Tegra parts) for. A value outside this set is a typo
# ("--arch 9.5", "--arch 90.0"), and silently checking against it would give a meaningless verdict.
KNOWN_CAPABILITIES: frozenset[tuple[int, int]] = frozenset({
    (3, 0), (3, 2), (3, 5), (3, 7), (5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5),
    (8, 0), (8, 6), (8, 7), (8, 8), (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1),
})
# "a": arch-specific features (sm_90a, sm_100a, sm_120a); "f": family-portable (sm_100f, CUDA 12.9+).
_SUFFIX_FROM = {"a": 9, "f": 10}

_PATTERN = re.compile(r"^(?:(?P<kind>sm|compute)_?)?(?P<major>\d{1,2})(?:\.?(?P<minor>\d))(?P<suffix>[af]?)$")
SASS, PTX = "sm", "compute"  # CodeTarget kinds: machine code for one chip family / virtual ISA the driver JITs

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


# ------------------------------------------------------------------------------------ code in a binary ---
@dataclass(frozen=True, slots=True, order=True)
class CodeTarget:
    """One code object of a CUDA binary: SASS (``sm_90a``, machine code) or PTX (``compute_80``, JIT-compiled).

    Ordered by capability then kind, the order nvcc users expect (sm_80 < sm_90 < sm_90a < sm_100).
    """

    capability: ComputeCapability
    kind: str  # SASS or PTX

    @classmethod
    def parse(cls, name: str) -> CodeTarget | None:
        """``sm_90a`` / ``compute_80``, or None for anything else. Not checked against the known GPUs: a
        binary may carry code for chips this table does not list yet."""
        match = _PATTERN.match(name)
        if match is None or match["kind"] is None or "." in name or f"{match['kind']}_" not in name:
            return None
        return cls(ComputeCapability(int(match["major"]), int(match["minor"]), match["suffix"]), match["kind"])

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.capability.major}{self.capability.minor}{self.capability.suffix}"

    def runs_on(self, device: ComputeCapability) -> bool:
        """Whether a GPU of capability ``device`` (its 'a'/'f' suffix ignored) can run this code."""
        code, gpu = self.capability, device.base
        if code.suffix == "a":  # arch-specific instructions (wgmma, tcgen05...) exist only on that exact chip
            return code.base == gpu
        if self.kind == SASS or code.suffix == "f":
            # SASS and family-specific PTX run on later minors of the same major, never across majors.
            return code.major == gpu.major and code.minor <= gpu.minor
        return code.as_tuple() <= gpu.as_tuple()  # plain PTX is forward compatible with every newer GPU


def code_runs_on(sass: Iterable[str], ptx: Iterable[str], device: ComputeCapability) -> tuple[bool, str]:
    """(ok, sentence) for a binary carrying ``sass`` and ``ptx`` targets on a ``device`` GPU.

    SASS sm_XY runs on same-major minor >= Y (sm_80 runs on 8.6, not on 9.0); arch-specific sm_90a only on
    exactly 9.0; PTX compute_XY is JIT-compiled on any arch >= XY. The sentence states expected vs found, e.g.
    'built for sm_80, sm_86 (SASS) and no PTX; needs sm_90 SASS or PTX <= compute_90'. Unparsable names
    cannot be judged and are left out.
    """
    gpu = device.base
    codes = sorted(c for c in map(CodeTarget.parse, [*sass, *ptx]) if c is not None)
    sass_codes = [c for c in codes if c.kind == SASS]
    ptx_codes = [c for c in codes if c.kind == PTX]
    found = _describe_found(sass_codes, ptx_codes)
    native = [c for c in sass_codes if c.runs_on(gpu)]
    if native:
        return True, f"{found}; {native[-1].name} SASS runs on {gpu} GPUs"
    jit = [c for c in ptx_codes if c.runs_on(gpu)]
    if jit and not sass_codes and len(ptx_codes) == 1:
        return True, f"only PTX {jit[-1].name}, JIT-compiled at first load on {gpu} GPUs"
    if jit:
        return True, f"{found}; no SASS runs on {gpu} GPUs, so PTX {jit[-1].name} is JIT-compiled at first load"
    needed = f"sm_{gpu.major}{gpu.minor}" if gpu.minor == 0 else f"sm_{gpu.major}0..sm_{gpu.major}{gpu.minor}"
    return False, f"{found}; needs {needed} SASS or PTX <= compute_{gpu.major}{gpu.minor}"


def _describe_found(sass: list[CodeTarget], ptx: list[CodeTarget]) -> str:
    sass_text = f"{', '.join(c.name for c in sass)} (SASS)" if sass else "no SASS"
    ptx_text = f"PTX {', '.join(c.name for c in ptx)}" if ptx else "no PTX"
    return f"built for {sass_text} and {ptx_text}"
