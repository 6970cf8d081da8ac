"""Numerics of the resolved fast kernels against transformers' own torch reference (``check --run``).

- :mod:`.shapes`: the layer geometries and token layouts exercised (the model's own from its config, generic)
- :mod:`.references`: the kernels, where transformers imports each, and their undecorated torch references
- :mod:`.results`: :class:`NumericsCase` / :class:`NumericsReport`, the comparison and ``REL_TOL``
- :mod:`.cases`: the per-kernel checks (GDN and KDA chunk and recurrent, causal conv and its decode update)
- :mod:`.run`: :func:`run_numerics`, which ties them together, and ``python -m kernelguard.stack.numerics``

Torch and the kernels are imported inside functions: importing this package costs nothing.
"""

from kernelguard.resolution import lift_fla_hopper_refusal

from .references import (
    CHUNK,
    CONV,
    CONV_UPDATE,
    KDA_CHUNK,
    KDA_KERNELS,
    KDA_RECURRENT,
    KERNELS,
    RECURRENT,
    KernelSource,
    default_providers,
    kernel_gets_key_heads,
    kernel_sources,
    modeling_module_name,
    torch_references,
    undecorated,
)
from .results import REL_TOL, NumericsCase, NumericsReport, compare, error_case
from .run import run_numerics, slow_run_note
from .shapes import PACKED_LAYOUT, PADDED_LAYOUT, GdnShape, generic_shapes, plan_shapes, shapes_for_model

__all__ = [
    "CHUNK",
    "CONV",
    "CONV_UPDATE",
    "KDA_CHUNK",
    "KDA_KERNELS",
    "KDA_RECURRENT",
    "KERNELS",
    "PACKED_LAYOUT",
    "PADDED_LAYOUT",
    "RECURRENT",
    "REL_TOL",
    "GdnShape",
    "KernelSource",
    "NumericsCase",
    "NumericsReport",
    "compare",
    "default_providers",
    "error_case",
    "generic_shapes",
    "kernel_gets_key_heads",
    "kernel_sources",
    "lift_fla_hopper_refusal",
    "modeling_module_name",
    "plan_shapes",
    "run_numerics",
    "shapes_for_model",
    "slow_run_note",
    "torch_references",
    "undecorated",
]
