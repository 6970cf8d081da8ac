"""kernelguard.train.model.memory: per-rank memory of `kernelguard train --dry-run`, on CPU with a tiny Qwen3.5 config.

Parameter, gradient and optimizer figures are checked exactly against a hand count of the architecture;
activations (measured on the meta device) by their structure: linear in tokens, checkpointing keeps less,
sharding does not change them, and the fast-kernel stand-ins are what is measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kernelguard.errors import ConfigError
from kernelguard.train.model import memory
from kernelguard.train.settings.config import TrainConfig

H, I, V = 64, 128, 512  # hidden, intermediate, vocab
HK, HV, DK, DV, W = 2, 4, 16, 16, 4  # GDN key/value heads, head dims, conv width
NQ, NKV, D = 4, 2, 16  # attention heads, kv heads, head dim
TINY = {
    "model_type": "qwen3_5_text",
    "vocab_size": V,
    "hidden_size": H,
    "intermediate_size": I,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": NQ,
    "num_key_value_heads": NKV,
    "head_dim": D,
    "linear_num_key_heads": HK,
    "linear_num_value_heads": HV,
    "linear_key_head_dim": DK,
    "linear_value_head_dim": DV,
    "linear_conv_kernel_dim": W,
    "tie_word_embeddings": False,
}


def hand_count() -> tuple[int, int, int]:
    """(all parameters, root parameters, largest decoder layer) of TINY, from the architecture."""
    conv_dim = 2 * HK * DK + HV * DV
    gdn = (
        H * conv_dim  # in_proj_qkv
        + H * HV * DV  # in_proj_z
        + 2 * H * HV  # in_proj_b, in_proj_a
        + conv_dim * W  # depthwise conv1d, no bias
        + 2 * HV  # dt_bias, A_log
        + DV  # gated RMSNorm weight
        + HV * DV * H  # out_proj
    )
    attention = H * NQ * D * 2 + 2 * H * NKV * D + NQ * D * H + 2 * D  # q (+ output gate), k, v, o, q/k norms
    common = 2 * H + 3 * H * I  # two RMSNorms + SwiGLU MLP
    root = 2 * V * H + H  # embeddings, LM head, final norm
    layers = [gdn + common] * 3 + [attention + common]
    return root + sum(layers), root, max(layers)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def _cfg(model: Path, **kw: object) -> TrainConfig:
    """One block per step unless a test says otherwise: the formulas below are per forward."""
    kw.setdefault("grad_accum", 1)
    return TrainConfig.from_flags(model=str(model), data="unused", output=model.parent / "out", **kw)  # type: ignore[arg-type]


def test_parameters_gradients_and_adamw_state_match_a_hand_count(tiny: Path) -> None:
    total, root, layer = hand_count()
    est = memory.estimate(_cfg(tiny, block_size=256, reshard_after_forward=True), world_size=1, gpu_bytes=80 * 10**9)
    assert est.num_params == total
    assert (est.parameter_bytes, est.gradient_bytes, est.optimizer_bytes) == (4 * total, 4 * total, 8 * total)
    assert est.unsharded_bytes == 2 * (root + 2 * layer)  # bf16 root + two layers in flight
    # auto on a card it fits: every layer kept gathered from its forward to its backward, the whole bf16 model
    kept = memory.estimate(_cfg(tiny, block_size=256), world_size=1, gpu_bytes=80 * 10**9)
    assert (kept.reshard_after_forward, kept.unsharded_bytes) == (False, 2 * total)
    assert kept.peak_bytes - est.peak_bytes == 2 * (total - root - 2 * layer)
    assert "unsharded bf16 copies (whole model)" in kept.render()
    assert kept.notes[-1].startswith("auto: activation checkpointing off, 1 block (256 tokens) per forward, weights kept gathered: ")
    two = memory.estimate(_cfg(tiny, block_size=256, reshard_after_forward=True), world_size=2, gpu_bytes=80 * 10**9)
    half = -(-total // 2)
    assert (two.params_per_rank, two.parameter_bytes, two.optimizer_bytes) == (half, 4 * half, 8 * half)
    assert two.activation_bytes == est.activation_bytes  # every rank runs its own block
    assert two.unsharded_bytes == est.unsharded_bytes
    fp32 = memory.estimate(_cfg(tiny, block_size=256, param_dtype="fp32", compile=False, reshard_after_forward=True),
                           world_size=1, gpu_bytes=10**12)
    assert fp32.unsharded_bytes == 4 * (root + 2 * layer)


def test_peak_without_checkpointing_is_the_loss_forward_without_gradients(tiny: Path) -> None:
    est = memory.estimate(_cfg(tiny, block_size=256, activation_checkpointing=False), world_size=1)
    parts = est.parameter_bytes + est.optimizer_bytes + est.unsharded_bytes + est.activation_bytes
    assert est.peak_bytes == parts + est.loss_bytes
    assert "the peak is reached in the loss's forward (saved activations + its chunk buffers)" in est.notes
    accum = memory.estimate(
        _cfg(tiny, block_size=256, activation_checkpointing=False, grad_accum=2, blocks_per_forward=1), world_size=1
    )
    assert accum.peak_bytes == est.peak_bytes + est.gradient_bytes  # the 2nd micro-batch runs with grads


def test_peak_with_checkpointing_is_the_larger_of_loss_forward_and_backward(tiny: Path) -> None:
    from kernelguard.train.model.parallel import model_source

    config, _ = model_source(str(tiny))
    probe = memory.measure_activations(config, tokens=256)
    est = memory.combine(
        probe, world_size=1, block_size=256, activation_checkpointing=True, loss="chunked", param_dtype="bf16"
    )
    static = est.parameter_bytes + est.optimizer_bytes + est.unsharded_bytes
    kept = 2 * (256 * H + V * H)
    at_loss = static + est.activation_bytes - probe.max_layer_saved + est.loss_bytes
    layer_inputs = est.activation_bytes - probe.max_layer_saved
    # FSDP2 reduces a layer's gradients in fp32: its bf16 gradients, the fp32 reduce-scatter input of the whole
    # layer, then that input beside its fp32 output shard (one rank: the whole layer again).
    layer = probe.max_layer_params
    reduce = max(2 * layer, 4 * layer) + 4 * layer
    in_backward = static + kept + max(layer_inputs, est.gradient_bytes) + probe.max_layer_saved + reduce
    root = probe.root_params
    at_root = est.parameter_bytes + est.optimizer_bytes + 2 * root + est.gradient_bytes - 4 * root + 8 * root
    assert est.peak_bytes == max(at_loss, in_backward, at_root)
    # Tiny vocab: the backward (gradients + the recomputed layer) is the worse moment.
    assert in_backward > max(at_loss, at_root)
    assert "the peak is reached in the backward (gradients + one recomputed layer + its gradient reduction)" in est.notes


def test_loss_terms_by_hand(tiny: Path) -> None:
    est = memory.estimate(_cfg(tiny, block_size=256, loss="chunked", compile=False), world_size=1)
    # kept: d(hidden) + d(head); per chunk (all 256 tokens here): bf16 logits, their fp32 copy, fp32 log-softmax
    assert est.loss_bytes == 2 * (256 * H + V * H) + 256 * V * (2 + 4 + 4)
    # compile auto (on for the GPU runs estimated): the compiled pass holds bf16 logits and their bf16 gradient
    compiled = memory.estimate(_cfg(tiny, block_size=256, loss="chunked"), world_size=1)
    assert compiled.compiled_loss and compiled.loss_bytes == 2 * (256 * H + V * H) + 256 * V * (2 + 2)
    assert "loss (chunked, compiled)" in compiled.render()
    logits = memory.estimate(_cfg(tiny, block_size=256, loss="logits"), world_size=1)
    assert logits.loss_bytes == 256 * V * (4 + 2 + 4)  # kept fp32 log-softmax; bf16 logits + fp32 copy
    fp32 = memory.estimate(_cfg(tiny, block_size=256, param_dtype="fp32"), world_size=1, gpu_bytes=10**12)
    assert fp32.loss_bytes == 4 * (256 * H + V * H) + 256 * V * (4 + 4)  # no upcast copy of fp32 logits


def test_activations_are_linear_in_tokens_and_checkpointing_keeps_less(tiny: Path) -> None:
    from kernelguard.train.model.parallel import model_source

    config, _ = model_source(str(tiny))
    small = memory.measure_activations(config, tokens=192)
    large = memory.measure_activations(config, tokens=384)
    assert large.total_saved == pytest.approx(2 * small.total_saved, rel=0.01)
    assert small.max_layer_saved * 4 >= small.total_saved - small.root_saved  # 4 layers
    no_ac = memory.combine(
        small,
        world_size=1,
        block_size=192,
        activation_checkpointing=False,
        loss="chunked",
        param_dtype="bf16",
    )
    ac = memory.combine(
        small, world_size=1, block_size=192, activation_checkpointing=True, loss="chunked", param_dtype="bf16"
    )
    assert ac.activation_bytes == 4 * 192 * H * 2 + small.root_saved + small.max_layer_saved
    assert ac.activation_bytes < no_ac.activation_bytes


def test_fast_kernels_are_measured_not_the_torch_reference(tiny: Path) -> None:
    """The GDN layer's chunk kernel saves what fla saves; the torch reference would save every chunk's
    intermediate matrices (many times more). The stand-ins are restored afterwards."""
    from kernelguard.train.model.parallel import model_source

    config, _ = model_source(str(tiny))
    probe = memory.measure_activations(config, tokens=256)
    module = sys.modules["transformers.models.qwen3_5.modeling_qwen3_5"]
    assert getattr(module.torch_chunk_gated_delta_rule, "__name__", None) != "_chunk_gdn"  # a Func in-window
    assert not probe.notes
    # Per GDN layer the chunk kernel saves q, k (bf16), their fp32 rstd, g (fp32), beta, A [T, HV, 64] (bf16)
    # and v: a lower bound of the layer's total that the reference path would exceed by far.
    t = 256
    kernel = t * (2 * HK * DK * 2 + 2 * HK * 4 + HV * 4 + HV * 2 + HV * 64 * 2 + HV * DV * 2)
    assert kernel < probe.max_layer_saved < 40 * kernel


def test_render_and_dict(tiny: Path) -> None:
    est = memory.estimate(_cfg(tiny, block_size=256), world_size=4, gpu_bytes=1000)
    text = est.render()
    assert text.startswith("memory per rank: ") and "over 4 rank(s)" in text
    from kernelguard.train.common.logs import human_count

    # "16 M parameters", as people write it, not "0.016 B"
    assert f"{human_count(est.num_params)} parameters over 4 rank(s)" in text and " B parameters" not in text
    assert [human_count(n) for n in (16_000_000, 15_728_640, 1.5e9, 950_000, 12)] == [
        "16 M", "15.7 M", "1.5 B", "950 K", "12",
    ]  # fmt: skip
    for label in (
        "parameters (fp32 shards)",
        "gradients (fp32 shards)",
        "optimizer state (AdamW, fp32 shards)",
        "activations",
        "loss (chunked, compiled)",
        "estimated peak",
    ):
        assert label in text
    assert "does NOT fit on the given GPU memory" in text
    data = est.to_dict()
    assert data["fits"] is False and data["peak_bytes"] == est.peak_bytes
    assert set(data["fits_common_gpus"]) == {"80 GB (H100/A100)", "141 GB (H200)"}
    json.dumps(data)


def test_no_gpu_verdict_names_common_cards(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_visible_gpu", lambda: (None, "no GPU"))
    est = memory.estimate(_cfg(tiny, block_size=256), world_size=1)
    assert est.fits is None
    assert "fits on 80 GB (H100/A100); fits on 141 GB (H200) (no GPU visible" in est.render()


def test_world_size_from_env_and_bad_values(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert memory.estimate(_cfg(tiny, block_size=128)).world_size == 8
    monkeypatch.setenv("WORLD_SIZE", "zero")
    with pytest.raises(ConfigError, match="world size is 'zero'"):
        memory.estimate(_cfg(tiny, block_size=128))


def test_min_world_size_doubles_until_it_fits(tiny: Path) -> None:
    est = {n: memory.estimate(_cfg(tiny, block_size=128), world_size=n) for n in (1, 2, 4, 8)}
    static = est[1].peak_bytes - est[8].peak_bytes
    target = (est[4].peak_bytes + static // 100) / memory.HEADROOM
    assert memory.min_world_size(lambda n: est[n], target, limit=8) == 4
    assert memory.min_world_size(lambda n: est[n], 1, limit=8) is None


def test_auto_estimate_is_for_the_layout_auto_picks_on_this_gpu(tiny: Path) -> None:
    """--dry-run with the defaults (--activation-checkpointing auto, --blocks-per-forward auto, two blocks per
    step) reports the layout the run would use, and why (the weights freed after each forward here: the third
    switch is tested in tests/train/test_train_units.py and the hand count above)."""
    def fixed(ac: bool, n: int) -> memory.MemoryEstimate:
        cfg = _cfg(tiny, reshard_after_forward=True, block_size=256, grad_accum=2, activation_checkpointing=ac, blocks_per_forward=n)
        return memory.estimate(cfg, world_size=1, gpu_bytes=10**12)

    merged, alone, ac_one = fixed(False, 2), fixed(False, 1), fixed(True, 1)
    assert (merged.block_size, merged.grad_accum, merged.blocks_per_forward) == (512, 1, 2)
    assert "2 blocks of 256 tokens per forward (512-token rows)" in merged.render()
    auto = memory.estimate(_cfg(tiny, reshard_after_forward=True, block_size=256, grad_accum=2), world_size=1, gpu_bytes=10**12)
    assert (auto.activation_checkpointing, auto.blocks_per_forward, auto.peak_bytes) == (False, 2, merged.peak_bytes)
    assert auto.notes[-1] == (
        "auto: activation checkpointing off, 2 blocks (512 tokens) per forward: estimated peak "
        f"{merged.peak_bytes / 2**30:.2f} GiB fits 92% of 931.32 GiB on the given GPU memory"
    )
    small = int(merged.peak_bytes / memory.HEADROOM) - 1  # one byte short of the merged row
    auto = memory.estimate(_cfg(tiny, reshard_after_forward=True, block_size=256, grad_accum=2), world_size=1, gpu_bytes=small)
    assert (auto.activation_checkpointing, auto.blocks_per_forward, auto.peak_bytes) == (False, 1, alone.peak_bytes)
    assert f"note: {auto.notes[-1]}" in auto.render()
    tiny_card = int(ac_one.peak_bytes / memory.HEADROOM) - 1  # nothing fits
    auto = memory.estimate(_cfg(tiny, reshard_after_forward=True, block_size=256, grad_accum=2), world_size=1, gpu_bytes=tiny_card)
    assert (auto.activation_checkpointing, auto.blocks_per_forward) == (True, 1) and auto.fits is False
    assert "does not fit" in auto.notes[-1] and "in any layout" in auto.notes[-1]


def test_auto_estimate_without_a_gpu_reports_its_choice_on_each_common_card(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No GPU here (a docker build, a login node): the report is for auto's choice on the largest common card,
    and says which it makes on each."""
    monkeypatch.setattr(memory, "_visible_gpu", lambda: (None, "no GPU"))
    off = memory.estimate(_cfg(tiny, reshard_after_forward=True, block_size=256, activation_checkpointing=False), world_size=1)
    on = memory.estimate(_cfg(tiny, reshard_after_forward=True, block_size=256, activation_checkpointing=True), world_size=1)
    auto = memory.estimate(_cfg(tiny, reshard_after_forward=True, block_size=256), world_size=1)
    assert auto.activation_checkpointing is False and auto.fits is None and auto.peak_bytes == off.peak_bytes
    one_block = "activation checkpointing off, 1 block (256 tokens) per forward"
    assert auto.notes[-1] == (
        f"auto decides on the job's GPU (80 GB (H100/A100): {one_block}, 141 GB (H200): {one_block}); "
        "shown: 141 GB (H200)"
    )
    # A model whose activations fit no common card without checkpointing: the report is the checkpointed one.
    monkeypatch.setattr(
        memory, "COMMON_GPUS", (("tiny card", off.peak_bytes * 0.9), ("bigger card", off.peak_bytes))
    )
    auto = memory.estimate(_cfg(tiny, reshard_after_forward=True, block_size=256), world_size=1)
    assert auto.activation_checkpointing is True and auto.peak_bytes == on.peak_bytes
    assert "(tiny card: activation checkpointing on, 1 block (256 tokens) per forward, bigger card: " in auto.notes[-1]


