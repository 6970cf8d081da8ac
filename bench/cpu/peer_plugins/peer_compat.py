"""pytest plugin (``-p peer_compat``) for bench/cpu/peer_suite.py: version-skew shims only.

The mirror's test helpers import a few names that the installed transformers lacks. ``_TEXT_MODEL_TESTER_DEFAULTS``
(a dict of tester defaults) is read at run time, as a literal, from the mirror's own ``testing_utils.py``
(``PEER_MIRROR_TESTING_UTILS``); the other names are multi-GPU helpers (FSDP / tensor parallel) that no CPU test
calls, replaced by stubs that raise if one ever is. Nothing here touches a kernel path.
"""

from __future__ import annotations

import ast
import importlib
import os

STUBS = (
    ("transformers.distributed.fsdp", "expand_fsdp_plan"),
    ("transformers.distributed.utils", "load_optimizer_distributed"),
    ("transformers.distributed.utils", "save_optimizer_distributed"),
    ("transformers.integrations.tensor_parallel", "_get_parameter_tp_plan"),
)


def _mirror_literal(path: str, name: str) -> object:
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} not found in {path}")


def _stub(name: str):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"peer_compat stub {name}: not in the installed transformers")

    stub.__name__ = name
    return stub


def _apply() -> list[str]:
    import transformers.testing_utils as tu

    added = []
    if not hasattr(tu, "_TEXT_MODEL_TESTER_DEFAULTS"):
        tu._TEXT_MODEL_TESTER_DEFAULTS = _mirror_literal(os.environ["PEER_MIRROR_TESTING_UTILS"],
                                                         "_TEXT_MODEL_TESTER_DEFAULTS")
        added.append("transformers.testing_utils._TEXT_MODEL_TESTER_DEFAULTS")
    for module, name in STUBS:
        m = importlib.import_module(module)
        if not hasattr(m, name):
            setattr(m, name, _stub(name))
            added.append(f"{module}.{name}")
    return added


ADDED = _apply()
