"""Small pieces of `kernelguard train`: config validation, LR schedule, FLOP accounting, checkpoint folders, the
optimizer step and eval on one rank."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kernelguard.errors import ConfigError
from kernelguard.train.output import checkpoint as ckpt
from kernelguard.train.output.metrics import forward_flops_per_token, peak_flops, step_flops
from kernelguard.train.settings.config import TrainConfig
from kernelguard.train.settings.config_cli import parse_args
from kernelguard.train.step.step import lr_lambda


def test_config_validation_names_the_fix(tmp_path: Path) -> None:
    base: dict[str, Any] = {"model": "m", "data": "d", "output_dir": tmp_path / "o"}
    cfg = TrainConfig.from_flags(**base)
    assert cfg.model.tokenizer == "m" and cfg.packing.max_length == 8192 and cfg.packing.overlong == "truncate"
    for bad, text in [
        ({"max_length": 0}, "max_length"),
        ({"gradient_accumulation_steps": -1}, "gradient_accumulation_steps"),
        ({"param_dtype": "int8"}, "param_dtype"),
        ({"overlong": "wrap"}, "overlong"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({"learning_rate": 0.0}, "learning_rate"),
    ]:
        with pytest.raises(ConfigError, match=text) as info:
            TrainConfig.from_flags(**base, **bad)
        assert info.value.fix
    with pytest.raises(TypeError):
        TrainConfig("m", "d", tmp_path)  # type: ignore[misc]  # keyword-only


def test_parse_args_allow_is_repeatable(tmp_path: Path) -> None:
    cfg = parse_args(
        [
            "--model",
            "m",
            "--data",
            "d",
            "--output-dir",
            str(tmp_path),
            "--allow",
            "attention",
            "--allow",
            "chunk_gated_delta_rule",
            "causal_conv1d_fn",
            "--param-dtype",
            "fp32",
        ]
    )
    assert cfg.runtime.allow == ("attention", "chunk_gated_delta_rule", "causal_conv1d_fn")
    assert cfg.runtime.param_dtype == "fp32"


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    f = lr_lambda(2, 10, 0.1)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0)
    assert f(10) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5)


def test_lr_scheduler_types_follow_hugging_face_names() -> None:
    linear = lr_lambda(2, 10, 0.1, "linear")
    assert [linear(0), linear(1), linear(2)] == [0.5, 1.0, 1.0]
    assert linear(6) == pytest.approx(0.1 + 0.9 * 0.5) and linear(10) == pytest.approx(0.1)
    assert linear(4) == pytest.approx(0.1 + 0.9 * 0.75)  # a straight line, not the cosine's 0.1 + 0.9 * 0.854
    with_warmup = lr_lambda(2, 10, 0.1, "constant_with_warmup")
    assert [with_warmup(0), with_warmup(1), with_warmup(9), with_warmup(50)] == [0.5, 1.0, 1.0, 1.0]
    assert {lr_lambda(0, 10, 0.1, "constant")(s) for s in range(20)} == {1.0}


def test_warmup_ratio_and_scheduler_type_flags(tmp_path: Path) -> None:
    import torch

    from kernelguard.train.model.build import make_optimizer
    from kernelguard.train.settings.config_cli import build_parser

    base = ["--model", "m", "--data", "d", "--output-dir", str(tmp_path / "o")]
    cfg = parse_args([*base, "--warmup-ratio", "0.25", "--lr-scheduler-type", "linear", "--logging-steps", "5"])
    assert (cfg.optimizer.warmup_ratio, cfg.optimizer.lr_scheduler_type) == (0.25, "linear")
    assert cfg.metrics.logging_steps == 5 and cfg.metrics.log_level == "info"
    model = torch.nn.Linear(2, 2)
    opt, sched = make_optimizer(model, optimizer=cfg.optimizer, device=torch.device("cpu"), schedule_steps=10)
    lrs = []
    for _ in range(5):
        lrs.append(sched.get_last_lr()[0] / cfg.optimizer.learning_rate)
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0 - 0.9 / 7])  # ceil(0.25 * 10) = 3 warmup steps
    for extra, text in [
        (["--warmup-ratio", "0.1", "--warmup-steps", "3"], "pass either --warmup-steps N or --warmup-ratio F"),
        (["--warmup-ratio", "1.5"], "warmup_ratio is 1.5; it must be in [0, 1)"),
        (["--lr-scheduler-type", "constant", "--warmup-steps", "3"], "constant_with_warmup"),
        (["--lr-scheduler-type", "polynomial"], "invalid choice: 'polynomial'"),
        (["--logging-steps", "-1"], "logging_steps is -1"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(text)):
            parse_args([*base, *extra])
    text = " ".join(build_parser().format_help().split())
    assert "the schedule is not changed" not in text
    assert "a value beyond the epochs' length stretches the schedule" in text


def test_step_flops_matches_the_documented_formula(tiny: Any) -> None:
    import torch

    config = tiny.tiny_config("qwen3_5")
    model = tiny.tiny_model("qwen3_5")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # GDN per token and layer: conv 2*(2*32 + 64)*4 = 1024; 4 value heads * (4*16*16 + 2*64*(16+16)) = 20480.
    gdn = 3 * (1024 + 20480)
    assert forward_flops_per_token(config) == 2 * linear + gdn
    # Full attention (1 layer, 4 heads, head dim 16), causal: 2*2*L^2*4*16/2 per example.
    lens = [100, 28]
    attn = sum(2 * 2 * n * n * 4 * 16 / 2 for n in lens)
    assert step_flops(config, lens) == pytest.approx(3 * (128 * (2 * linear + gdn) + attn))
    assert peak_flops("cpu") == 0.0


def test_moe_counts_only_active_experts(tiny: Any) -> None:
    dense = tiny.tiny_config("qwen3_5_moe", num_experts=4)
    more = tiny.tiny_config("qwen3_5_moe", num_experts=64)
    # 60 more experts add only router weights (hidden 64 x 60 per layer, 4 layers), not expert matmuls.
    assert forward_flops_per_token(more) - forward_flops_per_token(dense) == pytest.approx(2 * 4 * 64 * 60)


def test_incomplete_checkpoints_are_ignored_tmp_removed_and_unsealed_ones_said(tmp_path: Path) -> None:
    root = ckpt.checkpoint_root(tmp_path)
    for name, marker in [("step_2", True), ("step_4", True), ("step_6", False), ("step_8.tmp", True)]:
        (root / name).mkdir(parents=True)
        if marker:
            (root / name / ckpt.MARKER).write_text("done")
    (tmp_path / "final.tmp").mkdir()
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_4"
    removed = {p.name for p in ckpt.remove_incomplete(tmp_path)}
    assert removed == {"step_8.tmp", "final.tmp"}  # a step_N without marker is kept, and said at --resume
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4", "step_6"]
    (warning,) = ckpt.unsealed_warnings(tmp_path, root / "step_4")
    assert warning == ("checkpoint step_6 has no COMPLETE marker (deleted, or a partial copy): skipped, resuming "
                       "from step_4; it will be replaced when this run saves step 6 again: copy it away now to keep it")
    assert ckpt.unsealed_warnings(tmp_path, None)[0].startswith("checkpoint step_6 has no COMPLETE marker")
    assert ckpt.unsealed_warnings(tmp_path, root / "step_6") == []
    assert ckpt.latest_checkpoint(tmp_path / "nothing") is None


def test_accepted_fla_640_rows_lift_the_refusal_and_others_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from kernelguard.runtime.gate import lift_accepted_fla_refusal

    # An fla laid out like 0.6.0: the flag imported by value into the consumer module.
    names = ("fla", "fla.ops", "fla.ops.common", "fla.ops.common.chunk_o", "fla.utils")
    mods = {n: types.ModuleType(n) for n in names}
    mods["fla.ops.common.chunk_o"].TRITON_ABOVE_3_7_1 = False
    mods["fla.utils"].TRITON_ABOVE_3_7_1 = False
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)

    assert lift_accepted_fla_refusal({"kernels-version"}) == []
    assert mods["fla.ops.common.chunk_o"].TRITON_ABOVE_3_7_1 is False
    assert sorted(lift_accepted_fla_refusal({"fla-640-wrong-grads"})) == [
        "fla.ops.common.chunk_o",
        "fla.utils",
    ]
    assert mods["fla.ops.common.chunk_o"].TRITON_ABOVE_3_7_1 is True


def test_lifting_with_an_fla_that_has_no_refusal_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from kernelguard.runtime.gate import lift_accepted_fla_refusal

    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))  # a package without fla.ops.common
    for name in [n for n in sys.modules if n.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    assert lift_accepted_fla_refusal({"fla-640-refusal"}) == []


# ------------------------------------------------------------------------------- step and eval, one rank ---
@pytest.fixture
def one_rank() -> Any:
    """A one-process gloo group (the step and eval all-reduce), torn down after the test."""
    import torch
    import torch.distributed as dist

    from kernelguard.train.common.ranks import DistInfo

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistInfo(0, 1, 0, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _blocks(vocab: int, n: int, block: int = 48) -> tuple[list[Any], list[list[int]], list[dict[str, Any]]]:
    import torch

    from kernelguard.resolution.packed_batch import IGNORE_INDEX
    from kernelguard.train.step.packing import build_packed_block

    g = torch.Generator().manual_seed(1)
    examples = []
    for length in [9, 14, 6, 11, 17, 8][:n]:
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        examples.append((ids, [IGNORE_INDEX] * 3 + ids[3:]))
    groups = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]
    return examples, groups, [build_packed_block([examples[i] for i in grp], block, 0) for grp in groups]


def _hand_loss(model: Any, batches: list[dict[str, Any]]) -> tuple[float, int]:
    import torch
    import torch.nn.functional as F

    from kernelguard.resolution.packed_batch import IGNORE_INDEX, MODEL_INPUT_KEYWORDS

    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(**{k: b[k] for k in MODEL_INPUT_KEYWORDS}, use_cache=False).logits[0, :-1]
            labels = b["labels"][0, 1:]
            total += float(
                F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
            )
            count += int((labels != IGNORE_INDEX).sum())
    return total / count, count


@pytest.mark.parametrize("chunked", [False, True], ids=["logits", "chunked-head"])
def test_evaluate_is_the_token_mean_loss_over_every_eval_block(
    fake_providers: Any, tiny: Any, one_rank: Any, chunked: bool
) -> None:
    import copy

    from kernelguard.train.step.evaluate import evaluate
    from kernelguard.train.step.loss import return_hidden_states_from_head
    from kernelguard.train.step.step import TrainState

    model = tiny.tiny_model("qwen3_5").train()
    examples, groups, batches = _blocks(model.config.vocab_size, 5)
    expected, tokens = _hand_loss(model, batches)
    evaluated = copy.deepcopy(model)
    head = return_hidden_states_from_head(evaluated) if chunked else None
    state = TrainState(evaluated, optimizer=None, scheduler=None, info=one_rank, head=head)
    result = evaluate(state, examples, groups, max_length=48, pad_id=0)
    loss, count = result.loss, result.tokens
    assert count == tokens
    assert loss == pytest.approx(expected, rel=1e-5)
    assert evaluated.training  # back in train mode
    assert all(p.grad is None for p in evaluated.parameters())


def test_eval_blocks_are_dealt_so_every_rank_runs_the_same_number_of_forwards() -> None:
    from kernelguard.train.step.evaluate import rank_eval_blocks

    for n, world in [(5, 2), (7, 3), (2, 4), (6, 3), (0, 2)]:
        turns = [rank_eval_blocks(n, rank=r, world_size=world) for r in range(world)]
        assert len({len(t) for t in turns}) == 1
        real = sorted(b for t in turns for b in t if b is not None)
        assert real == list(range(n))


def test_step_normalises_by_the_global_label_count_for_any_batch_shape(
    fake_providers: Any, tiny: Any, one_rank: Any
) -> None:
    """A padded [B, T] batch (the bench's unpacked variant) gives the model's own mean loss; two packed
    micro-batches give the token mean over both, and gradients are those of that mean."""
    import copy

    import torch

    from kernelguard.train.model.build import make_optimizer
    from kernelguard.train.step.step import TrainState, forward_backward, optimizer_step

    model = tiny.tiny_model("qwen3_5").train()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    padded = {"input_ids": ids, "attention_mask": mask, "labels": labels, "_note": "not a model input"}
    loss_sum, count = forward_backward(model, [padded], info=one_rank)
    reference = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
    assert float(loss_sum) / float(count) == pytest.approx(float(reference.detach()), rel=1e-5)

    _, _, batches = _blocks(model.config.vocab_size, 4)
    expected, tokens = _hand_loss(model, batches)
    twin = copy.deepcopy(model)
    cfg = TrainConfig.from_flags(model="m", data="d", output_dir=Path("o"), learning_rate=1e-3, max_grad_norm=0.0)
    opt, sched = make_optimizer(twin, optimizer=cfg.optimizer, device=one_rank.device, schedule_steps=4)
    result = optimizer_step(TrainState(twin, opt, sched, one_rank, grad_clip=0.0), batches)
    assert result.loss_tokens == tokens and result.loss == pytest.approx(expected, rel=1e-5)
    assert result.lr == pytest.approx(1e-3) and result.grad_norm > 0
    assert all(p.grad is None for p in twin.parameters())  # zeroed for the next step
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_guard_refusal_is_a_picklable_kernel_fallback_error() -> None:
    import pickle

    from kernelguard.errors import GuardRefused, KernelFallbackError

    err = pickle.loads(pickle.dumps(GuardRefused("layer table\n\nchunk_gated_delta_rule is slow")))
    assert isinstance(err, KernelFallbackError)
    assert err.report == "layer table\n\nchunk_gated_delta_rule is slow" == str(err)


SETUP_TRAINING_SCRIPT = """
import sys
import torch.distributed as dist
import torch
import train_helpers as h
from pathlib import Path
from torch.distributed.fsdp import FSDPModule
from kernelguard.train.model.build import setup_training
from kernelguard.train.settings.config import TrainConfig
from kernelguard.train.step.packing import IGNORE_INDEX, build_packed_block
from kernelguard.train.model.parallel import init_distributed
from kernelguard.train.step.step import optimizer_step

tmp = Path(sys.argv[1])
cfg = TrainConfig.from_flags(model=str(h.write_model_config(tmp / "model")), data="unused", output_dir=tmp / "unused",
                  max_length=48, param_dtype="fp32", learning_rate=1e-2, allow=("attention",))
info = init_distributed()
built, state = setup_training(cfg, info, schedule_steps=4)
assert isinstance(state.model, FSDPModule) and state.head is not None and built.attention == "sdpa"
g = torch.Generator().manual_seed(1)
examples = [(ids, [IGNORE_INDEX] * 3 + ids[3:]) for ids in
            (torch.randint(3, h.VOCAB_SIZE, (n,), generator=g).tolist() for n in (9, 14, 6, 11))]
blocks = [build_packed_block(examples[:2], 48, 0), build_packed_block(examples[2:], 48, 0)]
losses = [optimizer_step(state, blocks).loss for _ in range(3)]
assert losses[2] < losses[0], losses
assert not (tmp / "unused").exists()
dist.destroy_process_group()
print("OK", losses)
"""


def test_setup_training_gives_the_benchmark_the_products_fsdp2_step(tmp_path: Path) -> None:
    """bench/gpu/train_throughput.py's entry point: model + AC + chunked head + FSDP2 + AdamW from a TrainConfig,
    then optimizer_step on already-built blocks (no data files, no output folder). In a fresh interpreter:
    transformers' auto classes remember modeling modules imported by earlier in-process tests."""
    import os
    import subprocess
    import sys

    import train_helpers as h

    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(h.REPO), str(h.FAKE_PROVIDERS), str(h.TESTS_DIR)])
    r = subprocess.run(
        [sys.executable, "-c", SETUP_TRAINING_SCRIPT, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr


def test_eval_sets_held_out_fraction_or_separate_file(tmp_path: Path) -> None:
    """--eval-fraction holds out the same rows on every call for a seed (and other rows for another seed),
    never trained on; --eval-data evaluates every row of its own file and trains on all of --data."""
    import train_helpers as h

    from kernelguard.train.inputs.data import read_inputs

    tok = h.write_tokenizer(tmp_path / "tok")
    data = h.write_jsonl(tmp_path / "d.jsonl", h.copy_task_rows(60))
    extra = h.write_jsonl(tmp_path / "e.jsonl", h.copy_task_rows(7, seed=5))

    def examples(take: str, **kw: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        cfg = TrainConfig.from_flags(model="m", tokenizer=str(tok), data=str(data), output_dir=tmp_path / "o",
                                     max_length=256, **kw)
        inputs = read_inputs(cfg)
        store = inputs.examples if take == "train" else inputs.eval_examples
        return [(tuple(ids), tuple(labels)) for ids, labels in store or []]

    train, held = examples("train", eval_fraction=0.25), examples("eval", eval_fraction=0.25)
    assert held == examples("eval", eval_fraction=0.25) and 5 <= len(held) <= 25
    assert sorted(train + held) == sorted(examples("train"))  # a partition of every row: none trained twice
    assert held != examples("eval", eval_fraction=0.25, seed=1)
    assert len(examples("eval", eval_data=str(extra))) == 7
    assert len(examples("train", eval_data=str(extra))) == 60


# ------------------------------------------------------------------ activation checkpointing and compile ---
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], None),  # auto
        (["--activation-checkpointing"], True),
        (["--gradient-checkpointing"], True),
        (["--activation-checkpointing", "auto"], None),
        (["--activation-checkpointing=off"], False),
        (["--activation_checkpointing", "on"], True),
        (["--no-activation-checkpointing"], False),
        (["--no_gradient_checkpointing"], False),
        (["--activation-checkpointing", "--compile"], True),  # alone (a flag follows): on
    ],
)
def test_activation_checkpointing_is_auto_unless_a_flag_says_otherwise(
    tmp_path: Path, flags: list[str], expected: bool | None
) -> None:
    cfg = parse_args(["--model", "m", "--data", "d", "--output-dir", str(tmp_path), *flags])
    assert cfg.runtime.activation_checkpointing is expected
    assert cfg.runtime.compile is (True if "--compile" in flags else None)  # None: auto


