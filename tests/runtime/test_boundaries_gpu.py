"""Packed rows without GDN boundaries on CUDA with the REAL fla and causal-conv1d (the H200 run; skipped elsewhere).

The four cases of tests/runtime/test_boundaries.py, in one fresh interpreter (``import fla`` takes most of a minute on
first use): transformers' flattening collator with its defaults (refused) and with both flags (passes, and each
example's logits match the example run alone), TRL's padding-free batch without ``seq_idx`` (refused), a padded
batch and a single-sequence row (pass). Forward only, under no_grad: fla 0.6.0's Hopper refusal is a backward one,
so no allow item is needed to lift it. Small shapes; bounded by the subprocess timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("fla") is None or importlib.util.find_spec("causal_conv1d") is None,
        reason="needs the real fla and causal-conv1d installed",
    ),
]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch
    import kernelguard
    from kernelguard.errors import PackedWithoutBoundariesError
    from tiny_models import tiny_model
    from transformers import DataCollatorWithFlattening

    features = [{{"input_ids": list(range(3, 3 + n))}} for n in (40, 24, 32)]
    labelled = [{{**f, "labels": f["input_ids"]}} for f in features]
    model = tiny_model("qwen3_5", linear_key_head_dim=64, linear_value_head_dim=64).to("cuda", torch.bfloat16)
    report = kernelguard.guard(model, packed=True, allow=["attention"])
    print(report.render(), file=sys.stderr)
    try:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    except ImportError:  # the GPU machine may lack TRL: the same batches, built as TRL builds them
        DataCollatorForLanguageModeling = None
    lengths = [len(f["input_ids"]) for f in features]
    if DataCollatorForLanguageModeling is not None:
        trl_batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(features)
        del trl_batch["seq_idx"]
        padded = DataCollatorForLanguageModeling(pad_token_id=0)(features)
    else:
        cu = torch.tensor([0, 40, 64, 96], dtype=torch.int32)
        trl_batch = {{"input_ids": torch.tensor([[t for f in features for t in f["input_ids"]]]),
                     "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
                     "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 40, "max_length_k": 40}}
        ids = torch.zeros(3, 40, dtype=torch.long)
        mask = torch.zeros(3, 40, dtype=torch.long)
        for i, f in enumerate(features):
            ids[i, :lengths[i]] = torch.tensor(f["input_ids"])
            mask[i, :lengths[i]] = 1
        padded = {{"input_ids": ids, "attention_mask": mask}}
    cases = {{
        "flattening_defaults": DataCollatorWithFlattening()(labelled),
        "flattening_both_flags": DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(labelled),
        "trl_padding_free_without_seq_idx": trl_batch,
        "padded": padded,
        "single_row": {{"input_ids": torch.tensor([features[0]["input_ids"]]), "position_ids": torch.arange(40)[None]}},
    }}
    out = {{}}
    for name, batch in cases.items():
        batch = {{k: v.to("cuda") if hasattr(v, "to") else v for k, v in batch.items()}}
        try:
            with torch.no_grad():
                logits = model(**batch).logits.float()
        except PackedWithoutBoundariesError as e:
            out[name] = {{"refused": e.message, "fix": e.fix, "examples": e.examples}}
            continue
        result = {{"refused": None}}
        if name == "flattening_both_flags":  # each example as if alone
            with torch.no_grad():
                alone = [model(input_ids=torch.tensor([f["input_ids"]], device="cuda")).logits.float()
                         for f in features]
                result["max_abs_diff"] = max(
                    (logits[0, s:s + a.shape[1]] - a[0]).abs().max().item()
                    for s, a in zip((0, 40, 64), alone))
        out[name] = result
    print("RESULT " + json.dumps(out))
    """
)
LEAK = ("recurrent and conv state would carry from each example into the next. The results are wrong, not only "
        "slow, and nothing else raises.")
BOTH = ("its gated-delta kernels get no `cu_seqlens` (the batch has no `cu_seq_lens_q`) and its conv gets no "
        "`seq_idx` (the batch has no `seq_idx`)")


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    code = SCRIPT.format(tests=str(REPO / "tests"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=420,
                          check=False)
    print(proc.stdout[-3000:], proc.stderr[-4000:], sep="\n")
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line is not None, proc.stderr[-4000:]
    return dict(json.loads(line[len("RESULT "):]))


def _message(source: str, gets: str) -> str:
    return (f"kernelguard: model.layers.0.linear_attn (and 2 more GDN layers) got a packed row of 3 examples (by its "
            f"{source}) but {gets}: {LEAK}")


def test_real_kernels_flattening_defaults_refused(results: dict[str, Any]) -> None:
    assert results["flattening_defaults"]["refused"] == _message("position_ids", BOTH)


def test_real_kernels_flattening_with_both_flags_passes_and_keeps_examples_apart(results: dict[str, Any]) -> None:
    case = results["flattening_both_flags"]
    assert case["refused"] is None
    assert case["max_abs_diff"] < 0.1  # bf16 logits of a random tiny model; a leak moves them by ~1


def test_real_kernels_trl_padding_free_without_seq_idx_refused(results: dict[str, Any]) -> None:
    conv = "its conv gets no `seq_idx` (the batch has no `seq_idx`)"
    assert results["trl_padding_free_without_seq_idx"]["refused"] == _message("cu_seq_lens_q", conv)


def test_real_kernels_padded_batch_and_single_row_pass(results: dict[str, Any]) -> None:
    assert results["padded"] == {"refused": None}
    assert results["single_row"] == {"refused": None}
