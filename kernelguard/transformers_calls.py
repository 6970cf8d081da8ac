"""How a transformers layer calls a kernel, read from its modeling file with :mod:`ast` (never imported).

The companion of :mod:`kernelguard.transformers_compat` (which reads what the decorator bound): what a replacement
for the kernel must accept (``check --hub``), and whether the layer hands the kernel its example boundaries
(:mod:`kernelguard.boundaries`).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CallShape", "call_shape", "clear_caches"]


@dataclass(frozen=True, slots=True)
class CallShape:
    """How a layer's forward calls a kernel: what a replacement (a Hub layer's forward) must accept."""

    function: str  # the module-level name called, e.g. "torch_chunk_gated_delta_rule"
    positional: int  # positional arguments passed
    keywords: tuple[str, ...]  # keyword arguments passed by name
    popped: tuple[str, ...] = ()  # batch keywords the call takes out of **kwargs for its own keywords
    spreads: bool = False  # the call passes the layer's **kwargs on (the batch's packed-sequence keywords)

    def describe(self) -> str:
        parts = [f"{self.positional} positional"] + [f"{k}=" for k in self.keywords]
        return f"{self.function}({', '.join(parts + (['**kwargs'] if self.spreads else []))})"


@functools.lru_cache(maxsize=64)
def call_shape(source: str, call_site: str) -> CallShape | None:
    """The first call of ``call_site`` inside a ``forward`` of the modeling file ``source``, read with ast (the
    module is not imported); None when there is none."""
    try:
        tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef) or function.name != "forward":
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == call_site:
                return _shape_of(node, call_site)
    return None


def _shape_of(node: ast.Call, name: str) -> CallShape:
    popped = tuple(
        str(kw.value.args[0].value) for kw in node.keywords
        if kw.arg is not None and isinstance(kw.value, ast.Call) and isinstance(kw.value.func, ast.Attribute)
        and kw.value.func.attr == "pop" and kw.value.args and isinstance(kw.value.args[0], ast.Constant)
    )
    return CallShape(
        function=name,
        positional=sum(1 for a in node.args if not isinstance(a, ast.Starred)),
        keywords=tuple(kw.arg for kw in node.keywords if kw.arg is not None),
        popped=popped,
        spreads=any(kw.arg is None for kw in node.keywords),
    )




def clear_caches() -> None:
    """Forget the parsed call shapes (kernelguard.registry.reset() calls this)."""
    call_shape.cache_clear()
