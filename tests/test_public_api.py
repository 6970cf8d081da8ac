"""Every public name of ``kernelguard`` stays what it is, however often and in whatever order it is used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

ORDERS = {
    "require-then-check": ["require", "check", "require", "check"],
    "check-then-require": ["check", "require", "check", "require"],
    "submodule-import-first": ["import", "require", "check", "require"],
}


@pytest.mark.parametrize("order", list(ORDERS))
def test_public_functions_stay_callable_in_any_order(order: str) -> None:
    # A fresh interpreter: the bug this guards against depends on which import happens first.
    steps = "\n".join(
        "import kernelguard.api, kernelguard.check, kernelguard.guard, kernelguard.cli" if step == "import"
        else f"r = kernelguard.{step}('qwen3_5', mode='training', packed=False, arch='9.0', allow=['chunk_gated_delta_rule', "
        f"'causal_conv1d_fn', 'attention'])\nassert r.ok, r"
        for step in ORDERS[order]
    )
    code = textwrap.dedent(
        """
        import kernelguard
        """
    ) + steps + textwrap.dedent(
        """
        import types
        for name in kernelguard.__all__:
            assert not isinstance(getattr(kernelguard, name), types.ModuleType), name
        assert callable(kernelguard.guard) and callable(kernelguard.require) and callable(kernelguard.check)
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_import_kernelguard_does_not_import_torch() -> None:
    code = "import sys, kernelguard; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert (proc.returncode, proc.stdout.strip()) == (0, "False"), proc.stderr
