"""`kernelguard train`: packed FSDP2 supervised fine-tuning that starts only once the guard passes.

    kernelguard train --nproc-per-node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] \\
        --model DIR_OR_CONFIG_JSON [--tokenizer DIR] --data FILE_DIR_OR_NAME \\
        --max-length 8192 --output-dir DIR [--max-steps N] [--resume] [--allow ID ...] [--config FILE]

(or ``torchrun --nproc-per-node N -m kernelguard.train ...`` with the same training flags).

Order of work: preflight (flags, inputs exist, output writable with room for a checkpoint, run identity;
a folder holding a run needs --resume or --overwrite; --resume verifies checkpoints) -> on CUDA, the stack
check (``kernelguard check`` for this model: known-bad stacks, extensions that crash on import, probed in a
child) -> build the model on the meta device -> ``guard(model, mode="training", packed=True, allow=...)``
(refuses with exit 3 before any data is read) -> load, validate and tokenize the data (and the eval set) ->
best-fit-decreasing packing into 1D blocks -> claim the output folder (run.json, train_config.json) ->
regional torch.compile (``--compile``) + activation checkpointing (``auto``: off when the memory
estimate fits) + FSDP2 -> weights from rank 0 -> resume -> train (eval every --eval-every steps) ->
atomic, checksummed DCP checkpoints -> safetensors export (``OUTPUT/final``) -> ``metrics.jsonl`` +
``metrics.png``.

Exit codes: 0 ok; 2 usage, config or data error; 3 the guard refused. ``kernelguard train --nproc-per-node``
returns those codes from the ranks with the message printed once; plain ``torchrun`` exits 1 whenever a rank
fails and prints each rank's exit code in its ChildFailedError table.

Modules: config (the schema: TrainConfig's sections, one field per flag, the saved train_config.json),
config_rules (the one table of rules, the checks each section runs), config_cli (argparse and --help derived
from the schema, launcher options), config_file (--config files), launch (the --nproc-per-node launcher),
preflight (checks before any expensive work, output claim), identity (run identity, run.json), gate (the one
gate), data / rows / encode / chat_templates (files -> rows -> validated items -> examples, training chat
templates), packing (bin packing, block tensors), build (model, FSDP2, optimizer), step (the optimizer step,
data plan, LR schedule), compile (regional torch.compile), evaluate (held-out loss), parallel (process group, meta model, AC, FSDP2),
checkpoint (verified DCP save/resume, retention, export), memory (--dry-run estimate), metrics (FLOPs, MFU,
JSONL, trackers, plot), loop (the run), __main__ (entry point).
"""

__all__: list[str] = []
