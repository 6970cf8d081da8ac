"""kernelguard.runtime.gate, the training gate of `kernelguard train` and KernelGuardCallback: the stack check runs on CUDA
only, and the trainer's refusal joins the stack check's trace and the guard's table into one GuardRefused.
CPU here: a device of type "cuda" is passed to take the stack check's path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernelguard.errors import GuardRefused
from kernelguard.resolution.policy import AllowPolicy
from kernelguard.runtime import gate
from kernelguard.stack.report import render

CUDA = torch.device("cuda")


def test_stack_check_is_skipped_off_cuda() -> None:
    assert gate.check_stack("qwen3_5", allow=AllowPolicy(), packed=True, device=torch.device("cpu")) is None


def test_a_refused_stack_and_a_refused_guard_come_back_as_one_report(fake_providers: Path, tiny: Any) -> None:
    policy = AllowPolicy()
    stack = gate.check_stack("qwen3_5", allow=policy, packed=True, device=CUDA)
    assert stack is not None and not stack.ok  # packed: varlen attention is required, and CPU torch has none
    model = tiny.tiny_model("qwen3_5")
    with pytest.raises(GuardRefused) as info:
        gate.run_gate(model, policy=policy, packed=True, stack=stack)
    stack_text, guard_text = info.value.report.split("\n\nkernelguard: transformers ", 1)
    assert stack_text == render(stack)
    assert "packed=True: SLOW PATHS" in guard_text  # the guard's own refusal follows, one line per kernel
    assert guard_text.rstrip().endswith("1 layer")  # ... as a table only: the why / fix block is the error's fix
    assert "why:" not in guard_text and "fix:" not in guard_text
    advice = info.value.fix or ""
    assert advice.startswith("why:") and "\nfix:" in advice
    assert "attention: --attention varlen" in advice and "--allow attention" in advice  # the trainer's CLI terms


def test_an_accepted_stack_passes_and_the_report_stays_armed(fake_providers: Path, tiny: Any) -> None:
    policy = AllowPolicy.parse(["attention"])
    stack = gate.check_stack("qwen3_5", allow=policy, packed=True, device=CUDA)
    assert stack is not None and stack.ok
    assert stack.options.allow is policy  # the trainer's --allow reaches the check as parsed
    with gate.run_gate(tiny.tiny_model("qwen3_5"), policy=policy, packed=True, stack=stack) as report:
        assert report.ok and report.packed


def test_a_refused_stack_alone_refuses_even_when_the_guard_passes(fake_providers: Path, tiny: Any) -> None:
    stack = gate.check_stack("qwen3_5", allow=AllowPolicy(), packed=True, device=CUDA)
    assert stack is not None and not stack.ok
    with pytest.raises(GuardRefused) as info:
        gate.run_gate(tiny.tiny_model("qwen3_5"), policy=AllowPolicy.parse(["attention"]), packed=True, stack=stack)
    stack_text, guard_text = info.value.report.split("\n\nkernelguard: transformers ", 1)
    assert stack_text == render(stack)
    assert "packed=True: OK" in guard_text  # the table of a passing guard is still printed with the refusal


def test_the_refusal_ends_with_a_why_fix_block_in_the_trainers_flags(fake_providers: Path, tiny: Any) -> None:
    stack = gate.check_stack("qwen3_5", allow=AllowPolicy(), packed=True, device=CUDA)
    with pytest.raises(GuardRefused) as info:
        gate.run_gate(tiny.tiny_model("qwen3_5"), policy=AllowPolicy(), packed=True, stack=stack)
    advice = info.value.fix or ""
    assert advice.startswith("why:\n  attention: flash_attn (flash_attn_varlen_func): flash-attn is not installed")
    assert "varlen_attention" not in advice  # the check's row name; --allow calls it attention
    assert "  attention: --attention varlen (torch's varlen attention, CUDA), or --allow attention" in advice
    assert "attn_implementation" not in advice and all(len(line) <= 100 for line in advice.splitlines())


def test_with_the_run_s_command_the_offer_is_that_command_with_what_it_lacks(fake_providers: Path, tiny: Any) -> None:
    """Only attention refused (the GDN kernels are served): the offer keeps packing and adds --allow attention
    to the run's own command; without a command (an API caller) the flags are named instead."""
    stack = gate.check_stack("qwen3_5", allow=AllowPolicy(), packed=True, device=CUDA)
    command = lambda extra: "kernelguard train --model m --output-dir out " + " ".join(extra)  # noqa: E731
    with pytest.raises(GuardRefused) as info:
        gate.run_gate(tiny.tiny_model("qwen3_5"), policy=AllowPolicy(), packed=True, stack=stack, command=command)
    advice = info.value.fix or ""
    assert advice.endswith("  or run here on the slow paths (correct, several times slower):\n"
                           "  kernelguard train --model m --output-dir out --allow attention\n"
                           "  or, on a CUDA machine, keep attention fast: --attention varlen"), advice
    assert "--packing none" not in advice
