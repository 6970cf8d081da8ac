"""KernelGuardCallback with transformers' Trainer on a tiny random-init Qwen3.5: refuses before step 1 without
fast providers, passes with the fake ones, honours the allow list, detects packed collators."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kernelguard.errors import ConfigError, KernelFallbackError
from kernelguard.integrations.transformers import KernelGuardCallback, Packing, detect_packing, packing_note
from kernelguard.resolution.decisions import REFERENCE

GDN_KERNELS = ("chunk_gated_delta_rule", "causal_conv1d_fn")


def _rows(n: int = 4, length: int = 12, vocab: int = 256) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(3, vocab, (length - (i % 3),), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


def _padded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    width = max(len(r["input_ids"]) for r in rows)
    return [
        {
            "input_ids": torch.tensor(r["input_ids"] + [0] * (width - len(r["input_ids"]))),
            "attention_mask": torch.tensor([1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"]))),
            "labels": torch.tensor(r["labels"] + [-100] * (width - len(r["labels"]))),
        }
        for r in rows
    ]


def _trainer(model: Any, tmp_path: Path, callback: KernelGuardCallback, *, collator: Any = None,
             rows: list[dict[str, Any]] | None = None, steps: int = 2) -> Any:
    from transformers import Trainer, TrainingArguments, default_data_collator

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-2,
        report_to="none", use_cpu=True, logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )
    data = rows if rows is not None else _padded(_rows())
    return Trainer(model=model, args=args, train_dataset=data, data_collator=collator or default_data_collator,
                   callbacks=[callback])


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: Any, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _kernelguard_logs(trainer: Any) -> list[dict[str, Any]]:
    return [entry["kernelguard"] for entry in trainer.state.log_history if "kernelguard" in entry]


# ------------------------------------------------------------------------------------------ refusal ---
def test_refuses_before_step_one_without_fast_providers(
    fresh_transformers_models: None, tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny.tiny_model("qwen3_5").train()
    before = _params(model)
    trainer = _trainer(model, tmp_path, KernelGuardCallback())
    with pytest.raises(KernelFallbackError) as info:
        trainer.train()
    text = str(info.value)
    assert text.startswith("kernelguard refused to start training (before step 1).")
    for kernel in GDN_KERNELS:  # one line per kernel, then why / fix naming every slow kernel and its layers
        assert re.search(rf"\n  FALLBACK +{kernel} +torch reference +3 layers\n", text), text
        assert f"why: {kernel} -> torch reference in model.layers.0.linear_attn" in text
    assert "model.layers.0.linear_attn  " not in text  # the per-layer table only with verbose=True
    assert all(len(line) <= 100 for line in text.splitlines() if "pip install" not in line), text  # commands stay whole
    assert text.count("or accept explicitly") == 1  # the fixes once, after "Fix:"
    assert "pip install" in info.value.fix
    assert "KernelGuardCallback(allow=['causal_conv1d_fn', 'chunk_gated_delta_rule'])" in info.value.fix
    assert trainer.state.global_step == 0
    assert _unchanged(model, before)  # no optimizer step
    assert _kernelguard_logs(trainer) == []
    assert "guard passed" not in capsys.readouterr().err
    # docs/INTEGRATIONS.md quotes exactly this message (transformers' version aside)
    doc = (Path(__file__).parents[2] / "docs" / "INTEGRATIONS.md").read_text(encoding="utf-8")
    quoted = doc.split("If any step refuses", 1)[1].split("```\n", 2)[1]
    actual = f"{type(info.value).__module__}.{type(info.value).__name__}: {text}\n"
    if os.environ.get("KERNELGUARD_UPDATE_DOCS"):
        (Path(__file__).parents[2] / "docs" / "INTEGRATIONS.md").write_text(doc.replace(quoted, actual))
    version = re.compile(r"transformers \d+\.\d+\.\d+")
    assert version.sub("transformers X", quoted) == version.sub("transformers X", actual)


def test_partial_allow_still_refuses_and_names_the_other_kernel(
    fresh_transformers_models: None, tiny: Any, tmp_path: Path
) -> None:
    model = tiny.tiny_model("qwen3_5").train()
    trainer = _trainer(model, tmp_path, KernelGuardCallback(allow=["chunk_gated_delta_rule"]))
    with pytest.raises(KernelFallbackError) as info:
        trainer.train()
    assert info.value.kernel == "causal_conv1d_fn"
    assert "KernelGuardCallback(allow=['causal_conv1d_fn'])" in info.value.fix
    assert "ALLOWED-SLOW" in str(info.value)  # the accepted kernel is shown as accepted, not hidden
    assert trainer.state.global_step == 0


# ------------------------------------------------------------------------------------------- passing ---
def test_passes_with_fake_providers_and_records_them(
    fake_providers: Path, tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny.tiny_model("qwen3_5").train()
    before = _params(model)
    callback = KernelGuardCallback()
    trainer = _trainer(model, tmp_path, callback)
    trainer.train()
    assert trainer.state.global_step == 2
    assert not _unchanged(model, before)
    (summary,) = _kernelguard_logs(trainer)
    assert summary["ok"] is True and summary["packed"] is False
    assert summary["packed_source"] == "padded batches (no padding-free or flattening collator)"
    assert summary["providers"]["chunk_gated_delta_rule"].startswith("fla.ops.gated_delta_rule.")
    assert summary["providers"]["chunk_gated_delta_rule"].endswith("(package)")
    assert summary["providers"]["causal_conv1d_fn"].startswith("causal_conv1d.")
    assert summary["providers"]["attention"] == "sdpa (package)"
    assert summary["allowed_slow"] == [] and summary["armed_sites"] == []
    assert summary["check"] == "not run (the stack check needs the model on a CUDA device)"
    err = capsys.readouterr().err
    assert err.count("kernelguard: guard passed") == 1
    assert re.search(r"\n  fast +chunk_gated_delta_rule +fla 0\.6\.0\S* +3 layers\n", err), err  # per kernel
    assert "model.layers.0.linear_attn" not in err  # the per-layer table only with verbose=True
    assert callback.report is None  # disarmed on train end


def test_verbose_callback_prints_the_per_layer_table(
    fake_providers: Path, tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = _trainer(tiny.tiny_model("qwen3_5").train(), tmp_path, KernelGuardCallback(verbose=True))
    trainer.train()
    err = capsys.readouterr().err
    assert re.search(r"model\.layers\.0\.linear_attn +chunk_gated_delta_rule +fast", err), err


def test_allow_list_trains_on_the_reference_path_and_disarms_after(
    fresh_transformers_models: None, tiny: Any, tmp_path: Path
) -> None:
    from kernelguard.runtime.model_guard import clear_fallback_events, fallback_events

    model = tiny.tiny_model("qwen3_5").train()
    module = __import__(type(model).__module__, fromlist=["_"])
    original = module.torch_chunk_gated_delta_rule
    callback = KernelGuardCallback(allow=list(GDN_KERNELS))
    trainer = _trainer(model, tmp_path, callback, steps=1)
    clear_fallback_events()
    trainer.train()
    assert trainer.state.global_step == 1
    (summary,) = _kernelguard_logs(trainer)
    assert sorted(summary["allowed_slow"]) == sorted(GDN_KERNELS)
    assert summary["providers"]["chunk_gated_delta_rule"].endswith(f"({REFERENCE})")
    assert len(summary["armed_sites"]) >= 2  # the accepted reference paths were armed for the run...
    kernels = {e.kernel for e in fallback_events()}
    assert {"chunk_gated_delta_rule", "causal_conv1d_fn"} <= kernels  # ...and every entry was recorded as allowed
    assert all(e.allowed for e in fallback_events())
    assert module.torch_chunk_gated_delta_rule is original  # and restored on train end
    clear_fallback_events()


def test_allow_is_parsed_once_at_construction() -> None:
    assert KernelGuardCallback(allow="attention").allow == ("attention",)
    with pytest.raises(ConfigError) as info:
        KernelGuardCallback(allow=["chunk_gated_delta_rul"])  # a typo must never silently allow nothing
    assert "KernelGuardCallback(allow=...)" in str(info.value)


# ------------------------------------------------------------------------------------------- packing ---
def _flattened_rows() -> list[dict[str, Any]]:
    return [{"input_ids": r["input_ids"]} for r in _rows()]


def test_packed_collator_with_sdpa_refuses_on_attention(fake_providers: Path, tiny: Any, tmp_path: Path) -> None:
    from transformers import DataCollatorWithFlattening

    model = tiny.tiny_model("qwen3_5").train()
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    trainer = _trainer(model, tmp_path, KernelGuardCallback(), collator=collator, rows=_flattened_rows())
    with pytest.raises(KernelFallbackError) as info:
        trainer.train()
    assert info.value.kernel == "attention"
    assert "O(T^2) block mask" in str(info.value)
    assert "kernelguard_varlen" in info.value.fix
    assert trainer.state.global_step == 0


def test_flattening_without_boundaries_is_refused_for_gdn_models(
    fake_providers: Path, tiny: Any, tmp_path: Path
) -> None:
    from transformers import DataCollatorWithFlattening

    model = tiny.tiny_model("qwen3_5").train()
    collator = DataCollatorWithFlattening()  # position_ids only: GDN state leaks across examples
    callback = KernelGuardCallback(allow=["attention"])
    trainer = _trainer(model, tmp_path, callback, collator=collator, rows=_flattened_rows())
    with pytest.raises(ConfigError) as info:
        trainer.train()
    assert "carry no cu_seq_lens_q/seq_idx" in info.value.message
    assert "chunk_gated_delta_rule" in info.value.message
    assert "return_seq_idx=True" in info.value.fix
    assert info.value.fix.endswith("or accept it explicitly with KernelGuardCallback(allow=['packed-without-boundaries'])")
    assert trainer.state.global_step == 0
    assert callback.report is None


def test_packed_training_with_varlen_attention_passes(
    fake_providers: Path, tiny: Any, tmp_path: Path, cpu_varlen: None
) -> None:
    from transformers import DataCollatorWithFlattening

    from kernelguard.integrations.transformers import VARLEN_NAME, register_varlen_attention

    register_varlen_attention(device_type="cuda")
    model = tiny.tiny_model("qwen3_5", attn_implementation=VARLEN_NAME).train()
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    trainer = _trainer(model, tmp_path, KernelGuardCallback(), collator=collator, rows=_flattened_rows())
    trainer.train()
    (summary,) = _kernelguard_logs(trainer)
    assert summary["packed"] is True and summary["packed_source"] == "DataCollatorWithFlattening"
    assert summary["providers"]["attention"] == "kernelguard_varlen (package)"


def test_detect_packing_from_trainer_arguments_and_override() -> None:
    from types import SimpleNamespace

    from transformers import DataCollatorWithFlattening

    sft = type("SFTConfig", (), {})
    args = sft()
    args.padding_free = True
    assert detect_packing(args, None) == Packing(True, "SFTConfig.padding_free=True", None)
    args = sft()
    args.packing, args.packing_strategy = True, "bfd"
    assert detect_packing(args, None).source == "SFTConfig.packing=True (packing_strategy='bfd')"
    args.packing_strategy = "wrapped"  # one long row per batch, not flattened examples
    assert detect_packing(args, None).packed is False
    assert packing_note(args) == (
        "kernelguard: note: SFTConfig.packing_strategy='wrapped' joins the examples and cuts rows mid-example: each "
        "row's examples see one another in every layer (attention and GDN state alike). packing_strategy='bfd' "
        "keeps them apart."
    )
    args.packing_strategy = "bfd"
    assert packing_note(args) is None
    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    assert detect_packing(SimpleNamespace(), flat) == Packing(True, "DataCollatorWithFlattening", True)
    assert detect_packing(SimpleNamespace(), DataCollatorWithFlattening()).boundaries is False
    forced = detect_packing(SimpleNamespace(), flat, packed=False)
    assert forced == Packing(False, "KernelGuardCallback(packed=False)", True)


# --------------------------------------------------------------------------------------------- ranks ---
def test_a_passing_rank_stops_with_a_refusing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernelguard.integrations import transformers as integration

    monkeypatch.setattr(integration, "failing_ranks", lambda failed, args: [1])
    monkeypatch.setattr(integration, "_rank_and_world", lambda args: (0, 2))
    with pytest.raises(KernelFallbackError) as info:
        integration._stop_everywhere(None, object())
    assert str(info.value) == (
        "kernelguard refused to start training on rank(s) [1] (the report is printed by rank 1); "
        "this rank 0 passed and stops with them."
    )
    refusal = ConfigError("full report", fix="the fix")
    monkeypatch.setattr(integration, "_rank_and_world", lambda args: (1, 2))
    with pytest.raises(ConfigError) as own:
        integration._stop_everywhere(refusal, object())
    assert own.value is refusal  # the first refusing rank prints the whole report


def test_single_process_verdict_needs_no_process_group() -> None:
    from kernelguard.integrations.transformers import failing_ranks

    assert failing_ranks(True, object()) == [0]
    assert failing_ranks(False, object()) == []


# ---------------------------------------------------------------------------------------- stack check ---
def test_stack_check_resolves_the_models_own_config(
    fake_providers: Path, tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the callback runs `kernelguard check` from the trained model's config (its real key head dim),
    packed or not as the run is. CPU here: pretend the model is on CUDA to take that path."""
    from kernelguard.errors import ResolutionError
    from kernelguard.integrations import transformers as integration
    from kernelguard.runtime import gate

    monkeypatch.setattr(gate, "model_device", lambda model: torch.device("cuda"))
    model = tiny.tiny_model("qwen3_5")
    result = integration.check_stack(model, allow=(), packed=False)
    assert result.ok
    assert result.model_origin.endswith("config.json")
    assert result.resolution.requirements.key_head_dim == 16  # the tiny model's, not the family default
    with pytest.raises(ResolutionError) as info:  # packed: varlen attention is required, and CPU torch has none
        integration.check_stack(model, allow=(), packed=True)
    assert "varlen_attention" in str(info.value)
    accepted = integration.check_stack(model, allow=["attention"], packed=True)
    assert accepted.ok
    with integration.guard_model(model, allow=("attention",), packed=True) as report:
        summary = integration.providers_summary(report, integration.Packing(True, "test", True), accepted)
    assert summary["check"].startswith("OK")
    assert "varlen_attention" in summary["check"]  # the accepted fallback is named


