"""KernelGuardCallback with TRL's SFTTrainer (padding-free packing) on a tiny Qwen3.5, offline; TRL padding-free
batches through ``kernelguard_varlen`` give the loss of the same examples unpacked."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
# TRL's SFTConfig sets `gradient_checkpointing`, which transformers >= 5.24 renames: TRL's warning, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

from kernelguard.errors import KernelFallbackError
from kernelguard.integrations.transformers import KernelGuardCallback

TEXTS = [
    "the quick brown fox",
    "jumps over",
    "a lazy dog and runs away into the woods",
    "hello",
    "packed rows must never leak state",
    "kernel",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from train_helpers import write_tokenizer

    return write_tokenizer(tmp_path_factory.mktemp("tok"))


def _model(tiny: Any, attn: str = "sdpa") -> Any:
    from train_helpers import VOCAB_SIZE

    return tiny.tiny_model("qwen3_5", vocab_size=VOCAB_SIZE, pad_token_id=0, attn_implementation=attn).train()


def _sft(model: Any, tokenizer_dir: Path, tmp_path: Path, *, padding_free: bool,
         callbacks: list[Any] | None = None, steps: int = 1) -> Any:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=len(TEXTS),
        padding_free=padding_free, max_length=None, learning_rate=1e-2, bf16=False, use_cpu=True,
        report_to="none", logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    return SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list([{"text": t} for t in TEXTS]),
        processing_class=AutoTokenizer.from_pretrained(str(tokenizer_dir)), callbacks=callbacks or [],
    )


def _kernelguard_log(trainer: Any) -> dict[str, Any]:
    (entry,) = [e["kernelguard"] for e in trainer.state.log_history if "kernelguard" in e]
    return entry


def test_sft_padding_free_refuses_before_step_one_without_fast_providers(
    fresh_transformers_models: None, tiny: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    model = _model(tiny)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _sft(model, tokenizer_dir, tmp_path, padding_free=True, callbacks=[KernelGuardCallback()])
    with pytest.raises(KernelFallbackError) as info:
        trainer.train()
    text = str(info.value)
    assert "packed=True" in text  # detected from SFTConfig.padding_free
    for kernel in ("chunk_gated_delta_rule", "causal_conv1d_fn", "attention"):
        assert f"why: {kernel} -> " in text
    assert "pip install 'flash-linear-attention>=0.6.0,<1'" in info.value.fix  # check's command, pinned
    assert "kernelguard_varlen" in info.value.fix
    # Packed: only attention can be allowed; the GDN kernels need padded batches (no allow keeps rows apart).
    assert "KernelGuardCallback(allow=['attention'])" in info.value.fix
    assert "padding_free=False" in info.value.fix
    assert trainer.state.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_sft_allow_list_trains_padded_batches_on_the_slow_paths(
    fresh_transformers_models: None, tiny: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    allow = ["chunk_gated_delta_rule", "causal_conv1d_fn"]
    trainer = _sft(_model(tiny), tokenizer_dir, tmp_path, padding_free=False,
                   callbacks=[KernelGuardCallback(allow=allow, verbose=False)])
    trainer.train()
    assert trainer.state.global_step == 1
    summary = _kernelguard_log(trainer)
    assert summary["packed"] is False
    assert sorted(summary["allowed_slow"]) == sorted(allow)


def test_sft_padding_free_cannot_allow_the_torch_references(
    fresh_transformers_models: None, tiny: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """transformers' torch references raise on packed sequences (5.24) or mix them (older): allow= cannot help."""
    callback = KernelGuardCallback(allow=["chunk_gated_delta_rule", "causal_conv1d_fn", "attention"])
    trainer = _sft(_model(tiny), tokenizer_dir, tmp_path, padding_free=True, callbacks=[callback])
    with pytest.raises(KernelFallbackError) as info:
        trainer.train()
    assert info.value.message.startswith("kernelguard refused to start training (before step 1).")
    assert "allowed, but the torch reference cannot keep packed examples apart" in info.value.message
    assert "pip install 'flash-linear-attention>=0.6.0,<1'" in info.value.fix  # check's command, pinned
    assert "padding_free=False" in info.value.fix
    assert "KernelGuardCallback(allow=" not in info.value.fix  # an allow cannot help here
    assert trainer.state.global_step == 0
    assert callback.report is None  # nothing left armed


def test_sft_padding_free_with_fakes_and_varlen_passes(
    fake_providers: Path, tiny: Any, tokenizer_dir: Path, tmp_path: Path, cpu_varlen: None
) -> None:
    from kernelguard.integrations.transformers import VARLEN_NAME, register_varlen_attention

    register_varlen_attention(device_type="cuda")  # registers; on CUDA this is the name it returns
    callback = KernelGuardCallback()
    trainer = _sft(_model(tiny, VARLEN_NAME), tokenizer_dir, tmp_path, padding_free=True, callbacks=[callback],
                   steps=2)
    trainer.train()
    assert trainer.state.global_step == 2
    summary = _kernelguard_log(trainer)
    assert summary["packed"] is True and summary["packed_source"] == "SFTConfig.padding_free=True"
    assert callback.packing is not None and callback.packing.boundaries is True  # TRL sends cu_seq_lens + seq_idx
    assert summary["providers"]["attention"] == "kernelguard_varlen (package)"
    assert summary["providers"]["chunk_gated_delta_rule"].startswith("fla.ops.gated_delta_rule.")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses)


def test_sft_padding_free_varlen_loss_equals_unpacked(
    fake_providers: Path, tiny: Any, tokenizer_dir: Path, tmp_path: Path, cpu_varlen: None
) -> None:
    from kernelguard.integrations.transformers import VARLEN_NAME, register_varlen_attention

    register_varlen_attention(device_type="cuda")
    packed_model, padded_model = _model(tiny, VARLEN_NAME), _model(tiny, "sdpa")  # same seed: same weights
    packed = _sft(packed_model, tokenizer_dir, tmp_path / "p", padding_free=True)
    padded = _sft(padded_model, tokenizer_dir, tmp_path / "u", padding_free=False)
    rows = [packed.train_dataset[i] for i in range(len(TEXTS))]
    packed_batch = packed.data_collator(rows)
    padded_batch = padded.data_collator([padded.train_dataset[i] for i in range(len(TEXTS))])
    assert packed_batch["input_ids"].shape[0] == 1 and "seq_idx" in packed_batch
    assert padded_batch["input_ids"].shape[0] == len(TEXTS)
    with torch.no_grad():
        packed_out = packed_model(**packed_batch)
        padded_out = padded_model(**padded_batch)
    assert torch.allclose(packed_out.loss, padded_out.loss, rtol=1e-5, atol=1e-6), (packed_out.loss, padded_out.loss)
    # Not vacuous: the same packed row without its boundaries lets GDN state flow from one example into the next.
    leaky = {k: v for k, v in packed_batch.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx",
                                                               "max_length_q", "max_length_k")}
    with torch.no_grad():
        leaky_logits = packed_model(**leaky).logits
    # measured 0.085; without a leak the same call gives the same logits (0): 1e-3 is 85x from the one
    assert (leaky_logits - packed_out.logits).abs().max() > 1e-3