# ---------------------------------------------------------------------------------------- --dry-run CLI ---
MOE = {
    **TINY,
    "model_type": "qwen3_5_moe_text",
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}


def _dry_run(config: dict[str, object], tmp_path: Path, *extra: str) -> list[str]:
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(config))
    return ["--model", str(path), "--data", "unused.jsonl", "--output-dir", str(tmp_path / "out"), "--dry-run",
            "--max-length", "1024", *extra]


def test_dry_run_builds_the_model_once_and_names_each_stage_before_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dry-run of a large config must never look hung: every stage (imports, the meta build, the activation
    probe) is named on stderr as it starts, and the model is built once for both estimates (it was built
    twice: once for the activation probe, once for the host-memory figures)."""
    import kernelguard.train.__main__ as entry
    from kernelguard.train.model import parallel
    builds: list[tuple[str, str]] = []
    events: list[str] = []
    real = parallel.build_meta_model

    def counting(config: object, *, attn_implementation: str) -> object:
        builds.append((type(config).__name__, attn_implementation))
        events.append("build")
        return real(config, attn_implementation=attn_implementation)

    monkeypatch.setattr(parallel, "build_meta_model", counting)
    real_print = entry.print_rank0
    monkeypatch.setattr(entry, "print_rank0", lambda m: (events.append(m), real_print(m)))
    assert entry.main(_dry_run(MOE, tmp_path, "--nproc-per-node", "64")) == 0
    out, err = capsys.readouterr()
    assert builds == [("Qwen3_5MoeTextConfig", memory.PROBE_ATTENTION)]
    stages = [e for e in events if e != "build" and "warning" not in e]
    assert [s.split("]: ", 1)[1].split(" ")[0] for s in stages] == ["loading", str(tmp_path / "moe.json:"), "measuring"]
    assert "qwen3_5_moe_text, 4 layers, hidden 64, vocab 512, 8 experts" in stages[1]
    assert events.index("build") == 2, "the meta build is announced before it starts"
    assert "over 64 rank(s)" in out and "host memory per rank over 64 rank(s)" in out and "Traceback" not in err
    # It reads no data, but says when the run itself would be refused (here: no tokenizer folder, no data).
    assert events[-1].startswith("kernelguard train --dry-run: warning: the run itself would be refused: --model ")
    assert "is a config.json, which holds no tokenizer" in events[-1]


def test_dry_run_says_when_the_run_itself_would_be_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kernelguard.train.__main__ import main

    (tmp_path / "tok").mkdir()
    argv = [*_dry_run(MOE, tmp_path), "--tokenizer", str(tmp_path / "tok")]
    assert main(argv) == 0  # an empty tokenizer folder comes first
    assert "warning: the run itself would be refused: tokenizer folder" in capsys.readouterr().err
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    assert main(argv) == 0
    assert ("warning: the run itself would be refused: --data unused.jsonl: no such file or folder"
            in capsys.readouterr().err)
    (tmp_path / "data.jsonl").write_text("{}\n")
    argv[argv.index("unused.jsonl")] = str(tmp_path / "data.jsonl")
    assert main(argv) == 0
    assert "would be refused" not in capsys.readouterr().err


def test_dry_run_of_eager_moe_experts_measures_them_as_grouped_mm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config with ``experts_implementation: eager`` made --dry-run end in a NotImplementedError traceback
    (eager's per-expert loop calls nonzero, which the meta device cannot answer)."""
    from kernelguard.train.__main__ import main

    assert main(_dry_run({**MOE, "experts_implementation": "eager"}, tmp_path)) == 0
    out = capsys.readouterr().out
    assert "note: experts_implementation eager: the experts' activations are measured as grouped_mm" in out
    eager = memory.estimate(_cfg(_write(tmp_path / "e.json", {**MOE, "experts_implementation": "eager"}),
                                 block_size=1024), world_size=1)
    grouped = memory.estimate(_cfg(_write(tmp_path / "g.json", MOE), block_size=1024), world_size=1)
    assert eager.activation_bytes == grouped.activation_bytes > 0 and not any("eager" in n for n in grouped.notes)


