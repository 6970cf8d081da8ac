"""Try every kind of bad input a new user brings, through the real entry points, and classify what happens.

Each case runs in a fresh subprocess (``kernelguard check``, ``kernelguard train``, or a short Python snippet
calling the public API) and is classified:

  clear      non-zero exit (or the expected warn-and-continue), no Python traceback, and a message that says
             what is wrong (an ``error:`` line, or the error class name with its sentence)
  traceback  a Python traceback reached the user
  silent     exit 0 where a refusal was expected (or no message where one was expected)
  unclear    refused without a traceback, but without a line that says what is wrong
  hang       no result within the case's timeout

Prints one JSON object with the counts and one row per case; ``--out FILE`` also writes it. Training cases use
the CPU test doubles in tests/fake_providers (so the gate passes and the case reaches its own check) and tiny
assets from tests/train_helpers.py. Run from the repository root: ``python bench/cpu/bad_inputs_sweep.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import train_helpers as h


def environment(*, fakes: bool = False, extra: dict[str, str] | None = None, fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KERNELGUARD_FAULT")}
    env.update(CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    # This checkout's kernelguard, never whichever copy the interpreter has installed.
    paths = [str(ROOT / "tests" / "fake_providers")] if fakes else []
    if fault:  # tests/fault_hooks/sitecustomize.py injects it (a full disk during the export, a slow export)
        paths.append(str(ROOT / "tests" / "fault_hooks"))
        env["KERNELGUARD_FAULT"] = fault
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT)])
    env.update(extra or {})
    return env


def run(argv: list[str], *, cwd: Path, fakes: bool = False, timeout: int = 600, env: dict[str, str] | None = None,
        fault: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=environment(fakes=fakes, extra=env, fault=fault),
                          capture_output=True, text=True, timeout=timeout, check=False)


def classify(proc: subprocess.CompletedProcess[str], expect: str, must_say: str | None) -> str:
    err = proc.stderr + proc.stdout
    if "Traceback (most recent call last)" in err:
        return "traceback"
    if expect == "refuse" and proc.returncode == 0:
        return "silent"
    if expect == "ok":  # a valid (if extreme) input: it must work, and say what must_say names
        return "unclear" if proc.returncode != 0 else ("silent" if must_say and must_say not in err else "clear")
    if expect == "warn" and (proc.returncode != 0):
        return "unclear"
    if must_say and must_say not in err:
        return "silent" if expect == "warn" else "unclear"
    said = any(("error" in line.lower() or "refus" in line.lower() or "Error:" in line) for line in err.splitlines())
    return "clear" if said or expect == "warn" else "unclear"


# ------------------------------------------------------------------------------------------------ cases ---
def _empty_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_cases(work: Path) -> list[dict[str, Any]]:
    def cfg(name: str, body: str) -> str:
        path = work / f"{name}.json"
        path.write_text(body)
        return str(path)

    qwen = '"model_type": "qwen3_5_text"'
    cases = [
        ("arch typo", ["--arch", "banana"]), ("arch no GPU has", ["--arch", "9.5"]), ("arch absurd", ["--arch", "900"]),
        ("arch suffix too old", ["--arch", "sm_80a"]), ("allow typo", ["--allow", "fla640"]),
        ("allow kernel typo", ["--allow", "chunk_gated_delta_rul"]), ("model unknown", ["--model", "qwen9"]),
        ("model empty", ["--model", ""]), ("model dir without config", ["--model", str(work)]),
        ("config not json", ["--model", cfg("notjson", "{not json")]),
        ("config a list", ["--model", cfg("list", "[1, 2]")]),
        ("config model_type list", ["--model", cfg("mtlist", '{"model_type": ["qwen3_5"]}')]),
        ("config unrelated model", ["--model", cfg("bert", '{"model_type": "bert"}')]),
        ("config head dim string", ["--model", cfg("hdstr", "{" + qwen + ', "linear_key_head_dim": "128"}')]),
        ("config head dim negative", ["--model", cfg("hdneg", "{" + qwen + ', "linear_key_head_dim": -64}')]),
        ("config heads absurd", ["--model", cfg("heads", "{" + qwen + ', "linear_num_value_heads": 1000000000}')]),
        ("config text_config string", ["--model", cfg("tc", '{"model_type": "qwen3_5", "text_config": "x"}')]),
        ("config layer_types string", ["--model", cfg("lt", "{" + qwen + ', "layer_types": "linear"}')]),
        ("mode typo", ["--mode", "train"]), ("unknown flag", ["--archs", "9.0"]),
        ("run without GPU", ["--run", "--arch", "9.0"]),
        ("allow GDN fallback for packed training", ["--allow", "chunk_gated_delta_rule", "--allow", "causal_conv1d_fn",
                                                   "--allow", "attention"]),
    ]
    out = [{"class": "check: flags and model configs", "name": n, "argv": ["-m", "kernelguard", "check", *a],
            "expect": "refuse"} for n, a in cases]
    for name, text in (("pyproject bad toml", "[tool.kernelguard\n"), ("pyproject tool not a table", "tool = 5\n"),
                       ("pyproject section not a table", "[tool]\nkernelguard = 3\n"),
                       ("pyproject unknown key", "[tool.kernelguard]\narchs = ['9.0']\n"),
                       ("pyproject arch number", "[tool.kernelguard]\narch = 9.0\n"),
                       ("pyproject arch no GPU", "[tool.kernelguard]\narch = ['7.7']\n"),
                       ("pyproject allow typo", "[tool.kernelguard]\nallow = ['atention']\n"),
                       ("pyproject mode typo", "[tool.kernelguard]\nmode = 'train'\n"),
                       ("pyproject packed string", "[tool.kernelguard]\npacked = 'yes'\n")):
        folder = work / name.replace(" ", "_")
        folder.mkdir()
        (folder / "pyproject.toml").write_text(text)
        out.append({"class": "check: [tool.kernelguard]", "name": name, "argv": ["-m", "kernelguard", "check"],
                    "expect": "refuse", "cwd": folder})
    return out


def api_cases() -> list[dict[str, Any]]:
    snippets = {
        "require() twice then check()": "import kernelguard as k\nfor f in (k.require, k.require, k.check):\n"
        "    f('qwen3_5', packed=False, arch='9.0', allow=['chunk_gated_delta_rule','causal_conv1d_fn'])\n"
        "raise SystemExit(3)",
        "check(model=5)": "import kernelguard as k; k.check(5)",
        "check(mode='train')": "import kernelguard as k; k.check(mode='train')",
        "check(packed='yes')": "import kernelguard as k; k.check(packed='yes')",
        "check(arch=object())": "import kernelguard as k; k.check(arch=object())",
        "check(allow=5)": "import kernelguard as k; k.check(allow=5)",
        "require(allow typo)": "import kernelguard as k; k.require(allow=['fla640'])",
        "KERNELGUARD_ALLOW typo": "import os; os.environ['KERNELGUARD_ALLOW']='fla640'\nimport kernelguard as k; k.require()",
        "KERNELGUARD_ARCH no GPU": "import os; os.environ['KERNELGUARD_ARCH']='9.5'\nimport kernelguard as k; k.require()",
        "guard('model')": "import kernelguard as k; k.guard('model')",
        "guard(object())": "import kernelguard as k; k.guard(object())",
        "guard(nn.Sequential())": "import torch, kernelguard as k; k.guard(torch.nn.Sequential())",
        "guard(allow typo)": "import torch, kernelguard as k; k.guard(torch.nn.Sequential(), allow=['fla640'])",
        "guard(packed='no')": "import torch, kernelguard as k; k.guard(torch.nn.Linear(2, 2), packed='no')",
        "guard(strict='false')": "import torch, kernelguard as k; k.guard(torch.nn.Linear(2, 2), strict='false')",
        "require(hub='no')": "import kernelguard as k; k.require(hub='no')",  # "no" is truthy: never Hub on
        "generate() inside guard(mode='training'), use_cache on": (
            f"import sys, torch; sys.path.insert(0, {str(ROOT / 'tests')!r}); import tiny_models, kernelguard as k\n"
            "m = tiny_models.tiny_model('qwen3_5', use_cache=True)\n"
            "with k.guard(m, packed=False, allow=['causal_conv1d_fn', 'chunk_gated_delta_rule', 'attention']):\n"
            "    m.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False)\n"
            "raise SystemExit(3)"),
    }
    must_say = {"require(hub='no')": "hub must be True or False, found 'no'"}
    cases = []
    for name, code in snippets.items():
        # A KernelGuardError escaping a script is the API's way to refuse; wrap it like a job would print it.
        wrapped = ("import sys\ntry:\n" + "".join(f"    {line}\n" for line in code.splitlines()) +
                   "except Exception as e:\n    print(f'{type(e).__name__}: {e}', file=sys.stderr)\n"
                   "    raise SystemExit(2 if type(e).__module__.startswith('kernelguard') else 1)\n")
        cases.append({"class": "API", "name": name, "argv": ["-c", wrapped], "expect": "refuse",
                      "must_say": must_say.get(name)})
    # require twice, and generate() in a training guard, must SUCCEED (exit 3: the snippet's "all returned")
    cases[0]["expect"] = "exit3"
    next(c for c in cases if c["name"].startswith("generate()"))["expect"] = "exit3"
    return cases


def train_cases(work: Path) -> list[dict[str, Any]]:
    tok = h.write_tokenizer(work / "tok")
    model = h.write_model_config(work / "model")
    h.write_model_config(work / "wide", hidden_size=128)
    data = h.write_jsonl(work / "data.jsonl", h.copy_task_rows(60))
    other = h.write_jsonl(work / "other.jsonl", h.copy_task_rows(61))
    base = ["-m", "kernelguard", "train", "--model", str(model), "--tokenizer", str(tok), "--data", str(data),
            "--block-size", "256", "--max-steps", "2", "--save-steps", "1", "--no-progress", "--no-plot",
            "--allow", "attention"]
    a_file = work / "a_file"
    a_file.write_text("x")
    bad_yaml = work / "bad.yaml"
    bad_yaml.write_text("learning_rate: [1, 2\n")
    unknown_key = work / "unknown.toml"
    unknown_key.write_text("learning_rat = 1e-4\n")
    wrong_type = work / "wrong.yaml"
    wrong_type.write_text("max_steps: many\n")
    bad_rows = work / "bad.jsonl"
    bad_rows.write_text('{"messages": [{"role": "user", "content": 5}]}\n')
    no_column = work / "nocol.jsonl"
    no_column.write_text('{"conversation": []}\n')
    h.write_jsonl(work / "chitchat.jsonl", h.copy_task_rows(60))  # the file a typo'd extension means
    qa_other = h.write_jsonl(work / "qa_other.jsonl", [{"query": "ab", "reply": "cd"}] * 4)

    def out(name: str) -> str:
        return str(work / "runs" / name)

    bad = _bad_assets(work, data)

    cases = [
        ("data missing", [*base, "--output-dir", out("a")], {"--data": str(work / "nope.jsonl")}),
        ("tokenizer missing", [*base, "--output-dir", out("b")], {"--tokenizer": str(work / "nope")}),
        ("tokenizer folder without tokenizer files", [*base, "--output-dir", out("b2")],
         {"--tokenizer": str(_empty_folder(work / "no-tokenizer-files"))}),
        ("model missing", [*base, "--output-dir", out("c")], {"--model": str(work / "nope")}),
        ("output is a file", [*base, "--output-dir", str(a_file)], {}),
        ("block size 0", [*base, "--output-dir", out("d"), "--block-size", "0"], {}),
        ("negative learning rate", [*base, "--output-dir", out("e"), "--learning-rate", "-1"], {}),
        ("eval fraction 1.5", [*base, "--output-dir", out("f"), "--eval-fraction", "1.5"], {}),
        ("eval data and fraction", [*base, "--output-dir", out("g"), "--eval-fraction", "0.1", "--eval-data",
                                    str(data)], {}),
        ("report-to unknown", [*base, "--output-dir", out("h"), "--report-to", "mlflow"], {}),
        ("report-to wandb missing", [*base, "--output-dir", out("i"), "--report-to", "wandb"], {}),
        ("config file malformed", [*base, "--output-dir", out("j"), "--config", str(bad_yaml)], {}),
        ("config file unknown key", [*base, "--output-dir", out("k"), "--config", str(unknown_key)], {}),
        ("config file wrong type", [*base, "--output-dir", out("l"), "--config", str(wrong_type)], {}),
        ("resume-anyway without resume", [*base, "--output-dir", out("m"), "--resume-anyway"], {}),
        ("resume and overwrite", [*base, "--output-dir", out("n"), "--resume", "--overwrite"], {}),
        ("resume with nothing to resume", [*base, "--output-dir", out("o"), "--resume"], {}),
        ("malformed row", [*base, "--output-dir", out("p")], {"--data": str(bad_rows)}),
        ("no known column", [*base, "--output-dir", out("q")], {"--data": str(no_column)}),
        ("dataset format mismatch", [*base, "--output-dir", out("r"), "--dataset-format", "text"], {}),
        # issue 43: a local-looking path is never tried on the Hub; a Hub name offline is one line
        ("data extension typo", [*base, "--output-dir", out("x1")], {"--data": str(work / "chitchat.jsnol")}),
        ("eval data extension typo", [*base, "--output-dir", out("x2"), "--eval-data", str(work / "chitchat.jsnol")],
         {}),
        ("data typo in the current folder", [*base, "--output-dir", out("x3")], {"--data": "chitchat.jsnol"}),
        ("data a Hub name while offline", [*base, "--output-dir", out("x4")], {"--data": "someone/no-such-dataset"}),
        ("columns malformed", [*base, "--output-dir", out("x5"), "--columns", "user=query"], {}),
        ("columns with dataset format", [*base, "--output-dir", out("x6"), "--columns", "user=query,assistant=reply",
                                         "--dataset-format", "text"], {}),
        ("other column names", [*base, "--output-dir", out("x7")], {"--data": str(qa_other)}),
        ("columns naming a missing column", [*base, "--output-dir", out("x8"), "--columns", "user=query,assistant=answer"],
         {"--data": str(qa_other)}),
        ("chat template file missing", [*base, "--output-dir", out("s"), "--chat-template", str(work / "no.jinja")], {}),
        ("nproc 0", [*base, "--output-dir", out("t"), "--nproc-per-node", "0"], {}),
        ("allow typo", [*base, "--output-dir", out("u"), "--allow", "fla640"], {}),
        # never a silent random init; model folders are read as carefully as config files
        ("model folder without weights", [*base, "--output-dir", out("w1")], {"--model": bad["no_weights"]}),
        ("model folder, unindexed shards", [*base, "--output-dir", out("w2")], {"--model": bad["shards"]}),
        ("model folder, index names missing shard", [*base, "--output-dir", out("w3")], {"--model": bad["index"]}),
        ("init pretrained with a config file", [*base, "--output-dir", out("w4"), "--init", "pretrained"], {}),
        ("init typo", [*base, "--output-dir", out("w5"), "--init", "pretrain"], {}),
        ("model folder config not json", [*base, "--output-dir", out("w6")], {"--model": bad["notjson"]}),
        ("model folder unknown model_type", [*base, "--output-dir", out("w7")], {"--model": bad["unknown"]}),
        ("model folder config a list", [*base, "--output-dir", out("w8")], {"--model": bad["list"]}),
        ("config edited after the weights", [*base, "--output-dir", out("w9")], {"--model": bad["mismatch"]}),
        # data files and splits
        ("gzip named .jsonl", [*base, "--output-dir", out("d1")], {"--data": bad["gzip"]}),
        ("zstd magic named .jsonl", [*base, "--output-dir", out("d2")], {"--data": bad["zstd"]}),
        ("split of a single file", [*base, "--output-dir", out("d3"), "--split", "test"], {}),
        ("split missing in a split folder", [*base, "--output-dir", out("d4"), "--split", "validation"],
         {"--data": bad["split_dir"]}),
        ("split of a folder without split files", [*base, "--output-dir", out("d5"), "--split", "test"],
         {"--data": bad["plain_dir"]}),
        ("eval data is the training data", [*base, "--output-dir", out("d6"), "--eval-data", str(data)], {}),
        ("eval data a copy of the training data", [*base, "--output-dir", out("d7"), "--eval-data", bad["copy"]], {}),
        ("rows without loss tokens only", [*base, "--output-dir", out("d8")], {"--data": bad["no_loss"]}),
        ("config file string for an int", [*base, "--output-dir", out("d9"), "--config", bad["str_int"]], {}),
        # a run that diverges
        ("learning rate 1e6 (NaN)", [*base, "--output-dir", out("n1"), "--learning-rate", "1e6", "--max-steps",
                                     "6", "--no-export"], {}),
    ]
    result = []
    for name, argv, swap in cases:
        argv = list(argv)
        for flag, value in swap.items():
            argv[argv.index(flag) + 1] = value
        result.append({"class": "train: flags, files, config", "name": name, "argv": argv, "expect": "refuse",
                       "fakes": True})
    # --resume means "resume if there is something to resume" (a preemptible job always passes it, as with
    # torchtitan): starting from step 0 is right, but it must be said.
    fresh = next(r for r in result if r["name"] == "resume with nothing to resume")
    fresh.update(expect="warn", must_say="--resume: no complete checkpoint in")
    said = {"data extension typo": "did you mean", "eval data extension typo": "did you mean",
            "data typo in the current folder": "did you mean chitchat.jsonl?",
            "data a Hub name while offline": "HF_HUB_OFFLINE=1 is set", "columns malformed": "expected ROLE=COLUMN",
            "columns with dataset format": "cannot apply", "other column names": "--columns user=query,assistant=reply",
            "columns naming a missing column": "column 'answer' (assistant) is missing"}
    for row in result:
        if row["name"] in said:
            row["must_say"] = said[row["name"]]
    return (result + round3_cases(work, base, model) + run_cases(work, base, other)
            + round4_cases(work, base, model, data) + round5_cases(work, base) + round6_cases(work, base))


# Extreme but valid widths (Qwen3.5-397B-A17B-like MoE, a 27B dense): sized on the meta device, never built.
HUGE_MOE = {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 60,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
            "linear_num_value_heads": 64, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024, "num_experts": 512,
            "num_experts_per_tok": 10}
HUGE_DENSE = {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "num_hidden_layers": 64,
              "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 17408,
              "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128}


def round3_cases(work: Path, base: list[str], model: Path) -> list[dict[str, Any]]:
    """Issue 22, round 3: --dry-run on extreme configs (hang: it must print within its 120 s, naming each
    stage), config files that spell a count as a number, and rows whose loss is only end-of-turn tokens."""
    def write(name: str, body: str) -> str:
        (work / "r3").mkdir(exist_ok=True)
        (work / "r3" / name).write_text(body)
        return str(work / "r3" / name)

    moe, dense = write("moe.json", json.dumps(HUGE_MOE)), write("dense.json", json.dumps(HUGE_DENSE))
    eager = write("eager.json", json.dumps({**HUGE_MOE, "experts_implementation": "eager"}))
    nproc = write("nproc.yaml", "nproc_per_node: 64\nnnodes: 2\n")
    user = {"role": "user", "content": "copy: abc"}
    empty = [{"messages": [user, {"role": "assistant", "content": c}]} for c in ("", " ", "\n\n")] * 8
    half = [*empty, *h.copy_task_rows(60)]
    lines = {"empty": empty, "half": half, "blank_text": [{"text": " \n"}] * 10}
    data = {k: write(f"{k}.jsonl", "".join(json.dumps(r) + "\n" for r in v)) for k, v in lines.items()}
    dry = ["-m", "kernelguard", "train", "--dry-run", "--tokenizer", base[base.index("--tokenizer") + 1],
           "--data", base[base.index("--data") + 1], "--output-dir", str(work / "runs" / "dry")]
    out = lambda name: str(work / "runs" / name)
    cases = [
        ("dry run: 397B-class MoE, 1M-token blocks, 64 ranks", [*dry, "--model", moe, "--max-length", "1048576",
         "--nproc-per-node", "64"], "ok", "building it on the meta device"),
        ("dry run: 27B dense, 131k blocks, grad accum 10000, 1e9 steps", [*dry, "--model", dense, "--max-length",
         "131072", "--gradient-accumulation-steps", "10000", "--max-steps", "1000000000"], "ok", "memory per rank"),
        ("dry run: MoE experts_implementation eager", [*dry, "--model", eager], "ok", "measured as grouped_mm"),
        ("dry run: --data missing", [*dry, "--model", str(model), "--data", str(work / "nope.jsonl")], "warn",
         "the run itself would be refused"),
        ("config file: nproc_per_node: 64 as a number", [*dry, "--model", str(model), "--config", nproc], "ok",
         "over 128 rank(s)"),
        ("only empty assistant answers", [*base, "--output-dir", out("r1"), "--data", data["empty"]], "refuse",
         "24 dropped with loss only on template tokens"),
        ("a quarter of the answers empty", [*base, "--output-dir", out("r2"), "--data", data["half"]], "warn",
         "24 dropped with loss only on template tokens (empty answers)"),
        ("whitespace-only text rows", [*base, "--output-dir", out("r3"), "--data", data["blank_text"]], "refuse",
         "10 dropped with loss only on template tokens"),
        ("eval fraction that holds out no row", [*base, "--output-dir", out("r4"), "--eval-fraction", "0.000001"],
         "refuse", "holds out none of the"),
    ]
    return [{"class": "train: round 3 (dry run, config counts, stop-only rows)", "name": n, "argv": a,
             "expect": e, "must_say": m, "fakes": True, "timeout": 120} for n, a, e, m in cases]


def _bad_assets(work: Path, data: Path) -> dict[str, str]:
    """Model folders and data files that each hold one mistake."""
    import gzip

    import tiny_models

    out: dict[str, str] = {}

    def folder(name: str, config: str | None = None, files: tuple[str, ...] = ()) -> Path:
        path = work / "bad" / name
        path.mkdir(parents=True)
        (path / "config.json").write_text(config if config is not None else
                                          (work / "model" / "config.json").read_text())
        for f in files:
            (path / f).write_bytes(b"x")
        out[name] = str(path)
        return path

    folder("no_weights")
    folder("shards", files=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"))
    folder("index").joinpath("model.safetensors.index.json").write_text('{"weight_map": {"a": "gone.safetensors"}}')
    folder("notjson", "{not json")
    folder("unknown", '{"model_type": "qwen99_next"}')
    folder("list", "[1, 2]")
    mismatch = work / "bad" / "mismatch"
    model = tiny_models.tiny_model("qwen3_5", vocab_size=h.VOCAB_SIZE, pad_token_id=0, eos_token_id=2)
    model.save_pretrained(str(mismatch))
    config = json.loads((mismatch / "config.json").read_text())
    config["intermediate_size"] = int(config.get("intermediate_size") or 128) * 2
    if "text_config" in config:
        config["text_config"]["intermediate_size"] = config["intermediate_size"]
    (mismatch / "config.json").write_text(json.dumps(config))
    out["mismatch"] = str(mismatch)
    rows = data.read_bytes()
    for name, body in (("gzip", gzip.compress(rows)), ("zstd", b"\x28\xb5\x2f\xfd" + rows)):
        (work / "bad" / f"{name}.jsonl").write_bytes(body)
        out[name] = str(work / "bad" / f"{name}.jsonl")
    for sub, files in (("split_dir", ("train.jsonl", "test.jsonl")), ("plain_dir", ("a.jsonl", "b.jsonl"))):
        (work / "bad" / sub).mkdir()
        for f in files:
            (work / "bad" / sub / f).write_bytes(rows)
        out[sub] = str(work / "bad" / sub)
    (work / "bad" / "copy.jsonl").write_bytes(rows)
    out["copy"] = str(work / "bad" / "copy.jsonl")
    empty = {"messages": [{"role": "user", "content": "hi"}]}
    (work / "bad" / "no_loss.jsonl").write_text((json.dumps(empty) + "\n") * 20)
    out["no_loss"] = str(work / "bad" / "no_loss.jsonl")
    (work / "bad" / "str_int.yaml").write_text("max_steps: '100'\n")
    out["str_int"] = str(work / "bad" / "str_int.yaml")
    return out


def run_cases(work: Path, base: list[str], other: Path) -> list[dict[str, Any]]:
    """Cases that need a finished run in the folder: they are built lazily by ``prepare`` before they run."""
    run_dir = str(work / "runs" / "done")
    return [
        {"class": "train: runs and checkpoints", "name": "same folder without --resume",
         "argv": [*base, "--output-dir", run_dir], "expect": "refuse", "fakes": True, "needs_run": run_dir},
        {"class": "train: runs and checkpoints", "name": "resume with other data",
         "argv": [*base, "--output-dir", run_dir, "--resume"], "swap": {"--data": str(other)}, "expect": "refuse",
         "fakes": True, "needs_run": run_dir},
        {"class": "train: runs and checkpoints", "name": "resume with other block size",
         "argv": [*base, "--output-dir", run_dir, "--resume", "--block-size", "512"], "expect": "refuse",
         "fakes": True, "needs_run": run_dir},
        {"class": "train: runs and checkpoints", "name": "resume, newest checkpoint truncated",
         "argv": [*base, "--output-dir", run_dir, "--resume", "--max-steps", "3"], "expect": "warn",
         "fakes": True, "needs_run": run_dir, "corrupt": "truncate-newest", "must_say": "will be replaced"},
        {"class": "train: runs and checkpoints", "name": "resume with --max-steps below the checkpoint",
         "argv": [*base, "--output-dir", run_dir, "--resume", "--max-steps", "1"], "expect": "refuse",
         "fakes": True, "needs_run": run_dir},
        {"class": "train: runs and checkpoints", "name": "resume-anyway with a wider model",
         "argv": [*base, "--output-dir", run_dir, "--resume", "--resume-anyway", "--max-steps", "3"],
         "swap": {"--model": str(work / "wide" / "config.json")}, "expect": "refuse", "fakes": True,
         "needs_run": run_dir, "must_say": "another shape"},
        {"class": "train: runs and checkpoints", "name": "resume, every checkpoint corrupt",
         "argv": [*base, "--output-dir", run_dir, "--resume", "--max-steps", "4"], "expect": "refuse",
         "fakes": True, "needs_run": run_dir, "corrupt": "flip-all"},
    ]


R4 = "train/export: round 4 (issue 32: weights that lie, exports that race, start-up)"
HUNT = "train/export: round 4, own hunt"


def round4_cases(work: Path, base: list[str], model: Path, data: Path) -> list[dict[str, Any]]:
    """Issue 32: weight files that lie, exports that race or forget, paths and variables checked in preflight,
    signals while the launcher starts, config files, input formats; then this round's own hunt (HUNT)."""
    import bad_weights

    w = bad_weights.folders(work / "r4w")
    done = str(work / "runs" / "done4")  # its own run: run_cases corrupt "done"; mutating cases use copies
    step = "{RUN}/checkpoints/step_2"
    out = lambda name: str(work / "runs" / name)
    r4 = work / "r4"
    r4.mkdir(exist_ok=True)
    (r4 / "a_file").write_text("x")
    (r4 / "dup.yaml").write_text("max_steps: 2\nlearning_rate: 1.0e-4\nmax_steps: 50\n")
    (r4 / "tilde.yaml").write_text("eval_data: ~/kg-sweep-no-such-file.jsonl\n")  # a key the command line does not set
    (r4 / "deep.json").write_text(json.dumps({**json.loads(model.read_text()), "num_hidden_layers": 50000,
                                              "layer_types": ["linear_attention"] * 49999 + ["full_attention"]}))
    (r4 / "m.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 64)
    (r4 / "unknown.json").write_text('{"model_type": "qwen99_next"}')
    (r4 / "dangling").symlink_to(r4 / "gone")
    (r4 / "object.json").write_text(json.dumps({"a": {"messages": []}, "b": {"messages": []}}, indent=1))
    saved = r4 / "saved"
    saved.mkdir()
    for name in ("state.json", "dataset_info.json", "data-00000-of-00001.arrow"):
        (saved / name).write_text("{}")
    (r4 / "existing").mkdir()
    train = lambda name, *extra, swap=None: [*base, "--output-dir", out(name), *extra]
    export = ["-m", "kernelguard", "export", step]
    # Cases that change the run or its inputs get a copy of both (copy_run); {RUN} is the run folder used.
    cases: list[tuple[str, str, list[str], str, str | None, dict[str, Any]]] = [
        # weights that lie (refused before run.json is written, each naming tensor and file)
        (R4, "header dtype that does not fit its bytes", train("w1"), "refuse", "do not fit the bytes",
         {"swap": {"--model": w["dtype_bytes"]}, "no_run_json": out("w1")}),
        (R4, "f32 bytes under a bf16 header", train("w2"), "refuse", "values that cannot be weights",
         {"swap": {"--model": w["f32_as_bf16"]}}),
        (R4, "a tensor in two shards, one not in the index", train("w3"), "refuse", "in more than one file",
         {"swap": {"--model": w["two_files"]}}),
        (R4, "index names a shard that lacks the tensor", train("w4"), "refuse", "in a file that lacks them",
         {"swap": {"--model": w["index_lies"]}}),
        (R4, "an unexpected extra tensor", train("w5", "--no-export"), "warn", "(UNEXPECTED)",
         {"swap": {"--model": w["unexpected"]}, "max_steps": "1"}),
        (R4, "tied embeddings, a different lm_head in the file", train("w6"), "refuse",
         "contradict tie_word_embeddings", {"swap": {"--model": w["tied_head"]}}),
        (R4, "multimodal config without vision weights", train("w7"), "refuse", "no vision tower",
         {"swap": {"--model": w["no_vision"]}}),
        (R4, "a truncated shard (named before run.json)", train("w8"), "refuse", "(truncated",
         {"swap": {"--model": w["truncated"]}, "no_run_json": out("w8")}),
        # exports that race or forget
        (R4, "export into a live run", [*export, "--output", out("e1")], "refuse", "is in use (pid",
         {"needs_run": done, "hold_lock": done}),
        (R4, "export to an existing --output", [*export, "--output", str(r4 / "existing")], "refuse",
         "already exists", {"needs_run": done}),
        (R4, "export after the tokenizer changed (the checkpoint's copy is used)", [*export, "--output", out("e3")],
         "ok", "kernelguard export: wrote", {"needs_run": done, "copy_run": "e3", "change_tokenizer": True}),
        (R4, "export with the model folder deleted", [*export, "--output", out("e4")], "ok",
         "kernelguard export: wrote", {"needs_run": done, "copy_run": "e4", "hide_model": True}),
        (R4, "export to a place this user cannot write", [*export, "--output", "/proc/sys/kg-export"], "refuse",
         "not writable", {"needs_run": done}),
        (R4, "disk full during the export", [*export, "--output", out("e6")], "refuse", "No space left on device",
         {"needs_run": done, "fault": "export", "gone": [out("e6"), out("e6") + ".tmp"]}),
        (R4, "two exports to one --output at once (two runs)", [*export, "--output", out("e7")], "race", None,
         {"needs_run": done, "fault": "export-slow", "copy_run": "e7a", "second_copy": "e7b"}),
        # paths and variables, before anything is written or any rank starts
        (R4, "--profile-trace under a plain file", train("p1", "--nproc-per-node", "2", "--profile-trace",
         str(r4 / "a_file" / "traces")), "refuse", "is a file, not a folder", {"no_run_json": out("p1")}),
        (R4, "KERNELGUARD_ERROR_WAIT_S not a number", train("p2", "--nproc-per-node", "2"), "refuse",
         "KERNELGUARD_ERROR_WAIT_S='ten'", {"env": {"KERNELGUARD_ERROR_WAIT_S": "ten"}}),
        # the launcher
        (R4, "--nnodes 2 without a rendezvous endpoint", train("l1", "--nproc-per-node", "1", "--nnodes", "2"),
         "refuse", "no --rdzv-endpoint", {"timeout": 90}),
        (R4, "dry run with 50,000 layers", ["-m", "kernelguard", "train", "--dry-run", "--model", str(r4 / "deep.json"),
         "--data", str(data), "--output-dir", out("l2")], "refuse", "builds at most 1,024", {"timeout": 120}),
        (R4, "Ctrl-C while the launcher starts", train("l3", "--nproc-per-node", "2"), "signal",
         "interrupted before training started", {"signal": ("SIGINT", 1.0, 130)}),
        (R4, "SIGTERM while the launcher starts", train("l4", "--nproc-per-node", "2"), "signal",
         "stopped by SIGTERM before training started", {"signal": ("SIGTERM", 1.0, 143)}),
        # earlier silent ones
        (R4, "config file with a key given twice", train("c1", "--config", str(r4 / "dup.yaml")), "refuse",
         "is given twice", {}),
        (R4, "~ in a config-file path", train("c2", "--config", str(r4 / "tilde.yaml")), "refuse",
         str(Path.home() / "kg-sweep-no-such-file.jsonl"), {}),
        (R4, "resume, newest checkpoint's marker gone", [*base, "--output-dir", "{RUN}", "--resume", "--max-steps",
         "3"], "warn", "has no COMPLETE marker", {"needs_run": done, "copy_run": "c3", "corrupt": "unmark-newest"}),
        # input formats, named
        (R4, "GGUF file to check --model", ["-m", "kernelguard", "check", "--model", str(r4 / "m.gguf")], "refuse",
         "is a GGUF file", {"fakes": False}),
        (R4, "GGUF file to train --model", train("i2"), "refuse", "is a GGUF file",
         {"swap": {"--model": str(r4 / "m.gguf")}}),
        (R4, "datasets save_to_disk folder to --data", train("i3"), "refuse", "save_to_disk folder",
         {"swap": {"--data": str(saved)}}),
        (R4, "a JSON object file to --data", train("i4"), "refuse", "is one JSON object",
         {"swap": {"--data": str(r4 / "object.json")}}),
        (R4, "model_type transformers does not know (check)", ["-m", "kernelguard", "check", "--model",
         str(r4 / "unknown.json")], "refuse", "does not know this model type", {"fakes": False}),
        (R4, "dangling symlink as --data", train("i6"), "refuse", "is a symbolic link to",
         {"swap": {"--data": str(r4 / "dangling")}}),
        (R4, "dangling symlink as --model", train("i7"), "refuse", "is a symbolic link to",
         {"swap": {"--model": str(r4 / "dangling")}}),
        # this round's own hunt
        (HUNT, "safetensors header naming a tensor twice", train("h1"), "refuse", "named twice in one header",
         {"swap": {"--model": w["key_twice"]}}),
        (HUNT, "overlapping byte ranges in a header", train("h2"), "refuse", "overlap or leave gaps",
         {"swap": {"--model": w["overlap"]}}),
        (HUNT, "stray adapter .safetensors beside the weights", train("h3", "--no-export"), "warn", "(UNEXPECTED)",
         {"swap": {"--model": w["stray_adapter"]}, "max_steps": "1"}),
        (HUNT, "export --output over the run folder with --overwrite", [*export, "--output", "{RUN}", "--overwrite"],
         "refuse", "would put the export over the run", {"needs_run": done}),
        (HUNT, "export of OUT/checkpoints (not a step)", ["-m", "kernelguard", "export", "{RUN}/checkpoints",
         "--output", out("h5")], "refuse", "The complete checkpoints of", {"needs_run": done}),
        (HUNT, "KERNELGUARD_ERROR_WAIT_S=nan", train("h6", "--nproc-per-node", "2"), "refuse",
         "KERNELGUARD_ERROR_WAIT_S='nan'", {"env": {"KERNELGUARD_ERROR_WAIT_S": "nan"}}),
        (HUNT, "JSON file of one pretty-printed row object", train("h7"), "refuse", "is one JSON object",
         {"swap": {"--data": str(r4 / "object.json")}}),
    ]
    rows = []
    for klass, name, argv, expect, must_say, extra in cases:
        argv = list(argv)
        if "max_steps" in extra:
            argv[argv.index("--max-steps") + 1] = extra.pop("max_steps")
        for flag, value in extra.pop("swap", {}).items():
            argv[argv.index(flag) + 1] = value
        rows.append({"class": klass, "name": name, "argv": argv, "expect": expect, "must_say": must_say,
                     "fakes": extra.pop("fakes", True), **extra})
    for row in rows:  # no copy: {RUN} is the shared run itself
        if row.get("needs_run"):
            row["run_argv"] = [*base, "--output-dir", done]
        if not row.get("copy_run"):
            row["argv"] = [a.replace("{RUN}", done) for a in row["argv"]]
    return rows


R5 = "train/export: round 5 (issue 42)"


def round5_cases(work: Path, base: list[str]) -> list[dict[str, Any]]:
    """Issue 42: the run's identity (class 1), asked for and silently not done (2), start-up signals (3), errors
    that name the wrong source (4), a valid YAML merge key (5). Resumes that are refused share round 4's run; one that trains copies it."""
    done, r5 = str(work / "runs" / "done4"), work / "r5"
    fp32 = str(work / "runs" / "done5-fp32")
    r5.mkdir(exist_ok=True)
    (r5 / "merge.yaml").write_text("<<: &common\n  learning_rate: 1.0e-4\n  seed: 1\nseed: 2\n")
    train = lambda name, *extra: [*base, "--output-dir", str(work / "runs" / name), *extra]
    resume = lambda run, *extra: [*base, "--output-dir", run, "--resume", *extra]
    export = ["-m", "kernelguard", "export", done + "/checkpoints/step_2"]
    leaky = ("--packing", "leaky", "--allow", "packed-without-boundaries")
    # 4: a transformers whose import fails (a dependency that raises), a lock of a newer schema
    (broken := r5 / "broken-site" / "huggingface_hub").mkdir(parents=True, exist_ok=True)
    (broken / "__init__.py").write_text("raise ImportError('half-upgraded huggingface_hub')\n")
    broken = broken.parent
    (newer := r5 / "newer.lock").write_text('{"kernelguard_lock": 2, "stack": {"kernelguard": "9.9.9"}}')
    check_allowing_all = ["-m", "kernelguard", "check", "--no-packed", "--allow", "causal_conv1d_fn", "--allow",
                          "chunk_gated_delta_rule", "--allow", "attention"]
    # 5: [tool.kernelguard] model paths are the file's folder's
    for name, model in (("proj", "./models/missing"), ("proj2", "models/tiny")):
        (r5 / name / "sub").mkdir(parents=True, exist_ok=True)
        (r5 / name / "pyproject.toml").write_text(f'[tool.kernelguard]\nmodel = "{model}"\n')
    (r5 / "proj2" / "models" / "tiny").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "bench" / "configs" / "qwen3_5_k64.json", r5 / "proj2" / "models" / "tiny" / "config.json")
    cases: list[tuple[str, list[str], str, str | None, dict[str, Any]]] = [
        # 1: the run's identity holds every setting that changes the numbers
        ("resume a bf16 run with --param-dtype fp32", resume(done, "--param-dtype", "fp32"), "refuse",
         "was trained with --param-dtype bf16; now --param-dtype fp32", {"needs_run": done}),
        ("resume an fp32 run with --param-dtype bf16", resume(fp32, "--param-dtype", "bf16"), "refuse",
         "was trained with --param-dtype fp32; now --param-dtype bf16", {"needs_run": fp32,
         "run_argv": [*base, "--output-dir", fp32, "--param-dtype", "fp32", "--no-export"]}),
        ("resume a packed run as --packing leaky", resume(done, *leaky), "refuse",
         "was trained with --packing packed; now --packing leaky", {"needs_run": done}),
        ("resume with --loss logits (harmless)", [*base, "--output-dir", "{RUN}", "--resume", "--loss", "logits",
         "--no-export"], "warn", "now --loss logits: accepted", {"needs_run": done, "copy_run": "r5h", "max": "3"}),
        # 2: asked for, silently not done
        ("--profile-step 50 with --max-steps 3", train("r5p1", "--profile-step", "50"), "refuse",
         "is after the run's last step (--max-steps 3)", {"max": "3"}),
        ("a 3-step run asked to profile every step", train("r5p2", "--profile-step", "1", "--profile-every", "1",
         "--no-export"), "ok", "profile (1 window(s))", {"max": "3"}),
        ("--profile-trace ''", train("r5p3", "--profile-trace", ""), "refuse", "profile_trace is empty", {}),
        ("--output-dir '' (an unset variable)", [*base, "--output-dir", ""], "refuse", "output_dir is empty",
         {"cwd": r5}),
        ("export --output ''", [*export, "--output", ""], "refuse", "--output: is empty", {"needs_run": done}),
        ("export --max-shard-size 1KB", [*export, "--output", str(r5 / "small"), "--max-shard-size", "1KB"], "warn",
         "files (more than 16 files under 100 MB each", {"needs_run": done}),
        # 4: errors that name the real source
        ("KERNELGUARD_LOCK at a missing file", train("r5l1"), "refuse", "KERNELGUARD_LOCK=/no/such/kernelguard.lock",
         {"env": {"KERNELGUARD_LOCK": "/no/such/kernelguard.lock"}}),
        ("KERNELGUARD_LOCK at a directory", train("r5l2"), "refuse", f"KERNELGUARD_LOCK={r5} is a directory",
         {"env": {"KERNELGUARD_LOCK": str(r5)}}),
        ("kernelguard lock --output DIR", ["-m", "kernelguard", "lock", "--output", str(r5)], "refuse",
         "is a directory; the lock is written to a file", {"fakes": False}),
        ("a full disk while a rank writes its RNG state", train("r5d", "--save-steps", "1", "--no-export"),
         "refuse", "No space left on device (ENOSPC)", {"max": "2", "fault": "checkpoint-rng:step_1"}),
        ("transformers installed, its import broken", check_allowing_all, "refuse",
         "import transformers raises", {"fakes": False, "env": {"PYTHONPATH": f"{broken}{os.pathsep}{ROOT}"}}),
        ("a lock written by a newer kernelguard", ["-m", "kernelguard", "check", "--lock", str(newer)], "refuse",
         "pip install --force-reinstall --no-deps 'kernelguard==9.9.9'", {"fakes": False}),
        ("a missing relative model path in pyproject.toml", ["-m", "kernelguard", "check"], "refuse",
         f"in [tool.kernelguard] of {r5 / 'proj' / 'pyproject.toml'}", {"fakes": False, "cwd": r5 / "proj" / "sub"}),
        # 3: a signal while the command line itself starts (before kernelguard.cli.entry, it was a traceback or a
        # death without a word; the full picture at many delays: bench/cpu/startup_signals.py)
        ("Ctrl-C 0.2 s into check", ["-m", "kernelguard", "check", "--model", "qwen3_5"], "signal",
         "kernelguard: interrupted.", {"signal": ("SIGINT", 0.2, 130), "fakes": False}),
        ("SIGTERM 0.2 s into train", train("r5s1"), "signal", "stopped by SIGTERM before training started",
         {"signal": ("SIGTERM", 0.2, 143)}),
        # 5: a valid input accepted
        ("YAML merge key in a --config file", train("r5y", "--config", str(r5 / "merge.yaml"), "--no-export"), "ok",
         None, {"max": "1"}),
        ("a relative model path in pyproject.toml, from a subfolder", check_allowing_all, "ok", None,
         {"fakes": False, "cwd": r5 / "proj2" / "sub"}),
    ]
    rows = []
    for name, argv, expect, must_say, extra in cases:
        if "max" in extra:
            argv[argv.index("--max-steps") + 1] = extra.pop("max")
        if extra.get("needs_run") == done:
            extra["run_argv"] = [*base, "--output-dir", done]
        if not extra.get("copy_run"):
            argv = [a.replace("{RUN}", done) for a in argv]
        rows.append({"class": R5, "name": name, "argv": argv, "expect": expect, "must_say": must_say,
                     "fakes": extra.pop("fakes", True), **extra})
    return rows