def test_stack_check_is_skipped_off_cuda_and_for_models_without_fallback_kernels(tiny: Any, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from kernelguard.integrations import transformers as integration

    assert integration.check_stack(tiny.tiny_model("qwen3_5"), allow=(), packed=True) is None  # CPU
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    assert integration._check_reference(llama, None, tmp_path) is None  # the guard still checks its attention
    assert integration._check_reference(llama, "qwen3_5", tmp_path) == "qwen3_5"  # model= wins


# -------------------------------------------------------------------------------------- two ranks ---
RANKS_SCRIPT = '''
import os, sys
sys.path[:0] = [{tests!r}]
import torch, tiny_models
from transformers import Trainer, TrainingArguments, default_data_collator
from kernelguard.integrations.transformers import KernelGuardCallback

rank = int(os.environ["RANK"])
# Rank 0 accepts the slow GDN paths, rank 1 does not: only rank 1 refuses.
allow = ["chunk_gated_delta_rule", "causal_conv1d_fn"] if rank == 0 else []
model = tiny_models.tiny_model("qwen3_5").train()
rows = [{{"input_ids": torch.arange(3, 11), "labels": torch.arange(3, 11)}} for _ in range(8)]
args = TrainingArguments(output_dir={out!r}, max_steps=1, per_device_train_batch_size=2, report_to="none",
                         use_cpu=True, save_strategy="no", disable_tqdm=True, ddp_backend="gloo")
trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
                  callbacks=[KernelGuardCallback(allow=allow)])
try:
    trainer.train()
except Exception as e:
    print(f"RANK{{rank}} {{type(e).__name__}}: {{str(e).splitlines()[0]}}", flush=True)
    print(f"RANK{{rank}} step={{trainer.state.global_step}}", flush=True)
    sys.exit(3)
print(f"RANK{{rank}} trained", flush=True)
'''


@pytest.mark.slow
def test_two_ranks_stop_together_when_one_refuses(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    tests = str(Path(__file__).resolve().parents[1])
    script = tmp_path / "job.py"
    script.write_text(RANKS_SCRIPT.format(tests=tests, out=str(tmp_path / "out")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join([str(Path(tests).parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", str(script)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    out = proc.stdout
    assert proc.returncode != 0, out + proc.stderr
    assert "RANK1 KernelFallbackError: kernelguard refused to start training (before step 1)." in out
    assert ("RANK0 KernelFallbackError: kernelguard refused to start training on rank(s) [1] (the report is "
            "printed by rank 1); this rank 0 passed and stops with them.") in out
    assert "RANK0 step=0" in out and "RANK1 step=0" in out
    assert "trained" not in out


def test_the_callback_refuses_a_node_that_differs_from_its_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lock= (or KERNELGUARD_LOCK) is checked on train begin, before the guard, on any device."""
    import json
    from types import SimpleNamespace

    from kernelguard.errors import LockMismatch
    from kernelguard.stack import stack_lock

    lock = tmp_path / "kernelguard.lock"
    lock.write_text(json.dumps({"kernelguard_lock": 1, "target_archs": [], "allow": [], "kernels": {},
                                "model": {"name": "qwen3_5", "family": "qwen3_5", "mode": "training"},
                                "stack": {"triton": "3.6.0"}}))
    seen: list[Any] = []
    real = stack_lock.run_check
    monkeypatch.setattr(stack_lock, "run_check", lambda options: seen.append(options) or real(options))
    args = SimpleNamespace(padding_free=False, packing=False, world_size=1, process_index=0)
    state = SimpleNamespace(log_history=[], global_step=0, is_world_process_zero=True)
    with pytest.raises(LockMismatch) as info:
        KernelGuardCallback(lock=lock).on_train_begin(args, state, None, model=torch.nn.Linear(2, 2))
    assert info.value.differences[0].startswith("triton: lock says 3.6.0, here ")
    assert list(seen[0].allow) == [] and seen[0].model == "qwen3_5"  # the run's allow items (none), the lock's model
    monkeypatch.setenv("KERNELGUARD_LOCK", str(lock))
    with pytest.raises(LockMismatch):
        KernelGuardCallback().on_train_begin(args, state, None, model=torch.nn.Linear(2, 2))
    # the run's allow items are the guard's: a lock that accepted more than the run does is a difference too
    monkeypatch.delenv("KERNELGUARD_LOCK")
    lock.write_text(json.dumps({"kernelguard_lock": 1, "target_archs": [], "allow": ["attention"], "kernels": {},
                                "model": {"name": "qwen3_5", "family": "qwen3_5", "mode": "training"}, "stack": {}}))
    with pytest.raises(LockMismatch) as info:
        KernelGuardCallback(lock=lock).on_train_begin(args, state, None, model=torch.nn.Linear(2, 2))
    assert info.value.differences[0] == (
        "allow items: lock says [attention], here none; restore: pass exactly the lock's: allow=['attention']")
    # and a lock without the entries of the kernels the check requires is compared both ways (issue: the lock)
    assert all(": lock says no entry for it, here " in d for d in info.value.differences[1:])
    assert len(info.value.differences) > 1


def test_flattening_without_boundaries_passes_with_the_explicit_allow_item(
    fake_providers: Path, tiny: Any, tmp_path: Path
) -> None:
    from transformers import DataCollatorWithFlattening

    model = tiny.tiny_model("qwen3_5").train()
    callback = KernelGuardCallback(allow=["attention", "packed-without-boundaries"])
    trainer = _trainer(model, tmp_path, callback, collator=DataCollatorWithFlattening(), rows=_flattened_rows(),
                       steps=1)
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_collator_the_callback_cannot_read_is_refused_at_the_first_forward(
    fake_providers: Path, tiny: Any, tmp_path: Path
) -> None:
    """A hand-written concatenating collator: nothing to probe before step 1, so the guard's per-call check
    refuses the first packed row."""
    from kernelguard.errors import PackedWithoutBoundariesError

    def concatenate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [t for r in rows for t in r["input_ids"]]
        positions = [p for r in rows for p in range(len(r["input_ids"]))]
        return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids]), "position_ids": torch.tensor([positions])}

    model = tiny.tiny_model("qwen3_5").train()
    callback = KernelGuardCallback(allow=["attention"], packed=True)
    trainer = _trainer(model, tmp_path, callback, collator=concatenate, rows=_flattened_rows())
    with pytest.raises(PackedWithoutBoundariesError) as info:
        trainer.train()
    assert info.value.message.startswith(
        "kernelguard: model.layers.0.linear_attn (and 2 more GDN layers) got a packed row of 2 examples (by its "
        "position_ids) but its gated-delta kernels get no `cu_seqlens`")
    assert trainer.state.global_step == 0