def test_activation_checkpointing_values_and_errors(tmp_path: Path) -> None:
    from kernelguard.train.settings.config_cli import parse_command

    base = {"model": "m", "data": "d", "output_dir": tmp_path / "o"}
    assert TrainConfig.from_flags(**base, activation_checkpointing="auto").runtime.activation_checkpointing is None
    assert TrainConfig.from_flags(**base, activation_checkpointing="Off").runtime.activation_checkpointing is False
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_flags(**base, activation_checkpointing="sometimes")
    assert str(err.value) == (
        "activation_checkpointing is 'sometimes'; expected auto (the default), on or off.\n"
        "Fix: --activation-checkpointing auto"
    )
    assert TrainConfig.from_flags(**base, compile="off").runtime.compile is False
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_flags(**base, compile="sometimes")
    assert str(err.value) == "compile is 'sometimes'; expected auto (the default), on or off.\nFix: --compile auto"
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_flags(**base, compile=3)
    assert "compile is 3 (int); expected true or false" in str(err.value)
    argv = ["--model", "m", "--data", "d", "--output-dir", str(tmp_path)]
    with pytest.raises(ConfigError, match="--activation-checkpointing is 'maybe'; expected auto \\(the default\\), on or off"):
        parse_command([*argv, "--activation-checkpointing", "maybe"])
    with pytest.raises(ConfigError, match="--no-activation-checkpointing takes no value \\(got 'auto'\\)"):
        parse_command([*argv, "--no-activation-checkpointing", "auto"])