R6 = "train/export: round 6 (issue 52)"


def round6_cases(work: Path, base: list[str]) -> list[dict[str, Any]]:
    """Issue 52's regressions: a did-you-mean that turned a typo into another job, an unfinished save outside
    its run without a fix."""
    (unsealed := work / "r6" / "step_4.tmp").mkdir(parents=True, exist_ok=True)
    out = str(work / "runs" / "r6")
    sharegpt = work / "r6" / "sharegpt.jsonl"
    sharegpt.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"copy ab{i}"},
                                                              {"from": "gpt", "value": f"ab{i}"}]}) + "\n"
                                for i in range(40)))
    with_data = [a if a != base[base.index("--data") + 1] else str(sharegpt) for a in base]
    cases = [
        ("--nope 3 (difflib's nearest is --nnodes: a 3-node launch)", [*base, "--output-dir", out, "--nope", "3"],
         "refuse", "Fix: kernelguard train --help"),
        ("--learning-rat 3e-4 (a slip: the corrected command)", [*base, "--output-dir", out, "--learning-rat", "3e-4"],
         "refuse", "did you mean --learning-rate?"),
        ("export an unfinished save outside its run", ["-m", "kernelguard", "export", str(unsealed)], "refuse",
         "Fix: pass a complete checkpoint"),
        ("--profile-step 1 (inside the warm-up): the step profiled instead is said",
         [*base, "--output-dir", out + "p", "--profile-step", "1", "--no-export"], "ok",
         "--profile-step 1: profiled step 2 instead"),
        ("ShareGPT rows (conversations of from/value turns)", [*with_data, "--output-dir", out + "s", "--no-export"],
         "ok", "data: ShareGPT conversations"),
        ("no --output-dir: the fix is the command completed, not a placeholder", base, "refuse",
         "--output-dir runs/"),
    ]
    rows = [{"class": R6, "name": name, "argv": argv, "expect": expect, "must_say": must_say, "fakes": True}
            for name, argv, expect, must_say in cases]
    rows.append({"class": R6, "name": "--allow a,b (comma-joined, as KERNELGUARD_ALLOW is written)", "expect": "ok",
                 "argv": [*base, "--output-dir", out + "a", "--no-export", "--packing", "none", "--allow",
                          "causal_conv1d_fn,chunk_gated_delta_rule"], "must_say": None, "fakes": False})
    # A full disk at each write site of a run, one code path each (tests/fault_hooks: the file on /dev/full).
    # The DCP shards, the RNG state and the export's shards have their own faults (rounds 4 and 5).
    sites = {".kernelguard.lock": "the run folder's lock", "run.json": "the run's identity",
             "train_config.json": "the run's configuration", "metrics.jsonl": "the metrics log",
             ".metadata": "a checkpoint's DCP metadata", "trainer.json": "a checkpoint's trainer state",
             "source.json": "a checkpoint's source record", "manifest.json": "a checkpoint's manifest",
             "COMPLETE": "a checkpoint's seal", "chat_template.jinja": "the export's template"}  # fmt: skip
    for i, (name, what) in enumerate(sites.items()):
        rows.append({"class": R6, "name": f"a full disk writing {what} ({name})", "expect": "refuse",
                     "argv": [*base, "--output-dir", out + f"d{i}"], "must_say": "No space left on device (ENOSPC)",
                     "fakes": True, "fault": f"enospc-file:{name}"})
    rows.append({"class": R6, "name": "a full disk writing metrics.png (after the export: a warning)", "expect": "ok",
                 "argv": [*base, "--output-dir", out + "d-png", "--plot"], "fakes": True,
                 "must_say": "metrics.png not written: No space left on device (ENOSPC)",
                 "fault": "enospc-file:metrics.png"})
    return rows