def _write(path: Path, config: dict[str, object]) -> Path:
    path.write_text(json.dumps(config))
    return path


def test_checkpointing_never_raises_the_estimate_beyond_one_recomputed_layer(tiny: Path) -> None:
    """Few tokens, so the gradients outweigh everything saved: without checkpointing the backward's end (all
    gradients) is the peak too, so turning checkpointing on can only add the layer it recomputes."""
    from kernelguard.train.model.parallel import model_source

    config, _ = model_source(str(tiny))
    probe = memory.measure_activations(config, tokens=8)
    on, off = (
        memory.combine(probe, world_size=1, block_size=8, activation_checkpointing=ac, loss="chunked",
                       param_dtype="bf16")
        for ac in (True, False)
    )  # fmt: skip
    assert off.gradient_bytes > probe.total_saved
    static = off.parameter_bytes + off.optimizer_bytes + off.unsharded_bytes
    assert off.peak_bytes >= static + off.gradient_bytes
    assert on.peak_bytes <= off.peak_bytes + probe.max_layer_saved


@pytest.mark.slow
def test_the_multi_node_page_quotes_the_27b_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/multi-node.md's per-rank figure and "one node holds it" are the dry run's, re-measured here on the
    config the page names (the page once said 80 GB cards needed two nodes while the dry run said they fit)."""
    import re

    import kernelguard.train.__main__ as entry

    repo = Path(__file__).resolve().parents[2]
    config = repo / "bench" / "configs" / "qwen3_5_27b_text.json"
    data = tmp_path / "one.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    argv = ["--dry-run", "--nproc-per-node", "8", "--model", str(config), "--data", str(data),
            "--output-dir", str(tmp_path / "out")]
    assert entry.main(argv) == 0
    out = capsys.readouterr().out
    peak = re.search(r"estimated peak\s+([0-9.]+) GiB", out)
    assert peak is not None, out
    assert "fits on 80 GB (H100/A100); fits on 141 GB (H200)" in out, out
    page = " ".join((repo / "docs" / "multi-node.md").read_text().split())
    assert "one node of eight 80 GB or 141 GB cards holds it" in page, page[:600]
    # The figure is the README stack's (the page names its transformers); other releases build the model a little
    # differently, and only the verdict above must hold there.
    from importlib import metadata

    if metadata.version("transformers").startswith("5.24."):
        quoted = f"at {float(peak.group(1)):.1f} GiB per rank over 8 ranks (transformers 5.24)"
        assert quoted in page, page[:600]
    assert "bench/configs/qwen3_5_27b_text.json" in page


def _real_widths(tmp_path: Path, layers: int) -> Path:
    """Qwen3.5-27B's text config (shipped for planning) cut to its first ``layers`` layers."""
    repo = Path(__file__).resolve().parents[2]
    config = json.loads((repo / "bench" / "configs" / "qwen3_5_27b_text.json").read_text())
    config.update(num_hidden_layers=layers, layer_types=config["layer_types"][:layers])
    path = tmp_path / f"qwen3_5_27b_{layers}_layers" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