def test_saved_config_keeps_auto_and_compile_and_a_config_file_sets_them(tmp_path: Path) -> None:
    """train_config.json writes auto as null (a --config file's "unset"), so repeating the run decides again on
    its own GPU; true/false in a file are the explicit overrides."""
    import json

    from kernelguard.train.settings.config import config_dict, save_config
    from kernelguard.train.settings.config_cli import parse_command

    argv = ["--model", "m", "--data", "d", "--output-dir", str(tmp_path / "o")]
    cfg = parse_command([*argv, "--compile"]).config
    assert config_dict(cfg)["activation_checkpointing"] is None and config_dict(cfg)["compile"] is True
    again = parse_command(["--config", str(save_config(cfg, tmp_path / "saved.json"))]).config
    assert again.runtime.activation_checkpointing is None and again.runtime.compile is True
    for value, expected in [(False, False), (True, True), (None, None)]:
        file = tmp_path / "c.json"
        file.write_text(json.dumps({"gradient_checkpointing": value, "compile": False}))
        cfg = parse_command([*argv, "--config", str(file)]).config
        assert cfg.runtime.activation_checkpointing is expected and cfg.runtime.compile is False
    cfg = parse_command([*argv, "--config", str(file), "--no-activation-checkpointing"]).config
    assert cfg.runtime.activation_checkpointing is False  # the command line wins


