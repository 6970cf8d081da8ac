"""`kernelguard train --compile` (kernelguard.train.model.compile): each decoder layer compiled in place with the fast
kernels and attention kept out of the graph, the same numerics as eager, and the originals put back."""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

SITES = [
    "causal_conv1d_update",
    "causal_conv1d_fn",
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
]


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    import torch._dynamo

    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


def _blocks(vocab: int) -> list[dict[str, Any]]:
    import torch

    from kernelguard.resolution.packed_batch import IGNORE_INDEX
    from kernelguard.train.step.packing import build_packed_block

    g = torch.Generator().manual_seed(1)
    examples = []
    for n in (9, 14, 6, 11):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        examples.append((ids, [IGNORE_INDEX] * 3 + ids[3:]))
    return [build_packed_block(examples[:2], 48, 0), build_packed_block(examples[2:], 48, 0)]


def _loss_and_grads(model: Any, blocks: list[dict[str, Any]]) -> tuple[list[float], list[Any]]:
    from kernelguard.resolution.packed_batch import MODEL_INPUT_KEYWORDS

    losses = []
    for b in blocks:
        out = model(**{k: b[k] for k in MODEL_INPUT_KEYWORDS}, labels=b["labels"], use_cache=False)
        out.loss.backward()
        losses.append(float(out.loss.detach()))
    return losses, [p.grad.clone() for p in model.parameters()]