H100_TORCH_BYTES = int(79.18 * 2**30)  # what torch reports for an H100 80GB HBM3 (bench/RESULTS.md, memory)


def test_real_widths_the_root_gradient_reduction_is_counted(tmp_path: Path) -> None:
    """Measured on one H100 at Qwen3.5-27B's widths (bench/RESULTS.md, memory, 2026-12-05): 2 layers, one
    8,192-token block, no checkpointing, eager loss: peak 63.1 GiB; 4 layers with checkpointing, which the
    estimate then put at 72.4 GiB ("fits"), ran out of memory in FSDP2's fp32 reduction of the root's gradients
    (asking 9.47 GiB: the embeddings + LM head in fp32) with 60.6 GiB allocated."""
    two = _cfg(_real_widths(tmp_path, 2), block_size=8192, activation_checkpointing=False, compile=False)
    est = memory.estimate(two, world_size=1, gpu_bytes=H100_TORCH_BYTES)
    assert abs(est.peak_bytes / 2**30 - 63.1) / 63.1 < 0.10, est.render()
    assert "the peak is reached in the root's gradient reduction (embeddings + LM head, in fp32) at the end of the backward" in est.notes
    four = _cfg(_real_widths(tmp_path, 4), block_size=8192, compile=False)
    choice = memory.choose_layout(four, gpu_bytes=H100_TORCH_BYTES, gpu_source="NVIDIA H100 80GB HBM3", world_size=1)
    assert not choice.fits and choice.ranks_that_fit == 2, choice
    # what was allocated when it failed, plus what it asked for, is under the estimate
    assert choice.estimate.peak_bytes > (60.63 + 9.47) * 2**30
