"""How a transformers layer calls a kernel, read from its modeling file with :mod:`ast` (never imported).

The companion of :mod:`kernelguard.resolution.transformers_compat` (which reads what the decorator bound): what a replacement
for the kernel must accept (``check --hub``), and whether the layer hands the kernel its example boundaries
(:mod:`kernelguard.runtime.boundaries`).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CallShape", "Parameter", "call_shape", "clear_caches", "dropped_keywords", "mask_sees_positions",
           "reference_parameters", "submodule_call_drops"]


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
    """The first call of ``call_site`` inside a ``forward`` of the modeling file ``source``, else inside a
    module-level function a ``forward`` calls (transformers 5.25 calls ``causal_conv1d_fn`` from
    ``causal_conv1d_forward``, a kernels Func whose function is its module's forward), read with ast (the module
    is not imported); None when there is none."""
    try:
        tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    callers = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "forward"]
    seen: set[str] = set()
    while callers:  # breadth first: a forward's own call wins over one in a helper it calls
        called: list[ast.FunctionDef] = []
        for function in callers:
            for node in ast.walk(function):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                    continue
                if node.func.id == call_site:
                    return _shape_of(node, call_site)
                if node.func.id in helpers and node.func.id not in seen:
                    seen.add(node.func.id)
                    called.append(helpers[node.func.id])
        callers = called
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




@dataclass(frozen=True, slots=True)
class Parameter:
    """One parameter of a module-level function, as :class:`inspect.Parameter` would describe it."""

    name: str
    kind: str  # an inspect.Parameter kind's name: POSITIONAL_ONLY, POSITIONAL_OR_KEYWORD, VAR_POSITIONAL, ...
    has_default: bool


@functools.lru_cache(maxsize=64)
def reference_parameters(source: str, function: str) -> tuple[Parameter, ...] | None:
    """The parameters of the module-level ``def function`` in the modeling file ``source`` (the torch reference a
    Hub layer replaces: kernels compares the layer's ``forward`` with it), read with ast; None when absent."""
    try:
        tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    found = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function), None)
    if found is None:
        return None
    args = found.args
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    params = [Parameter(a.arg, "POSITIONAL_ONLY" if a in args.posonlyargs else "POSITIONAL_OR_KEYWORD",
                        i >= first_default) for i, a in enumerate(positional)]
    if args.vararg is not None:
        params.append(Parameter(args.vararg.arg, "VAR_POSITIONAL", False))
    params += [Parameter(a.arg, "KEYWORD_ONLY", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        params.append(Parameter(args.kwarg.arg, "VAR_KEYWORD", False))
    return tuple(params)


def clear_caches() -> None:
    """Forget the parsed call shapes (kernelguard.runtime.registry.reset() calls this)."""
    call_shape.cache_clear()
    reference_parameters.cache_clear()
    dropped_keywords.cache_clear()
    mask_sees_positions.cache_clear()
    submodule_call_drops.cache_clear()


@functools.lru_cache(maxsize=64)
def dropped_keywords(source: str, class_name: str, base: str | None = None) -> str | None:
    """Where ``class_name``'s ``forward`` (a causal LM in the modeling file ``source``) calls its base model
    (``self.<base>(...)``; without ``base``, the ``self.<attribute>(...)`` call it hands ``input_ids``) without
    passing its ``**kwargs`` on: the call, shown as the modeling file writes it; None when it passes them, or when
    the file cannot say. A batch's packed-sequence keywords given to such a model never reach its layers."""
    try:
        tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    forward = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None) if cls \
        else None
    for node in ast.walk(forward) if forward is not None else ():
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
            continue
        given = [a.id for a in node.args if isinstance(a, ast.Name)] + [k.arg for k in node.keywords if k.arg]
        if node.func.attr != base if base is not None else "input_ids" not in given:
            continue
        if any(k.arg is None for k in node.keywords):  # a ** spread passes them on
            return None
        return f"`{class_name}.forward` calls `self.{node.func.attr}(...)` without its **kwargs"
    return None


@functools.lru_cache(maxsize=64)
def submodule_call_drops(source: str, call_site: str, keyword: str) -> str | None:
    """Where a module of the modeling file ``source`` calls a submodule whose ``forward`` calls ``call_site``
    (directly or through a module-level helper) without handing it ``keyword``: neither its ``**kwargs`` nor the
    keyword by name (transformers' Inkling decoder layer calls its short convolutions so, and their conv reads
    ``seq_idx`` from a ``**kwargs`` that is always empty). The call as the file writes it; None when every such call
    hands it on, or the file cannot say."""
    try:
        tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    reaching, functions = {call_site}, {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    while grown := {name for name, f in functions.items() if name not in reaching and _calls(f, reaching)}:
        reaching |= grown
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    holders = {c.name for c in classes if (f := _method(c, "forward")) is not None and _calls(f, reaching)}
    for cls in classes:
        attributes = _submodules_of(cls, holders)
        forward = _method(cls, "forward")
        for node in ast.walk(forward) if forward is not None and attributes else ():
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                    and node.func.attr in attributes):
                continue
            if not any(k.arg is None or k.arg == keyword for k in node.keywords):
                return f"`{cls.name}.forward` calls `self.{node.func.attr}(...)` without its **kwargs"
    return None


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _calls(function: ast.FunctionDef, names: set[str]) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names
               for n in ast.walk(function))


def _submodules_of(cls: ast.ClassDef, holders: set[str]) -> set[str]:
    """The ``self.X`` attributes ``cls.__init__`` builds from one of the ``holders`` classes (``.to(...)`` and the
    like after the constructor call included)."""
    init, found = _method(cls, "__init__"), set()
    for node in ast.walk(init) if init is not None else ():
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Attribute)
                and isinstance(node.targets[0].value, ast.Name) and node.targets[0].value.id == "self"):
            continue
        value = node.value
        while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
            value = value.func.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in holders:
            found.add(node.targets[0].attr)
    return found


@functools.lru_cache(maxsize=64)
def mask_sees_positions(source: str) -> bool | None:
    """Whether the modeling file ``source`` hands the position ids to transformers' ``create_causal_mask`` (by the
    keyword, or in the ``mask_kwargs`` dict it spreads): the only way sdpa and eager see a packed row's
    boundaries. None when the file builds no causal mask there (nothing to say)."""
    try:
        tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    dict_keys = {  # name -> the string keys of a dict literal assigned to it
        t.id: {k.value for k in n.value.keys if isinstance(k, ast.Constant)}
        for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
        for t in n.targets if isinstance(t, ast.Name)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "create_causal_mask"]
    if not calls:
        return None
    for call in calls:
        for k in call.keywords:
            if k.arg == "position_ids" or (k.arg is None and isinstance(k.value, ast.Name)
                                           and "position_ids" in dict_keys.get(k.value.id, ())):
                return True
    return False
