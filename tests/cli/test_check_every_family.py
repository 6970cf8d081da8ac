"""`kernelguard check --model NAME` for every family transformers has with fast kernels (the one list,
kernelguard.resolution.discovery), with the stand-in providers installed: each kernel is served by its package,
and a packed check says for exactly the families that cannot pack why (docs/families.md's list)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from kernelguard.resolution import discovery, packing_support

FAMILIES = sorted(discovery.families())


def _check(*args: str) -> tuple[int, dict[str, Any]]:
    from kernelguard.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["check", *args, "--json"])
    return rc, json.loads(out.getvalue())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kernel_of_every_family_is_served_by_its_package(fake_mamba: Path, family: str) -> None:
    rc, report = _check("--model", family, "--mode", "training", "--no-packed", "--no-hub")
    assert rc == 0 and report["ok"], report
    assert report["kernels"], family
    for kernel in report["kernels"]:
        assert kernel["ok"] and "+kernelguard.fake" in next(
            c["reason"] for c in kernel["candidates"] if c["status"] == "selected"), kernel


def test_a_packed_check_refuses_exactly_the_families_that_cannot_pack(fake_mamba: Path) -> None:
    """The packed row's verdict (`packed_rows`) appears for the families docs/families.md marks no, with its
    reason, and for no other family (their packed checks may still fail elsewhere: sdpa on a CPU)."""
    families = discovery.families()
    for family in FAMILIES:
        _, report = _check("--model", family, "--mode", "training", "--allow", "attention", "--no-hub")
        rows = [k for k in report["kernels"] if k["kernel"] == "packed_rows"]
        problem = packing_support(families[family]).packed_problem
        if problem is None:
            assert not rows, family
        else:
            assert [r["ok"] for r in rows] == [False], family
            assert problem in json.dumps(rows), family