def test_checkpointing_switch_reads_auto_on_off_from_a_config_file_value() -> None:
    from kernelguard.train.settings.config_cli import _CheckpointingSwitch

    read = _CheckpointingSwitch(["--activation-checkpointing"], "activation_checkpointing").from_file
    assert [read(v, where="f.yaml: x") for v in (None, True, False, "auto", "on", "off")] == [
        None, True, False, None, True, False,
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="f.yaml: x is 1 \\(int\\); expected auto, on, off, true or false"):
        read(1, where="f.yaml: x")
    with pytest.raises(ConfigError, match="f.yaml: x is 'never'; expected auto \\(the default\\), on or off"):
        read("never", where="f.yaml: x")


def test_run_identity_ignores_activation_checkpointing_and_compile(tmp_path: Path) -> None:
    """Neither changes the results, so a run may resume with either switched."""
    import train_helpers as h

    from kernelguard.train.inputs.identity import HARMLESS_KEY, differences, harmless_changes, run_identity
    from kernelguard.train.model.parallel import model_source

    model = h.write_model_config(tmp_path / "model")
    base = {
        "model": str(model),
        "tokenizer": str(h.write_tokenizer(tmp_path / "tok")),
        "data": str(h.write_jsonl(tmp_path / "d.jsonl", h.copy_task_rows(3))),
        "output_dir": tmp_path / "o",
    }
    config, _ = model_source(str(model))
    identities = [
        run_identity(TrainConfig.from_flags(**base, **kw), world_size=1, model_config=config)  # type: ignore[arg-type]
        for kw in (
            {},
            {"activation_checkpointing": True},
            {"activation_checkpointing": False},
            {"compile": True},
        )
    ]
    # activation checkpointing is not recorded; compile is, as a harmless change a resume names in one line
    numbers = [{k: v for k, v in i.items() if k != HARMLESS_KEY} for i in identities]
    assert all(n == numbers[0] for n in numbers)
    assert identities[1] == identities[0] == identities[2]
    assert not differences(identities[0], identities[3]) and len(harmless_changes(identities[0], identities[3])) == 1


