"""What a check is for: the GPUs the job runs on, what the user accepts, whether the load uses Hub kernels."""

from __future__ import annotations

from dataclasses import dataclass, field

from .capability import ComputeCapability, parse_all
from .policy import AllowPolicy

__all__ = ["Target"]


@dataclass(frozen=True, slots=True)
class Target:
    """What the job will run on and what the user accepts."""

    archs: tuple[ComputeCapability, ...] = ()  # empty = unknown
    arch_source: str = "unknown"
    allow: AllowPolicy = field(default_factory=AllowPolicy)
    use_hub: bool = False  # the job loads with use_kernels=True / calls kernelize()
    hub_source: str = ""  # why use_hub is what it is (kernelguard.resolution.hub_load.resolve_use_hub), for the report

    def __post_init__(self) -> None:
        # Callers may pass what a user typed ("9.0", ["fla-640-refusal"]); it is parsed here, once.
        if not all(isinstance(a, ComputeCapability) for a in self.archs):
            object.__setattr__(self, "archs", parse_all(list(self.archs), source="target arch"))
        if not isinstance(self.allow, AllowPolicy):
            object.__setattr__(self, "allow", AllowPolicy.parse(self.allow, source="allow"))