def copy_run(run_dir: Path, dest: Path) -> Path:
    """``run_dir`` and the inputs its train_config.json names, under ``dest``; returns the copied run."""
    saved = json.loads((run_dir / "train_config.json").read_text())
    dest.mkdir(parents=True)
    for key in ("model", "tokenizer"):
        source = Path(saved[key])
        target = dest / f"{key}-{source.name}"
        (shutil.copytree if source.is_dir() else shutil.copyfile)(source, target)
        saved[key] = str(target)
    shutil.copytree(run_dir, dest / "run")
    (dest / "run" / "train_config.json").write_text(json.dumps(saved))
    return dest / "run"


def prepare(case: dict[str, Any], base_done: set[str], work: Path) -> None:
    run_dir = case.get("needs_run")
    if run_dir and run_dir not in base_done:
        argv = list(case.get("run_argv", case["argv"]))
        argv = [a for a in argv if a not in ("--resume",)]
        if "--block-size" in argv:
            argv[argv.index("--block-size") + 1] = "256"
        proc = run(argv, cwd=work, fakes=True)
        if proc.returncode != 0:
            raise SystemExit(f"could not make the run to resume:\n{proc.stderr[-2000:]}")
        base_done.add(run_dir)
    if case.get("swap"):
        for flag, value in case["swap"].items():
            case["argv"][case["argv"].index(flag) + 1] = value
    if case.get("copy_run") and run_dir:
        copied = copy_run(Path(run_dir), work / "copies" / case["copy_run"])
        if case.get("second_copy"):
            second = copy_run(Path(run_dir), work / "copies" / case["second_copy"])
            case["argv2"] = [a.replace("{RUN}", str(second)) for a in case["argv"]]
        case["argv"] = [a.replace("{RUN}", str(copied)) for a in case["argv"]]
        run_dir = str(copied)
    if case.get("corrupt") == "unmark-newest" and run_dir:
        newest = max(Path(run_dir, "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
        (newest / "COMPLETE").unlink()
        return
    if case.get("change_tokenizer") and run_dir:
        saved = json.loads(Path(run_dir, "train_config.json").read_text())
        config = Path(saved["tokenizer"]) / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": "{{ 'changed' }}"}))
    if case.get("hide_model") and run_dir:
        saved = json.loads(Path(run_dir, "train_config.json").read_text())
        Path(saved["model"]).rename(Path(saved["model"]).with_name("moved-away.json"))
    if case.get("corrupt") and run_dir:
        shards = sorted(Path(run_dir).rglob("*.distcp")) or sorted(Path(run_dir).rglob("*.pt"))
        shards = [s for s in shards if "checkpoint" in str(s)]
        targets = shards[-1:] if case["corrupt"] == "truncate-newest" else shards
        for shard in targets:
            data = bytearray(shard.read_bytes())
            if case["corrupt"] == "truncate-newest":
                shard.write_bytes(bytes(data[: len(data) // 2]))
            else:
                data[len(data) // 2] ^= 0xFF
                shard.write_bytes(bytes(data))


@contextlib.contextmanager
def held_lock(folder: str | None) -> Iterator[None]:
    """A real process holding ``folder``'s run lock for the duration (a live run, as far as anyone can tell)."""
    if folder is None:
        yield
        return
    code = ("import sys, time; from pathlib import Path; from kernelguard.train.common.run_folder_lock import acquire\n"
            "lock = acquire(Path(sys.argv[1]), argv=['kernelguard', 'train', '(live run)']); print('held', flush=True)\n"
            "time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, folder], env=environment(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()


def run_case(case: dict[str, Any], work: Path) -> subprocess.CompletedProcess[str]:
    """One case; a ``race`` runs its command twice at once, a ``signal`` case signals it while it starts."""
    kind, timeout = case["expect"], case.get("timeout", 600)
    env = environment(fakes=case.get("fakes", False), extra=case.get("env"), fault=case.get("fault"))
    if kind not in ("race", "signal"):
        return run(case["argv"], cwd=case.get("cwd", work), fakes=case.get("fakes", False), timeout=timeout,
                   env=case.get("env"), fault=case.get("fault"))
    copies = 2 if kind == "race" else 1
    argvs = [case["argv"], case.get("argv2", case["argv"])][:copies]
    # A sweep started in the background (nohup, `&`) ignores SIGINT, and children inherit that: give them the
    # default, as a terminal's foreground job has.
    procs = [subprocess.Popen([sys.executable, *argv], cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509 - no threads
             for argv in argvs]
    if kind == "signal":
        name, delay, _ = case["signal"]
        time.sleep(delay)
        os.killpg(procs[0].pid, getattr(signal, name))  # Ctrl-C reaches the whole foreground group
    outs = [p.communicate(timeout=timeout) for p in procs]
    codes = [p.returncode for p in procs]
    err = "\n".join(e for _, e in outs)
    proc = subprocess.CompletedProcess(case["argv"], max(codes), "", err)
    if "Traceback (most recent call last)" in err:
        verdict = "traceback"
    elif kind == "race":
        output = Path(case["argv"][case["argv"].index("--output") + 1])
        complete = (output / "config.json").is_file() and not output.with_name(output.name + ".tmp").exists()
        refused = next((e for (_, e), c in zip(outs, codes) if c == 2), "")
        said = "another export is writing" in refused or "already exists" in refused or "is in use" in refused
        verdict = "clear" if sorted(codes) == [0, 2] and complete and said else ("loss" if not complete else "unclear")
    else:
        lines = [line for line in err.splitlines() if line.strip() and "warning:" not in line]
        verdict = "clear" if codes[0] == case["signal"][2] and len(lines) == 1 and case["must_say"] in lines[0] \
            else "unclear"
    proc.verdict = verdict  # type: ignore[attr-defined]
    return proc


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--out")
    args.add_argument("--only", help="substring of the case classes to run (e.g. 'round 4')")
    args.add_argument("--names", help="substrings of the case names to run, comma-separated")
    args.add_argument("--strict", action="store_true",
                      help="exit 1 unless every case is clear, listing the others (CI runs it so)")
    opts = args.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kg-sweep-"))
    cases = check_cases(work) + api_cases() + train_cases(work)
    if opts.only:
        cases = [c for c in cases if opts.only in c["class"]]
    if opts.names:
        cases = [c for c in cases if any(n in c["name"] for n in opts.names.split(","))]
    rows, made = [], set()
    for case in cases:
        prepare(case, made, work)
        start = time.perf_counter()
        try:
            with held_lock(case.get("hold_lock")):
                proc = run_case(case, work)
        except subprocess.TimeoutExpired as e:
            proc = subprocess.CompletedProcess(e.cmd, -9, "", "(no result before the timeout)")
            case = {**case, "expect": "hang"}
        expect = case["expect"]
        if expect == "hang":
            verdict = "hang"
        elif expect in ("race", "signal"):
            verdict = proc.verdict  # type: ignore[attr-defined]
        elif expect == "exit3":
            verdict = "clear" if proc.returncode == 3 else ("traceback" if "Traceback" in proc.stderr else "unclear")
        else:
            verdict = classify(proc, expect, case.get("must_say"))
            left = [p for p in case.get("gone", []) if Path(p).exists()]
            run_json = case.get("no_run_json")
            if verdict == "clear" and (left or (run_json and Path(run_json, "run.json").exists())):
                verdict = "loss" if left else "unclear"  # a half-written folder, or run.json before the refusal
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        first = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
        rows.append({"class": case["class"], "name": case["name"], "exit": proc.returncode, "verdict": verdict,
                     "first_line": first[:200], "seconds": round(time.perf_counter() - start, 1)})
        print(f"{verdict:9s} {proc.returncode:3d}  {case['class']}: {case['name']}: {first[:120]}", flush=True)
    counts = Counter(r["verdict"] for r in rows)
    by_class: dict[str, Counter[str]] = {}
    for r in rows:
        by_class.setdefault(r["class"], Counter())[r["verdict"]] += 1
    summary = {"cases": len(rows), "counts": dict(counts),
               "by_class": {k: dict(v) for k, v in by_class.items()}, "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1))
    if opts.out:
        Path(opts.out).write_text(json.dumps(summary, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    unclear = [r for r in rows if r["verdict"] != "clear"]
    if opts.strict and unclear:
        print(f"{len(unclear)} of {len(rows)} cases not clear:", file=sys.stderr)
        for r in unclear:
            print(f"  {r['verdict']}: {r['class']}: {r['name']}: {r['first_line']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