def _cuda_info() -> Any:
    import torch

    from kernelguard.train.common.ranks import DistInfo

    return DistInfo(0, 1, 0, torch.device("cuda", 0))  # a device object only: nothing is allocated on it


def test_auto_step_layout_takes_the_fastest_layout_the_estimate_fits_and_flags_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto on a GPU: no checkpointing with both blocks in one row and the weights kept gathered when it fits;
    then the weights freed after each forward; then one block per forward; then checkpointing; the least memory
    when nothing fits. Flags are never second-guessed; CPU runs keep the checkpointed, resharded path; a failing
    estimate means the safe layout."""
    import types

    import torch
    import train_helpers as h

    from kernelguard.train.model import memory
    from kernelguard.train.model.build import resolve_step_layout
    from kernelguard.train.model.memory import Layout

    cfg = TrainConfig.from_flags(
        model=str(h.write_model_config(tmp_path / "m")), data="d", output_dir=tmp_path / "o", max_length=256
    )
    assert cfg.training.gradient_accumulation_steps == 2  # the default: two blocks per step
    card = types.SimpleNamespace(total_memory=141 * 10**9, name="Fake H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: card)
    order = [(ac, n, r) for ac in (False, True) for n in (2, 1) for r in (False, True)]  # fastest first
    peaks = {
        (ac, n, r): memory.estimate(
            TrainConfig.from_flags(**{**_fields(cfg), "activation_checkpointing": ac, "blocks_per_forward": n,
                                      "reshard_after_forward": r}),
            world_size=1, gpu_bytes=10**12,
        ).peak_bytes
        for ac, n, r in order
    }  # fmt: skip
    # More blocks per row, no checkpointing and gathered weights cost memory; the last layout costs the least.
    assert peaks[False, 2, True] > peaks[False, 1, True] > peaks[True, 1, True]
    assert all(peaks[ac, n, False] > peaks[ac, n, True] for ac, n, _ in order)
    assert min(peaks.values()) == peaks[True, 1, True] and max(peaks.values()) == peaks[False, 2, False]
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    layout = resolve_step_layout(cfg, _cuda_info())
    assert (layout.activation_checkpointing, layout.blocks_per_forward, layout.reshard_after_forward) == (False, 2, False)
    assert layout.compile
    assert layout.line == (
        "step: activation checkpointing off, 2 blocks (512 tokens) per forward, weights kept gathered, compile on "
        f"(auto: estimated peak {gib(peaks[False, 2, False])} fits 92% of 131.32 GiB on Fake H200; compile: auto: a "
        "GPU run)"
    )
    for key in order[1:]:
        card.total_memory = int(peaks[key] / 0.92) + 2  # just fits this layout, and none needing more
        layout = resolve_step_layout(cfg, _cuda_info())
        fitting = [k for k in order if peaks[k] <= peaks[key]]
        assert (layout.activation_checkpointing, layout.blocks_per_forward, layout.reshard_after_forward) == fitting[0]
        assert ("activation checkpointing off, 2 blocks (512 tokens) per forward, weights kept gathered would need "
                f"{gib(peaks[False, 2, False])}") in layout.line
    card.total_memory = int(peaks[True, 1, True] / 0.92) - 1  # nothing fits: refused before anything is loaded
    with pytest.raises(ConfigError) as refused:
        resolve_step_layout(cfg, _cuda_info())
    total = f"{card.total_memory / 2**30:.2f} GiB"
    assert refused.value.message == (
        "the training step does not fit this GPU: its least-memory layout (activation checkpointing on, 1 block "
        f"(256 tokens) per forward) is estimated at {gib(peaks[True, 1, True])} per rank over 1 rank(s), reached in "
        f"the backward (gradients + one recomputed layer + its gradient reduction); the budget is 92% of {total} on "
        f"Fake H200 ({gib(0.92 * card.total_memory)}). Nothing was loaded. 2 GPUs in all would fit it "
        "(docs/multi-node.md); a smaller --max-length needs less activation memory (--dry-run shows every term). "
        "To try this layout anyway, give it: --activation-checkpointing --blocks-per-forward 1 "
        "--reshard-after-forward."
    )
    assert refused.value.fix == "kernelguard train --nproc-per-node 2 ..."
    given = TrainConfig.from_flags(**{**_fields(cfg), "activation_checkpointing": True, "blocks_per_forward": 1,
                                      "reshard_after_forward": True})
    assert resolve_step_layout(given, _cuda_info()).activation_checkpointing  # the way out it names runs
    # Flags win: all three given, no estimate is consulted; some given, auto chooses only the others.
    card.total_memory = 141 * 10**9
    explicit = TrainConfig.from_flags(
        **{**_fields(cfg), "activation_checkpointing": True, "blocks_per_forward": 1, "compile": False,
           "reshard_after_forward": False}
    )
    assert resolve_step_layout(explicit, _cuda_info()).line == (
        "step: activation checkpointing on, 1 block (256 tokens) per forward, weights kept gathered, compile off "
        "(--activation-checkpointing; --blocks-per-forward 1; --no-reshard-after-forward; compile: --no-compile)"
    )
    half = TrainConfig.from_flags(**{**_fields(cfg), "activation_checkpointing": True})
    layout = resolve_step_layout(half, _cuda_info())
    assert (layout.activation_checkpointing, layout.blocks_per_forward, layout.reshard_after_forward) == (True, 2, False)
    assert layout.line.endswith(
        f"(--activation-checkpointing; auto: estimated peak {gib(peaks[True, 2, False])} fits 92% of 131.32 GiB on "
        "Fake H200; compile: auto: a GPU run)"
    )
    cpu = resolve_step_layout(cfg, _cuda_info().__class__(0, 1, 0, torch.device("cpu")))
    assert cpu.line == (
        "step: activation checkpointing on, 2 blocks (512 tokens) per forward, compile off "
        "(auto: a cpu run has no GPU memory to budget; compile: auto: a cpu run)"
    )
    assert cpu.reshard_after_forward

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(memory, "choose_layout", broken)
    failed = resolve_step_layout(cfg, _cuda_info())
    assert (failed.activation_checkpointing, failed.blocks_per_forward, failed.reshard_after_forward) == (True, 1, True)
    assert failed.line.endswith("(auto: the memory estimate failed: probe exploded; compile: auto: a GPU run)")
    assert Layout(True, 1).describe(8192) == "activation checkpointing on, 1 block (8,192 tokens) per forward"


def _fields(cfg: TrainConfig) -> dict[str, Any]:
    return cfg.flags()


def test_blocks_left_out_to_even_the_ranks_are_reported() -> None:
    from kernelguard.train.step.plan import dropped_blocks_note, make_plan

    plan = make_plan([[i] for i in range(11)], world_size=2, grad_accum=2, epochs=1, max_steps=None,
                     schedule_steps=None, max_length=8)
    assert dropped_blocks_note(plan, world_size=2, grad_accum=2) == (
        "3 of 11 packed blocks are left out of each epoch to even the ranks (2 rank(s) x 2 micro-batch(es) x 2 "
        "steps); the blocks are reshuffled every epoch, so a different set is left out each time"
    )
    even = make_plan([[i] for i in range(8)], world_size=2, grad_accum=2, epochs=1, max_steps=None,
                     schedule_steps=None, max_length=8)
    assert dropped_blocks_note(even, world_size=2, grad_accum=2) is None
