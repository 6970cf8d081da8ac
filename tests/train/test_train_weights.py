"""Sharded HF weights in and out (kernelguard.train.model.weights, kernelguard.train.output.export): a checkpoint in 3+
shards loads on 1 and 2 ranks bit-identical to ``from_pretrained``; the export loads back with identical logits;
a checkpoint that does not fit its config is refused before training naming the tensor; the multimodal
Qwen3.5 layout trains its text model and exports a folder its own class loads, vision weights unchanged; and
``kernelguard export`` of a checkpoint writes the same bytes as the run's own export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import train_helpers as h
from safetensors import safe_open
from safetensors.torch import load_file

from kernelguard.errors import CheckpointError, ConfigError
from kernelguard.train.model.weights import plan_weights, read_layout
from kernelguard.train.output.export import OutTensor, plan_shards, shard_names, write_safetensors
from kernelguard.train.settings.config import TrainConfig
from kernelguard.train.settings.config_rules import parse_size

SHARD = "60KB"  # the tiny model (~0.2 MB in bf16) is then 4+ files


def _text_model(**overrides: Any) -> Any:
    import tiny_models

    return tiny_models.tiny_model("qwen3_5", vocab_size=h.VOCAB_SIZE, pad_token_id=0, eos_token_id=2, **overrides)


def _save(model: Any, path: Path, shard: str = SHARD) -> Path:
    model.to(torch.bfloat16).save_pretrained(str(path), max_shard_size=shard)
    return path


def _meta(path: Path) -> Any:
    from kernelguard.train.model.parallel import build_meta_model, model_source

    config, _ = model_source(str(path))
    return build_meta_model(config, attn_implementation="sdpa")


def _folder_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(h.REPO), str(h.TESTS_DIR)]), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", TRANSFORMERS_VERBOSITY="error")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
           str(h.TESTS_DIR / "weights_worker.py"), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)


# --------------------------------------------------------------------------------- headers, no torch.dist ---
def test_layout_is_read_from_headers_of_every_shard(tmp_path: Path) -> None:
    src = _save(_text_model(), tmp_path / "src")
    layout = read_layout(src)
    assert layout is not None and not layout.multimodal
    assert len({e.file for e in layout.tensors.values()}) >= 3
    plan, note = plan_weights(_meta(src), src)
    assert note is None and plan is not None and plan.carried == () and not plan.tied
    assert plan.names["model.layers.0.mlp.up_proj.weight"] == "model.layers.0.mlp.up_proj.weight"


def test_a_checkpoint_that_does_not_fit_its_config_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    src = _save(_text_model(), tmp_path / "src")
    raw = json.loads((src / "config.json").read_text())
    raw["intermediate_size"] = 96
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as info:
        plan_weights(_meta(src), src)
    err = info.value
    assert isinstance(err, ConfigError)  # exit 2
    assert "model.layers.0.mlp.gate_proj.weight (model-0000" in err.message
    assert "the config builds [96, 64], the file has [128, 64]" in err.message
    assert err.fix and "config.json that was saved with these weights" in err.fix


def test_a_missing_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    src = _save(_text_model(), tmp_path / "src", shard="5GB")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.norm.weight"]
    from safetensors.torch import save_file

    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) of .* are built by the model config but in no file .*MISSING\):\n  model.norm.weight"):
        plan_weights(_meta(src), src)


def test_the_trainer_refuses_a_mismatched_checkpoint_before_training(tmp_path: Path) -> None:
    assets = h.write_train_assets(tmp_path, rows=40)
    src = _save(_text_model(), tmp_path / "src")
    raw = json.loads((src / "config.json").read_text())
    raw["hidden_size"] = 32
    (src / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    r = h.run_train(["--model", str(src), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
                     "--output-dir", str(out), "--max-steps", "1", "--max-length", "128"], nproc=0, timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "model.embed_tokens.weight (model-0000" in r.stderr and "nothing was loaded" in r.stderr
    assert not (out / "final").exists() and not (out / "checkpoints").exists()


def test_shards_are_planned_under_the_limit_and_named_like_save_pretrained() -> None:
    ts = [OutTensor(f"t{i}", (10, 10), torch.bfloat16, f"t{i}") for i in range(5)]  # 200 bytes each
    shards = plan_shards(ts, 450)
    assert [[t.name for t in s] for s in shards] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert plan_shards([OutTensor("big", (100,), torch.float32, "big")], 10)[0][0].name == "big"
    assert shard_names(1) == ["model.safetensors"]
    assert shard_names(3)[1] == "model-00002-of-00003.safetensors"
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(1000) == 1000
    with pytest.raises(ConfigError, match="expected a size such as 5GB"):
        parse_size("five gigs", source="--max-shard-size")


def test_max_shard_size_is_checked_with_the_config_before_training(tmp_path: Path) -> None:
    base = {"model": "m", "data": "d", "output_dir": tmp_path / "out"}
    assert TrainConfig.from_flags(**base).checkpoint.max_shard_size == "5GB"
    assert TrainConfig.from_flags(**base, max_shard_size=1000).checkpoint.max_shard_size == "1000"  # bytes
    with pytest.raises(ConfigError, match=r"max_shard_size is 'five gigs'; expected a size such as 5GB") as info:
        TrainConfig.from_flags(**base, max_shard_size="five gigs")
    assert info.value.fix == "--max-shard-size 5GB"


def test_streamed_safetensors_round_trip(tmp_path: Path) -> None:
    values = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64)}
    plan = [OutTensor(k, tuple(v.shape), v.dtype, k) for k, v in values.items()]
    write_safetensors(tmp_path / "x.safetensors", plan, lambda t: values[t.key])
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in values.items())
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


class _Collective:
    """A stand-in for the gathered source: every rank must ask for every trained tensor, in one order."""

    collective = True

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.values, self.asked, self.kept = values, [], []

    def __call__(self, t: OutTensor, keep: bool = True) -> torch.Tensor | None:
        self.asked.append(t.key)
        if keep:
            self.kept.append(t.key)
        return self.values[t.key] if keep else None


def _four_shards() -> tuple[list[OutTensor], dict[str, torch.Tensor]]:
    values = {f"t{i}": torch.full((10, 5 * (i + 1)), float(i)).to(torch.bfloat16) for i in range(6)}
    return [OutTensor(k, tuple(v.shape), v.dtype, k) for k, v in values.items()], values


def test_each_rank_writes_its_shards_and_takes_part_in_every_gather_in_one_order(tmp_path: Path) -> None:
    from kernelguard.train.output.export import write_shards

    tensors, values = _four_shards()  # 100, 200, ..., 600 bytes: shards [t0 t1] [t2] [t3] [t4] [t5] at 350
    orders = []
    for rank in (0, 1):
        source = _Collective(values)
        shards = write_shards(tmp_path, tensors, source, max_bytes=350, rank=rank, world=2, budget=1)
        assert [[t.key for t in s] for s in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4"], ["t5"]]
        orders.append(source.asked)
        mine = shard_names(5)[rank::2]
        assert source.kept == [t.key for i, s in enumerate(shards) if i % 2 == rank for t in s]
        for name in mine:
            assert all(torch.equal(v, values[k]) for k, v in load_file(str(tmp_path / name)).items())
    # The same order on both ranks (a collective), the ranks' streams interleaved by bytes written.
    assert orders[0] == orders[1] == ["t0", "t2", "t1", "t3", "t4", "t5"]


def test_a_failed_write_still_takes_part_in_every_gather_then_raises(tmp_path: Path, monkeypatch: Any) -> None:
    import errno

    from kernelguard.train.output import export
    def full_disk(path: Path, tensors: list[OutTensor], fetch: Any) -> None:
        fetch(tensors[0])
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(export, "write_safetensors", full_disk)
    tensors, values = _four_shards()
    source = _Collective(values)
    with pytest.raises(OSError, match="No space left on device"):
        export.write_shards(tmp_path, tensors, source, max_bytes=350, rank=0, world=2, budget=1)
    assert source.asked == ["t0", "t2", "t1", "t3", "t4", "t5"]  # no rank is left waiting in a gather


def test_parameters_computed_in_fp32_in_a_bf16_model_stay_fp32_in_the_export(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from kernelguard.train.output.export import export_tensors, held_in_fp32

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2)))
        fully_shard(model[1], mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        keep = held_in_fp32(model)
        assert keep == {"1.0.weight", "1.0.bias"}
        state = get_model_state_dict(model)
        out = export_tensors({k: tuple(v.shape) for k, v in state.items()}, plan=None, tied=False,
                             dtype=torch.bfloat16, keep_fp32=keep)
        assert {t.key: t.dtype for t in out} == {"0.weight": torch.bfloat16, "0.bias": torch.bfloat16,
                                                  "1.0.weight": torch.float32, "1.0.bias": torch.float32}
        one_dtype = fully_shard(torch.nn.Linear(2, 2), mesh=mesh,
                                mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
        assert held_in_fp32(one_dtype) == frozenset()  # an fp32 run: nothing is held apart
        assert held_in_fp32(torch.nn.Linear(2, 2)) == frozenset()  # not FSDP2's
    finally:
        dist.destroy_process_group()


def test_dry_run_host_memory_is_per_rank_for_the_sharded_load(tmp_path: Path) -> None:
    from kernelguard.train.startup.host_memory import host_memory

    model = _text_model()
    largest = max(p.numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    src = _save(model, tmp_path / "src")
    cfg = TrainConfig.from_flags(model=str(src), data="rows.jsonl", output_dir=tmp_path / "out", param_dtype="bf16")
    one, four = host_memory(cfg, world_size=1), host_memory(cfg, world_size=4)
    assert one.sharded and one.load_bytes == 2 * largest and four.load_bytes == 2 * -(-largest // 4)
    assert one.rank0_path_bytes == four.rank0_path_bytes == 4 * total
    assert four.checkpoint_bytes == 4 * -(-largest // 4) + 10_000_000  # one fp32 shard + DCP's copy-ahead
    assert four.export_bytes == 2 * total  # bf16 tensors in flight to disk: the whole (tiny) model at most
    text = four.render()
    assert text.startswith("host memory per rank over 4 rank(s)") and "load (sharded from safetensors)" in text
    assert f"the rank-0 load path would hold {4 * total / 2**30:.2f} GiB on rank 0" in text


# ------------------------------------------------------------------------------- multi-process (gloo) ---
@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "tied"), [(1, False), (2, True)], ids=["1rank-untied", "2ranks-tied"])
def test_sharded_load_is_bit_identical_and_the_export_loads_back(tmp_path: Path, nproc: int, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    src = _save(_text_model(tie_word_embeddings=tied), tmp_path / "src")
    assert len(list(src.glob("*.safetensors"))) >= 3
    out = tmp_path / "out"
    out.mkdir()
    r = _torchrun(nproc, str(src), str(out), SHARD)
    assert r.returncode == 0, r.stderr[-4000:]
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    loaded = load_file(str(out / "loaded.safetensors"))
    expected = ref.state_dict()
    assert sorted(loaded) == sorted(expected)
    assert [k for k in expected if not torch.equal(loaded[k], expected[k])] == []
    buffers = load_file(str(out / "buffers.safetensors"))
    assert buffers and all(torch.equal(b, dict(ref.named_buffers())[k]) for k, b in buffers.items())
    final = out / "final"
    index = json.loads((final / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3 and not (out / "final.tmp").exists()
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    assert _folder_tensors(final).keys() == _folder_tensors(src).keys()
    back = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    ids = torch.randint(0, h.VOCAB_SIZE, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref(ids).logits)


def _multimodal(path: Path) -> Path:
    import tiny_models
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_models.tiny_config("qwen3_5", vocab_size=h.VOCAB_SIZE, pad_token_id=0, eos_token_id=2)
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "num_position_embeddings": 64, "patch_size": 4, "temporal_patch_size": 1}
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision))
    return _save(model, path)


@pytest.mark.slow
def test_multimodal_checkpoint_trains_text_exports_its_class_and_export_after_the_fact_matches(
    tmp_path: Path,
) -> None:
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    assets = h.write_train_assets(tmp_path, rows=80)
    src = _multimodal(tmp_path / "src")
    generation = {"eos_token_id": [2, 3], "temperature": 0.6, "do_sample": True}
    (src / "generation_config.json").write_text(json.dumps(generation))
    out = tmp_path / "out"
    r = h.run_train(["--model", str(src), "--tokenizer", str(assets["tok"]), "--data", str(assets["data"]),
                     "--output-dir", str(out), "--max-steps", "2", "--max-length", "128", "--learning-rate", "1e-2",
                     "--max-shard-size", SHARD, "--no-plot", "--no-progress", "--allow", "attention"])
    assert r.returncode == 0, r.stderr[-4000:]
    final = out / "final"
    source, exported = _folder_tensors(src), _folder_tensors(final)
    assert exported.keys() == source.keys()
    vision = [k for k in source if k.startswith("model.visual.")]
    assert vision and all(torch.equal(exported[k], source[k]) for k in vision)
    assert not torch.equal(exported["model.language_model.layers.0.mlp.up_proj.weight"],
                           source["model.language_model.layers.0.mlp.up_proj.weight"])  # it trained
    loaded = Qwen3_5ForConditionalGeneration.from_pretrained(str(final), dtype=torch.bfloat16)
    assert torch.equal(loaded.state_dict()["model.visual.patch_embed.proj.weight"],
                       source["model.visual.patch_embed.proj.weight"])
    assert json.loads((final / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert (final / "tokenizer.json").is_file()

    again = tmp_path / "again"
    env = dict(os.environ, PYTHONPATH=str(h.REPO), CUDA_VISIBLE_DEVICES="", TRANSFORMERS_VERBOSITY="error")
    e = subprocess.run([sys.executable, "-m", "kernelguard", "export", str(out / "checkpoints" / "step_2"),
                        "--output", str(again), "--max-shard-size", SHARD],
                       env=env, capture_output=True, text=True, timeout=180, check=False)
    assert e.returncode == 0, e.stderr[-3000:]
    names = sorted(p.name for p in final.glob("*.safetensors"))
    assert names == sorted(p.name for p in again.glob("*.safetensors")) and len(names) >= 3
    assert all((final / n).read_bytes() == (again / n).read_bytes() for n in names)
    assert (final / "model.safetensors.index.json").read_text() == (again / "model.safetensors.index.json").read_text()
    # The source folder's sampling defaults and stop tokens: from --model, and from the run's recorded model.
    assert json.loads((final / "generation_config.json").read_text()) == generation
    assert json.loads((again / "generation_config.json").read_text()) == generation


@pytest.mark.slow
def test_random_init_is_made_per_shard_and_is_the_same_at_any_world_size(tmp_path: Path) -> None:
    """`--init random` fills each rank's shards on its own device: one rank and two ranks (the second run
    checkpointed, so its module names are wrapped) start from the same weights, bit for bit; another seed does
    not; the init is transformers' own scheme for the family."""
    import tiny_models
    from safetensors.torch import load_file

    config = h.write_model_config(tmp_path / "model").parent
    outs = {}
    for nproc, seed in ((1, 0), (2, 0), (1, 1)):
        out = tmp_path / f"init_{nproc}_{seed}.safetensors"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(h.REPO), str(h.TESTS_DIR)]), OMP_NUM_THREADS="1",
                   CUDA_VISIBLE_DEVICES="", TRANSFORMERS_VERBOSITY="error")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
               str(h.TESTS_DIR / "random_init_worker.py"), str(config), str(out), str(seed)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
        assert r.returncode == 0, r.stderr[-4000:]
        # the checkpointed run's state-dict names carry the wrapper: compare by the model's own names
        outs[nproc, seed] = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in load_file(str(out)).items()}
    one, two, other = outs[1, 0], outs[2, 0], outs[1, 1]
    assert sorted(one) == sorted(two) and [k for k in one if not torch.equal(one[k], two[k])] == []
    assert [k for k in one if one[k].numel() > 8 and torch.equal(one[k], other[k]) and one[k].std() > 0] == []
    ref = tiny_models.tiny_model("qwen3_5", vocab_size=h.VOCAB_SIZE, pad_token_id=0, eos_token_id=2).state_dict()
    assert sorted(ref) == sorted(one)
    std = 0.02  # Qwen3.5's initializer_range: linears and the embedding
    q = one["model.layers.0.mlp.up_proj.weight"]
    assert abs(float(q.std()) - std) < 0.2 * std and abs(float(q.mean())) < 0.2 * std
    assert float(one["model.embed_tokens.weight"][0].abs().max()) == 0.0  # the padding row
    gdn = "model.layers.0.linear_attn."
    assert torch.equal(one[gdn + "dt_bias"], torch.ones_like(one[gdn + "dt_bias"]))
    assert float(one[gdn + "A_log"].exp().min()) >= 0.01 and float(one[gdn + "A_log"].exp().max()) <= 16
    assert float(one["model.norm.weight"].abs().max()) == 0.0  # Qwen3.5's norms are 1 + weight
