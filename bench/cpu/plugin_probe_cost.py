"""What `pytest --kernelguard-probe` adds to a test: the first packed row of each model instance run again
example by example (kernelguard.runtime.equivalence), on CPU with the fake fla / causal-conv1d (tests/fake_providers).

    PYTHONPATH=.:tests:tests/fake_providers python bench/cpu/plugin_probe_cost.py [--repeats 7]

Per repeat: a fresh tiny Qwen3.5 (hidden 64, 4 layers) and a fresh ModelCallWatch (what the plugin arms per test),
then one forward of a bounded packed row (3 examples, 12 tokens) and a second forward of it, both without
autograd, then a third with autograd on (a test that trains after it evaluates); with the probe off and on,
interleaved. The probe runs on the first forward and again on the third (another path: the probe measures again
when autograd switches); the second shows that a call on a measured path adds nothing. Medians, in ms; prints
one JSON line."""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    import tiny_models
    import torch
    from transformers import DataCollatorWithFlattening

    from kernelguard.resolution.policy import AllowPolicy
    from kernelguard.runtime.boundaries import ModelCallWatch
    from kernelguard.runtime.registry import REGISTRY

    features = [{"input_ids": [3, 4, 5, 6, 7]}, {"input_ids": [8, 9, 10]}, {"input_ids": [11, 12, 13, 14]}]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    batch = {k: v for k, v in batch.items() if k != "labels"}
    times: dict[str, dict[str, list[float]]] = {m: {"first": [], "second": [], "grad": []} for m in ("off", "on")}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            model = tiny_models.tiny_model("qwen3_5")
            watch = ModelCallWatch(AllowPolicy.parse(("attention",)), probe=mode == "on")
            try:
                for which in ("first", "second", "grad"):
                    with torch.set_grad_enabled(which == "grad"):
                        t0 = time.perf_counter()
                        model(**batch)
                        times[mode][which].append(1e3 * (time.perf_counter() - t0))
            finally:
                watch.disarm()
                REGISTRY.reset()
    med = {m: {w: round(statistics.median(v), 2) for w, v in d.items()} for m, d in times.items()}
    print(json.dumps({"median_ms": med, "probe_first_call_extra_ms": round(med["on"]["first"] - med["off"]["first"], 2),
                      "probe_path_switch_extra_ms": round(med["on"]["grad"] - med["off"]["grad"], 2),
                      "repeats": args.repeats, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
