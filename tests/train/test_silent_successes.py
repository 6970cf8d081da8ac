"""Inputs that used to succeed silently, or fail with a traceback, and now refuse with a clear cause.

Unit-level (no training run): the weights decision, the non-finite step, data files and splits, config
files, resume plans, guard/check argument handling and the pytest marker.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kernelguard.errors import CheckpointError, ConfigError, DataError

# --------------------------------------------------------------------------------- weights: no random init ---


def _folder(tmp_path: Path, tiny: Any, *files: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    tiny.tiny_config("qwen3_5").to_json_file(str(folder / "config.json"))
    for name in files:
        (folder / name).write_bytes(b"x")
    return folder


def test_a_folder_with_only_config_json_is_refused_unless_random_is_asked_for(tmp_path: Path, tiny: Any) -> None:
    from kernelguard.train.model.weight_files import weights_to_load

    folder = _folder(tmp_path, tiny)
    with pytest.raises(ConfigError, match="no weights transformers can load") as e:
        weights_to_load(str(folder), init=None)
    assert "--init random" in (e.value.fix or "")
    weights, notice = weights_to_load(str(folder), init="random")
    assert weights is None and "--init random" in (notice or "")


def test_sharded_bin_weights_are_loaded_not_ignored(tmp_path: Path, tiny: Any) -> None:
    from kernelguard.train.model.weight_files import weight_format, weights_to_load

    folder = _folder(tmp_path, tiny, "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin")
    index = {"weight_map": {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    assert weight_format(folder) == ("bin", [])
    assert weights_to_load(str(folder), init=None) == (folder, None)


def test_an_index_naming_missing_shards_or_unindexed_shards_are_refused(tmp_path: Path, tiny: Any) -> None:
    from kernelguard.train.model.weight_files import weights_to_load

    folder = _folder(tmp_path, tiny, "model-00001-of-00002.safetensors")
    with pytest.raises(ConfigError, match="model-00001-of-00002.safetensors"):
        weights_to_load(str(folder), init=None)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ConfigError, match="gone.safetensors"):
        weights_to_load(str(folder), init=None)


def test_a_config_file_means_random_init_and_pretrained_is_refused(tmp_path: Path, tiny: Any) -> None:
    from kernelguard.train.model.weight_files import weights_to_load

    config = _folder(tmp_path, tiny) / "config.json"
    weights, notice = weights_to_load(str(config), init=None)
    assert weights is None and "random init" in (notice or "")
    with pytest.raises(ConfigError, match="--init pretrained"):
        weights_to_load(str(config), init="pretrained")


def test_config_json_that_no_longer_matches_its_weights_is_refused_before_writing(tmp_path: Path, tiny: Any) -> None:
    # The one header check (kernelguard.train.model.weights.plan_weights), which build_model runs before any write.
    from kernelguard.errors import CheckpointError
    from kernelguard.train.model.weights import plan_weights

    model = tiny.tiny_model("qwen3_5")
    folder = tmp_path / "saved"
    model.save_pretrained(str(folder))
    assert plan_weights(model, folder)[0] is not None  # as saved: a sharded load plan
    wider = tiny.tiny_model("qwen3_5", intermediate_size=96)
    with pytest.raises(CheckpointError, match="the config builds"):
        plan_weights(wider, folder)


@pytest.mark.parametrize(
    ("body", "says"),
    [("{not json", "not valid JSON"), ('{"model_type": "qwen99"}', "upgrade transformers"), ("[1]", "no model_type")],
)
def test_a_bad_config_json_in_a_model_folder_is_a_config_error(tmp_path: Path, body: str, says: str) -> None:
    from kernelguard.train.model.parallel import model_source

    (tmp_path / "config.json").write_text(body)
    with pytest.raises(ConfigError) as e:
        model_source(str(tmp_path))
    assert says in str(e.value)


# ------------------------------------------------------------------------------------- NaN: stop, keep good ---
def test_a_non_finite_step_is_not_applied(one_rank_group: Any) -> None:
    import torch

    from kernelguard.train.step.step import TrainState, optimizer_step

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 8)

        def forward(self, input_ids: Any, **_: Any) -> Any:
            out = self.emb(input_ids) * float("inf")
            return type("Out", (), {"logits": out})()

    # The product's fused AdamW skips on the device (found_inf); a plain one is skipped by the host.
    for fused in (True, False):
        model = Tiny()
        before = model.emb.weight.detach().clone()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
        result = optimizer_step(TrainState(model, opt, sched, one_rank_group), [batch])
        assert not result.finite
        assert torch.equal(model.emb.weight, before), fused  # skipped: weights stay the last good ones
        assert sched.last_epoch == 0 and not hasattr(opt, "found_inf")
        assert all(float(st["step"]) == 0 for st in opt.state.values()), fused  # AdamW's count not advanced
        model.emb.weight.data.copy_(before)
        model.forward = lambda input_ids, **_: type("Out", (), {"logits": model.emb(input_ids)})()  # finite
        result = optimizer_step(TrainState(model, opt, sched, one_rank_group), [batch])
        assert result.finite and sched.last_epoch == 1
        assert not torch.equal(model.emb.weight, before), fused  # a finite step is applied


@pytest.fixture
def one_rank_group() -> Any:
    import torch
    import torch.distributed as dist

    from kernelguard.train.common.ranks import DistInfo

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistInfo(0, 1, 0, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_the_divergence_error_names_the_step_the_value_and_the_fix(tmp_path: Path) -> None:
    from kernelguard.errors import EXIT_DIVERGED
    from kernelguard.train.output.checkpoint import diverged
    from kernelguard.train.settings.config_cli import parse_args
    from kernelguard.train.step.step import StepResult

    cfg = parse_args(["--model", "m", "--data", "d.jsonl", "--output-dir", str(tmp_path), "--learning-rate", "1e6"])
    error = diverged(cfg, 3, StepResult(float("nan"), 10, float("inf"), 1e6, finite=False))
    assert "step 3" in error.message and "loss is nan" in error.message and "no checkpoint" in error.message
    assert "--learning-rate (now 1e+06)" in (error.fix or "")
    assert EXIT_DIVERGED == 4


# ------------------------------------------------------------------------------------------- data and files ---
def _rows(path: Path, n: int = 3) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(n)))
    return path


def test_split_picks_a_folders_split_files_and_never_trains_on_test(tmp_path: Path) -> None:
    from kernelguard.train.inputs.sources import resolve_files

    train, test = _rows(tmp_path / "d" / "train.jsonl"), _rows(tmp_path / "d" / "test.jsonl")
    _rows(tmp_path / "d" / ".ipynb_checkpoints" / "train-checkpoint.jsonl")
    (tmp_path / "d" / "dataset_info.json").write_text("{}")
    assert resolve_files(str(tmp_path / "d")) == [train]
    assert resolve_files(str(tmp_path / "d"), split="test") == [test]
    with pytest.raises(ConfigError, match="none for validation"):
        resolve_files(str(tmp_path / "d"), split="validation")
    with pytest.raises(ConfigError, match="has no splits"):
        resolve_files(str(train), split="test")


def test_gzip_data_is_read_when_named_gz_and_named_when_it_is_not(tmp_path: Path) -> None:
    from collections import Counter

    from kernelguard.train.inputs.sources import iter_rows

    text = _rows(tmp_path / "plain.jsonl").read_bytes()
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(text))
    (tmp_path / "rows.jsonl").write_bytes(gzip.compress(text))
    rows = list(iter_rows(str(tmp_path / "rows.jsonl.gz"), skipped=Counter(), skip_bad=False))
    assert len(rows) == 3
    with pytest.raises(DataError, match="gzip-compressed") as e:
        list(iter_rows(str(tmp_path / "rows.jsonl"), skipped=Counter(), skip_bad=False))
    assert ".jsonl.gz" in (e.value.fix or "")


def test_eval_data_that_is_the_training_data_is_refused(tmp_path: Path) -> None:
    from kernelguard.train.inputs.data import ExampleStore, check_eval_overlap
    from kernelguard.train.settings.config_cli import parse_args
    from kernelguard.train.startup.preflight import check_inputs

    data = _rows(tmp_path / "d.jsonl")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    cfg = parse_args(["--model", "m", "--tokenizer", str(tmp_path / "tok"), "--data", str(data),
                      "--eval-data", str(data), "--output-dir", str(tmp_path / "o")])
    with pytest.raises(ConfigError, match="is training data too"):
        check_inputs(cfg)
    train, same, half = ExampleStore(), ExampleStore(), ExampleStore()
    for ids in ([1, 2], [3, 4]):
        train.append(ids, ids)
        same.append(ids, ids)
    half.append([1, 2], [1, 2])
    half.append([5, 6], [5, 6])
    with pytest.raises(DataError, match="every one of the 2 eval examples"):
        check_eval_overlap(train, same, source="x")
    assert "1 of 2 eval examples" in (check_eval_overlap(train, half, source="x") or "")


def test_a_flag_overriding_a_config_file_value_says_so(tmp_path: Path) -> None:
    from kernelguard.train.settings.config_cli import parse_command

    file = tmp_path / "c.yaml"
    file.write_text("learning_rate: 1e-5\nmax_steps: 10\n")
    cmd = parse_command(["--config", str(file), "--model", "m", "--data", "d.jsonl", "--output-dir", "o",
                         "--learning-rate", "1e-4", "--max-steps", "10"])
    assert cmd.config.optimizer.learning_rate == 1e-4
    assert [w for w in cmd.warnings if "learning-rate" in w and "overrides" in w]
    assert not [w for w in cmd.warnings if "max-steps" in w]  # the same value: nothing overridden


# --------------------------------------------------------------------------------------------------- resume ---
def test_resume_with_max_steps_at_or_below_the_checkpoint_is_refused(tmp_path: Path, monkeypatch: Any) -> None:
    from kernelguard.train.loop import check_resume_plan
    from kernelguard.train.output import checkpoint as ckpt
    from kernelguard.train.settings.config_cli import parse_args
    from kernelguard.train.startup.preflight import StartPlan
    from kernelguard.train.step.plan import Plan

    cfg = parse_args(["--model", "m", "--data", "d.jsonl", "--output-dir", str(tmp_path), "--resume",
                      "--max-steps", "2"])
    monkeypatch.setattr(ckpt, "read_trainer_state", lambda _: {"step": 4, "num_blocks": 8, "schedule_steps": 2})
    plan = Plan([[0]] * 8, 4, 4, 2, 2)
    with pytest.raises(CheckpointError, match="nothing left to train"):
        check_resume_plan(cfg, StartPlan({}, tmp_path / "checkpoints" / "step-4"), plan)


# -------------------------------------------------------------------------------------- guard, check, plugin ---
def test_guard_packed_must_be_a_bool(tiny: Any) -> None:
    import kernelguard

    with pytest.raises(ConfigError, match="packed must be True or False"):
        kernelguard.guard(tiny.tiny_model("qwen3_5"), packed="no", strict=False)  # type: ignore[arg-type]


def test_check_requires_no_gdn_kernels_when_every_layer_is_full_attention() -> None:
    from kernelguard.resolution.catalog import has_linear_layers

    assert not has_linear_layers({"model_type": "qwen3_5_text", "layer_types": ["full_attention"] * 2})
    assert has_linear_layers({"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"]})
    assert has_linear_layers({"model_type": "qwen3_5_text"})  # the config class's default pattern has them


def test_ctrl_c_in_check_is_one_line_and_exit_130(monkeypatch: Any, capsys: Any) -> None:
    from kernelguard import cli
    from kernelguard.cli import check as check_command

    def interrupted(_: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(check_command, "_check", interrupted)
    assert cli.main(["check"]) == 130
    assert capsys.readouterr().err.strip() == "kernelguard: interrupted."


def test_a_marker_keyword_typo_is_a_usage_error() -> None:
    from types import SimpleNamespace

    from kernelguard.integrations import pytest_plugin

    settings = SimpleNamespace(enabled=True, policy=None)
    marker = pytest.mark.kernelguard(alow=["attention"]).mark
    item = SimpleNamespace(
        config=SimpleNamespace(stash={pytest_plugin.settings_key: settings}), get_closest_marker=lambda _: marker
    )
    with pytest.raises(pytest.fail.Exception, match=r"unknown keyword\(s\) alow.*keywords: allow, enabled, skip_ok"):
        pytest_plugin._item_settings(item)  # type: ignore[arg-type]


def test_a_marker_allow_value_typo_is_a_usage_error_without_kernelguards_traceback() -> None:
    from types import SimpleNamespace

    from kernelguard.integrations import pytest_plugin

    settings = SimpleNamespace(marker_policies={})
    with pytest.raises(pytest.fail.Exception) as info:
        pytest_plugin._marker_policy(settings, ("causal_conv1d",))  # type: ignore[arg-type]
    said = str(info.value)
    assert said.startswith("usage error: @pytest.mark.kernelguard(allow=...): 'causal_conv1d' is not a known")
    assert "did you mean causal_conv1d_fn or causal_conv1d_update?" in said
    assert info.value.pytrace is False and info.value.__context__ is None  # no chained kernelguard traceback


@pytest.mark.parametrize(("command", "line"), [
    (["check"], "kernelguard: interrupted."),
    (["export", "run/checkpoints/step_1", "--output", "out"],
     ("kernelguard export: loading torch and transformers to export run/checkpoints/step_1\n"
      "kernelguard export: interrupted; nothing was written.")),
], ids=["check", "export"])
def test_ctrl_c_while_torch_imports_numpy_still_stops_the_command(command: list[str], line: str,
                                                                   tmp_path: Path) -> None:
    """torch clears whatever its own import of numpy raises, a KeyboardInterrupt included: check went on and
    printed its report, export went on to its own checks, when Ctrl-C landed there."""
    repo = Path(__file__).resolve().parents[2]
    if command[0] == "export":  # a sealed step: export gets past its refusals to torch's import
        sealed = tmp_path / "run" / "checkpoints" / "step_1"
        sealed.mkdir(parents=True)
        (sealed / "COMPLETE").write_text("")
    env = dict(os.environ, KERNELGUARD_FAULT="ctrl-c-in-torch-numpy-import", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(repo / "tests" / "fault_hooks"), str(repo)]))
    proc = subprocess.run([sys.executable, "-m", "kernelguard", *command], env=env, capture_output=True, text=True,
                          timeout=300, check=False, cwd=tmp_path,
                          # a suite started in the background ignores SIGINT, and children inherit that: give the
                          # command the default, as a terminal's foreground job has
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (proc.returncode, proc.stderr.strip(), proc.stdout) == (130, line, ""), proc.stderr
    assert [p for p in tmp_path.iterdir() if p.name != "run"] == []