def _spy_on_kernels(module: Any, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Record, at each call of the GDN chunk kernel and the causal conv, whether dynamo is tracing it."""
    import torch

    tracing: list[bool] = []
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        original = getattr(module, name)

        @functools.wraps(original)  # the fake fla unwraps the module global to reach the torch reference
        def spy(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            tracing.append(torch.compiler.is_compiling())
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return tracing


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ac", "ac"])
def test_compiled_layers_call_the_kernels_eagerly_and_match_eager(
    fake_providers: Any, tiny: Any, fresh_dynamo: None, monkeypatch: pytest.MonkeyPatch, checkpointing: bool
) -> None:
    """dynamo (backend eager: the tracing, without inductor's C++ build) compiles each layer; the GDN kernel,
    the causal conv and the attention function run outside the graph; losses and gradients equal eager's,
    with or without activation checkpointing around the compiled layer."""
    import copy

    import torch
    from torch._dynamo.utils import counters
    from transformers import AttentionInterface

    from kernelguard.train.model.compile import compile_layers
    from kernelguard.train.model.parallel import apply_activation_checkpointing

    model = tiny.tiny_model("qwen3_5").train()
    module = sys.modules[type(model).__module__]
    tracing = _spy_on_kernels(module, monkeypatch)
    blocks = _blocks(model.config.vocab_size)
    twin = copy.deepcopy(model)
    sdpa = AttentionInterface._global_mapping["sdpa"]
    originals = {name: getattr(module, name) for name in SITES}
    done = compile_layers(twin, backend="eager")
    try:
        assert done.layers == 4
        # Every hub-wrapped kernel of the modeling file (in its source order), then the attention function.
        assert sorted(done.opaque[:-1]) == sorted(f"{module.__name__}.{name}" for name in SITES)
        assert done.opaque[-1] == "attention:sdpa"
        short = ", ".join(site.rsplit(".", 1)[-1] for site in done.opaque)
        assert done.describe() == f"torch.compile: 4 decoder layers compiled in place; opaque: {short}"
        # In place: no _orig_mod. in any name, so checkpoints and exports keep the model's names.
        assert [n for n, _ in twin.named_parameters()] == [n for n, _ in model.named_parameters()]
        if checkpointing:
            apply_activation_checkpointing(twin)  # after compile: checkpoint(compiled layer)
        eager_losses, eager_grads = _loss_and_grads(model, blocks)
        tracing.clear()
        losses, grads = _loss_and_grads(twin, blocks)
        assert counters["stats"]["unique_graphs"] >= 2  # compiled: not silently eager
        assert tracing and not any(tracing), tracing  # the kernels ran, never traced
        assert losses == pytest.approx(eager_losses, rel=1e-6)
        for a, b in zip(eager_grads, grads):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    finally:
        done.restore()
    assert all(getattr(module, name) is originals[name] for name in SITES)
    assert AttentionInterface._global_mapping["sdpa"] is sdpa


def test_without_the_opaque_wrappers_dynamo_would_trace_the_kernels(
    fake_providers: Any, tiny: Any, fresh_dynamo: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control for the test above: the causal conv left out of the opaque call sites is traced."""
    from kernelguard.resolution.packed_batch import MODEL_INPUT_KEYWORDS
    from kernelguard.train.model import compile as regional

    found = regional._kernel_call_sites
    monkeypatch.setattr(
        regional, "_kernel_call_sites", lambda module: [n for n in found(module) if n != "causal_conv1d_fn"]
    )
    model = tiny.tiny_model("qwen3_5").train()
    tracing = _spy_on_kernels(sys.modules[type(model).__module__], monkeypatch)
    done = regional.compile_layers(model, backend="eager")
    try:
        assert "causal_conv1d_fn" not in done.describe()
        block = _blocks(model.config.vocab_size)[0]
        model(**{k: block[k] for k in MODEL_INPUT_KEYWORDS}, use_cache=False)
    except torch._dynamo.exc.InternalTorchDynamoError as error:
        # kernels >= 0.18's Func dispatch cannot be traced at all: dynamo failing inside it, called from the
        # spy on the conv, is the same finding (and a harder failure than a slow trace).
        assert "kernels" in str(error) and "in spy" in str(error), error
        tracing.append(True)
    finally:
        done.restore()
    assert True in tracing, tracing


def test_compile_layers_twice_wraps_once_and_restore_keeps_foreign_changes(
    fake_providers: Any, tiny: Any, fresh_dynamo: None
) -> None:
    from transformers import AttentionInterface

    from kernelguard.train.model.compile import OPAQUE_ATTR, compile_layers

    model = tiny.tiny_model("qwen3_5")
    module = sys.modules[type(model).__module__]
    original, chunk = module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule
    first = compile_layers(model, backend="eager")
    wrapper = module.causal_conv1d_fn
    assert getattr(wrapper, OPAQUE_ATTR) and wrapper.__wrapped__.__wrapped__ is original
    second = compile_layers(model, backend="eager")
    assert second.opaque == [] and module.causal_conv1d_fn is wrapper  # already opaque: not wrapped again

    def someone_elses(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    module.causal_conv1d_fn = someone_elses  # e.g. a tripwire armed after the compile
    first.restore()
    assert module.causal_conv1d_fn is someone_elses  # not ours any more: left alone
    assert module.torch_chunk_gated_delta_rule is chunk
    assert not getattr(AttentionInterface._global_mapping["sdpa"], OPAQUE_ATTR, False)
    first.restore()  # idempotent
    assert module.torch_chunk_gated_delta_rule is chunk


# ------------------------------------------------------------------------------------------- end to end ---
@pytest.mark.slow
def test_two_steps_with_compile_match_two_steps_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kernelguard train --compile` (inductor; activation checkpointing on, auto's choice on CPU) against the
    same run eager: the same losses and gradient norms within fp32 tolerance, and the log says what it did."""
    import train_helpers as h

    tok, model = h.write_tokenizer(tmp_path / "tok"), h.write_model_config(tmp_path / "model")
    data = h.write_jsonl(tmp_path / "data.jsonl", h.copy_task_rows(120))

    def run(name: str, *extra: str) -> tuple[list[dict[str, Any]], str]:
        out = tmp_path / name
        args = ["--model", str(model), "--tokenizer", str(tok), "--data", str(data), "--output-dir", str(out),
                "--block-size", "256", "--param-dtype", "fp32", "--learning-rate", "3e-3", "--max-steps", "2",
                "--no-progress", "--no-plot", "--no-export", "--allow", "attention", *extra]  # fmt: skip
        r = h.run_train(args, nproc=0)
        assert r.returncode == 0, r.stderr
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], r.stderr

    eager, eager_log = run("eager")
    # dynamo prints each graph it compiles: with the layers compiled inside a checkpoint wrapper it would
    # compile none (a checkpoint region with graph breaks runs eager), and the losses would match trivially.
    monkeypatch.setenv("TORCH_LOGS", "graph_code")
    compiled, log = run("compiled", "--compile")
    assert "TRACED GRAPH" in log
    assert len(eager) == len(compiled) == 2
    for a, b in zip(eager, compiled):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    head = r"kernelguard train: step: activation checkpointing on, 2 blocks \([\d,]+ tokens\) per forward, "
    cpu = r"auto: a cpu run has no GPU memory to budget"
    assert any(re.fullmatch(head + rf"compile off \({cpu}; compile: auto: a cpu run\)", x) for x in eager_log.splitlines())
    assert any(re.fullmatch(head + rf"compile on \({cpu}; compile: --compile\)", x) for x in log.splitlines())
    line = next(x for x in log.splitlines() if x.startswith("kernelguard train: torch.compile: "))
    assert line.startswith("kernelguard train: torch.compile: 4 decoder layers compiled in place; opaque: ")
    assert all(name in line for name in SITES) and line.endswith(", attention:sdpa")
    assert "torch.compile" not in eager_log
    saved = json.loads((tmp_path / "compiled" / "train_config.json").read_text())
    assert saved["compile"] is True and saved["activation_checkpointing"] is None
