"""pytest plugin (``-p peer_count``) for bench/cpu/peer_suite.py: the ground truth for false positives/negatives.

Independent of kernelguard: transformers' ``use_kernel_func_from_hub_with_fallback`` keeps the chosen
implementation in a closure cell ``implementation``; where that is the torch reference (``implementation is
torch_function``), both cells are replaced by one counting function (so the decision still reads "torch
reference", for kernelguard too when it runs alongside; it wraps the module global one level above), in every loaded
``transformers.models.*.modeling_*`` module (re-checked before each test for modules imported since). Eager calls
are counted there. Under torch.compile the function is not called but traced: dynamo's inlining of a reference's
code (``InliningInstructionTranslator.build_inline_tracer``) and a frame compiled for it
(``InstructionTranslator.__init__``) are counted too. Calls are attributed to the test whose setup, call or
teardown is running; ``PEER_COUNT`` gets {nodeid: {module.function: calls}}.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

_CALLS: dict[str, dict[str, int]] = {}
_CODES: dict[object, str] = {}  # code object of a torch reference -> module.function
_SEEN: set[str] = set()
_current = ["<outside a test>"]


def _record(name: str) -> None:
    calls = _CALLS.setdefault(_current[0], {})
    calls[name] = calls.get(name, 0) + 1


def _counted(torch_function, name):
    import functools

    import torch

    is_compiling = torch.compiler.is_compiling

    def counted(*args, **kwargs):
        if not is_compiling():  # traced calls are counted by the dynamo hooks below
            _record(name)
        return torch_function(*args, **kwargs)

    return functools.wraps(torch_function)(counted)


def _instrument() -> None:
    for modname, module in list(sys.modules.items()):
        if modname in _SEEN or not modname.startswith("transformers.models.") or ".modeling_" not in modname:
            continue
        _SEEN.add(modname)
        for attr, value in list(vars(module).items()):
            code = getattr(value, "__code__", None)
            if code is None or "implementation" not in code.co_freevars or "torch_function" not in code.co_freevars:
                continue
            cells = dict(zip(code.co_freevars, value.__closure__))
            torch_function = cells["torch_function"].cell_contents
            if cells["implementation"].cell_contents is torch_function:
                name = f"{modname}.{attr}"
                # Both cells: the decorator's decision (implementation is torch_function) reads as before, so
                # kernelguard, if loaded in the same run, sees the same torch reference it would see without us.
                cells["implementation"].cell_contents = cells["torch_function"].cell_contents = _counted(
                    torch_function, name)
                _CODES[torch_function.__code__] = name


def _hook_dynamo() -> None:
    try:
        from torch._dynamo import symbolic_convert as sc
    except ImportError:
        return
    build = sc.InliningInstructionTranslator.build_inline_tracer

    def build_inline_tracer(parent, func, *args, **kwargs):
        try:
            name = _CODES.get(func.get_code())
        except Exception:  # noqa: BLE001 - not a user function
            name = None
        if name is not None:
            _record(name + " [traced]")
        return build(parent, func, *args, **kwargs)

    sc.InliningInstructionTranslator.build_inline_tracer = staticmethod(build_inline_tracer)
    init = sc.InstructionTranslator.__init__

    def __init__(self, *args, **kwargs):
        code = kwargs.get("f_code", args[1] if len(args) > 1 else None)
        if code is not None and code in _CODES:
            _record(_CODES[code] + " [compiled frame]")
        init(self, *args, **kwargs)

    sc.InstructionTranslator.__init__ = __init__


def pytest_collection_finish(session):
    _instrument()
    _hook_dynamo()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _current[0] = item.nodeid
    _instrument()


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        _current[0] = "<outside a test>"


def pytest_sessionfinish(session):
    path = os.environ.get("PEER_COUNT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"calls": _CALLS, "instrumented": sorted(_CODES.values())}, f)
