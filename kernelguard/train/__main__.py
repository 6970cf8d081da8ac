"""`kernelguard train ...`, `kernelguard train --nproc-per-node N ...` or `torchrun ... -m kernelguard.train`.

Exit codes (the table in kernelguard.errors): 0 ok; 2 usage, config or data error (nothing trained, nothing
half-written left behind); 3 the guard refused to start because a kernel would run a slow fallback that was not
``--allow``-ed; 4 the loss or gradient norm became NaN/inf (the last good checkpoint is kept); 130 interrupted
(Ctrl-C); 143 stopped by SIGTERM after saving a checkpoint of the last finished step (``--resume`` continues
exactly). One run per ``--output-dir`` at a time (kernelguard.train.common.run_folder_lock).
With ``--nproc-per-node`` (kernelguard.train.launch) the same codes come back from the ranks; plain
``torchrun`` exits 1 whenever a rank fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from kernelguard.errors import (
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    INTERRUPTED_LINES,
    ConfigError,
    DataError,
    GuardRefused,
    KernelGuardError,
    Preempted,
    TrainingDiverged,
    exit_code_for,
)

from .settings.config_cli import LaunchOptions

__all__ = ["is_rank0", "main", "print_rank0"]

_INTERRUPTED_LINE = INTERRUPTED_LINES["train"]["SIGINT"]


def is_rank0() -> bool:
    """Rank 0 of a torchrun job (or the only process), known before the process group exists."""
    return int(os.environ.get("RANK", "0")) == 0


def print_rank0(message: str) -> None:
    """Print once per job (rank 0), to stderr, flushed: output fit for logs of many ranks."""
    if is_rank0():
        print(message, file=sys.stderr, flush=True)


def _fail(
    code: int, message: str, *, report: str | None = None, is_main: bool | None = None,
    error: BaseException | None = None,
) -> int:
    """Report an error once: through the launcher's record file in a launched rank, else on rank 0."""
    from kernelguard.stack import wrap_message

    from .launch import write_rank_error, write_torchelastic_error

    write_torchelastic_error(message)
    if not write_rank_error(code, message, report, error=error) and (is_rank0() if is_main is None else is_main):
        if report:
            print(report, file=sys.stderr)
        print(wrap_message(message), file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """The entry point: :func:`_main`, with Ctrl-C and SIGTERM during start-up (imports, parsing, the checks,
    the launcher's set-up: before any rank exists or training began) ending in one line and their exit
    code, never a traceback. Once training runs, :func:`_train` and the launcher handle both."""
    import signal

    launched = bool(os.environ.get("KERNELGUARD_LAUNCH_DIR"))  # kernelguard.train.launch.LAUNCH_DIR_ENV; no import yet

    def stop(signum: int, frame: Any) -> None:
        # Leave from the handler itself: an exception raised here could land inside an import (accelerate's,
        # torch's) and come out as that import's ImportError and a traceback instead of this line.
        line = INTERRUPTED_LINES["train"]["SIGTERM"]
        tell_torchrun(line)
        if not launched:
            print_rank0(line)
        _leave(EXIT_PREEMPTED)

    from kernelguard.errors import startup_interrupts

    previous = None
    try:  # everything inside: a signal can arrive during any import
        # Ctrl-C, for the same reason as SIGTERM (kernelguard.errors.interrupts); one line per job, from rank 0
        with startup_interrupts(None if launched or not is_rank0() else _INTERRUPTED_LINE):
            # Before the handler exists: an import inside a signal handler can meet a half-imported module. Under
            # plain torchrun, a rank its agent stops (another failed first) then names itself in torchrun's table.
            from .launch import write_torchelastic_error as tell_torchrun

            try:
                previous = signal.signal(signal.SIGTERM, stop)
            except ValueError:  # not the main thread (an embedding caller): its own handlers stand
                previous = None
            if launched:  # the launcher started this rank with Ctrl-C held (kernelguard.errors.interrupts)
                from kernelguard.errors import release_held_interrupts

                release_held_interrupts()
            return _main(argv)
    except KeyboardInterrupt:  # a launched rank stays quiet: its launcher says it once
        if not launched:
            print_rank0(_INTERRUPTED_LINE)
        _leave(EXIT_INTERRUPTED)
    except Preempted as e:
        tell_torchrun(str(e))
        if not launched:
            print_rank0(str(e))
        _leave(exit_code_for(e))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


_STATE = {"process_group": False}  # whether this process joined a torch.distributed process group


def exit_program(code: int) -> int:
    """The end of `kernelguard train` as a program (the console script, ``python -m kernelguard.train``):
    after a process group, leave without the interpreter's teardown. There torch can destroy gloo's process
    group while its worker threads still run, which aborts the process (``terminate called without an active
    exception``, SIGABRT) after a run that succeeded, and the launcher then reports the whole run as failed.
    Every file is closed and every tracker finished by then. Otherwise (or embedded) return ``code``."""
    if not _STATE["process_group"]:
        return code
    import logging

    logging.shutdown()
    _leave(code)


def _leave(code: int) -> NoReturn:
    """Exit now, skipping the interpreter's teardown: an import that the signal cut halfway (torch, numpy)
    can fail again during it ("cannot load module more than once per process") or re-raise the interrupt and
    end the process by SIGINT instead of ``code``. Nothing was written yet, so nothing needs cleaning up."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    from kernelguard.resolution import keep_search_results

    from .common.command_line import remember_command
    from .launch import launch, launched_by_kernelguard
    from .settings.config_cli import parse_command

    argv = list(sys.argv[1:] if argv is None else argv)
    remember_command(argv)  # for the --resume line a stopped run ends with
    keep_search_results()  # before any provider import: an unpinned autotune search is paid once per machine
    try:
        cmd = parse_command(argv)
    except ConfigError as e:
        return _fail(exit_code_for(e), f"kernelguard train: error: {_with_corrected_command(e, argv)}")
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if not launched_by_kernelguard():
        for warning in cmd.warnings:
            print_rank0(f"kernelguard train: warning: {warning}")
    try:  # before any rank starts or anything is written: the environment, the flags, inputs and paths
        _early_checks(cmd.config, launching=cmd.launch is not None and not launched_by_kernelguard())
    except (ConfigError, DataError) as e:
        return _fail(exit_code_for(e), f"kernelguard train: error: {_with_corrected_command(e, argv)}")
    if cmd.config.checkpoint.dry_run:
        return _dry_run(cmd.config, world_size=_launch_world_size(cmd.launch))
    if cmd.launch is not None and not launched_by_kernelguard():
        try:
            return launch(cmd.launch, argv, output=cmd.config.checkpoint.output_dir)
        except (ConfigError, DataError) as e:
            return _fail(exit_code_for(e), f"kernelguard train: error: {e}")
    return _train(cmd.config)


def _with_corrected_command(error: Exception, argv: list[str]) -> Exception:
    """An error that names the value to put instead (``details["replace"]``, e.g. the nearest existing
    ``--data`` file), a flag to add, or a fix that is one flag's value gets, as its fix, this whole command so
    corrected: a line that pastes."""
    from kernelguard.resolution import with_corrected_command

    details = getattr(error, "details", None) or {}
    if "--eval-data" in argv:  # a flag added for --data's rows (--columns) would apply to the eval file too
        details = {k: v for k, v in details.items() if k != "add"}
    return with_corrected_command(error, "train", argv, details=details, flag_fix=True)


def _early_checks(cfg: Any, *, launching: bool) -> None:
    """Before torch is imported, so a wrong input is refused in a second or two: the environment; unless a dry
    run, the flags, inputs, paths, chat template and the first rows' format. A launcher also loads the tokenizer
    and renders the first rows. Rank 0's preflight checks all of it again (cheap, and no rank should start for a
    run that will be refused)."""
    from .startup.input_check import check_inputs_early, check_row_formats
    from .startup.startup_checks import check_environment, check_flags, check_inputs, check_model_family, check_paths

    check_environment()
    if cfg.checkpoint.dry_run:
        return
    check_flags(cfg)
    check_inputs(cfg)
    check_paths(cfg)
    config = _config_json(cfg.model.model)
    if config is not None:  # an unreadable one is preflight's to explain
        check_model_family(config, model=str(cfg.model.model), packing=cfg.packing.packing)
    launched = bool(os.environ.get("KERNELGUARD_LAUNCH_DIR"))  # how rows of other names are read: said once
    check_row_formats(cfg, say=lambda line: None if launched else print_rank0(f"kernelguard train: {line}"))
    if launching:
        check_inputs_early(cfg)


def _config_json(model: Any) -> dict[str, Any] | None:
    """``--model``'s config.json as a dict (no transformers import), None when there is none to read."""
    import json

    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _train(cfg: Any) -> int:
    import torch.distributed as dist

    from kernelguard.errors import end_startup_interrupts

    from .common.logs import setup_logging
    from .common.ranks import on_main
    from .launch import launched_by_kernelguard, write_rank_error
    from .loop import run
    from .model.parallel import init_distributed
    from .signals import die_with_parent, stop_request

    end_startup_interrupts()  # the run lock comes next: Ctrl-C must unwind through its release
    die_with_parent()  # a rank must not outlive its launcher (kill -9 of it included)
    info, lock = None, None
    try:
        with stop_request().installed():
            info = init_distributed()
            _STATE["process_group"] = True
            setup_logging(level=cfg.metrics.log_level, is_main=info.is_main)  # type: ignore[attr-defined]
            held: list[Any] = []  # rank 0's lock stays in rank 0: on_main shares only the refusal
            on_main(info, lambda: held.append(_claim(cfg.checkpoint.output_dir)))
            lock = held[0] if held else None
            return run(cfg, info)
    except Preempted as e:
        return _fail(exit_code_for(e), str(e), is_main=info.is_main if info else None, error=e)
    except GuardRefused as e:
        line = f"kernelguard train: refused to start (exit {exit_code_for(e)})." + (f"\n{e.fix}" if e.fix else "")
        return _fail(exit_code_for(e), line, report=e.report, is_main=info.is_main if info else None, error=e)
    except (ConfigError, DataError, TrainingDiverged) as e:
        return _fail(exit_code_for(e), f"kernelguard train: error: {e}", is_main=info.is_main if info else None,
                     error=e)
    except KernelGuardError as e:  # the runtime guard refused a call mid-run: its sentence and fix, no traceback
        return _fail(exit_code_for(e), f"kernelguard train: stopped by the guard (exit {exit_code_for(e)}).\n{e}",
                     is_main=info.is_main if info else None, error=e)
    except Exception as e:
        if not launched_by_kernelguard():
            raise
        # The launcher prints this rank's traceback, unless another rank was killed by a signal: then this
        # error (a peer's connection reset, mostly) is its consequence and one line names the real cause.
        import traceback

        line = f"kernelguard train: rank {info.rank if info else '?'} failed: {type(e).__name__}: {e}"
        write_rank_error(EXIT_FAIL, line.splitlines()[0], traceback.format_exc().rstrip(), crash=True, error=e)
        return EXIT_FAIL
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: one line from rank 0 (or the launcher), no tracebacks
        if (info is None or info.is_main) and not launched_by_kernelguard():
            from .signals import stopped_lines

            print("\n".join(stopped_lines(cfg.checkpoint.output_dir, "interrupted (Ctrl-C)")), file=sys.stderr,
                  flush=True)
        return EXIT_INTERRUPTED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if lock is not None:
            lock.release()


def _claim(output: Any) -> Any:
    """Rank 0: the run lock, then (a multi-node launch) the error records of an earlier run cleared under it."""
    from .common.run_folder_lock import hold_for_run
    from .failures import clear

    lock = hold_for_run(output)
    clear()
    return lock


def _launch_world_size(opts: LaunchOptions | None) -> int | None:
    """Ranks that --nproc-per-node/--nnodes will start (the fewest for MIN:MAX); None when not a number."""
    if opts is None or not opts.nproc_per_node.isdigit():
        return None
    nodes = opts.nnodes.split(":")[0]
    return int(opts.nproc_per_node) * int(nodes) if nodes.isdigit() else None


def _dry_run(cfg: Any, *, world_size: int | None) -> int:
    """--dry-run: the memory estimate (kernelguard.train.model.memory), no process group, no training. Each stage is
    named on stderr as it starts (rank 0): the imports and the meta build take seconds on a cold disk, and
    a dry run must never look hung. The model is built once, for both estimates."""
    try:
        from .model.memory import estimate
        from .model.memory_probe import build_probe_model
        from .startup.host_memory import host_memory
    except ImportError:
        return _fail(
            EXIT_USAGE,
            "kernelguard train: error: --dry-run needs the memory estimate (kernelguard.train.model.memory), "
            "which this kernelguard does not have.\nFix: run without --dry-run, or upgrade kernelguard",
        )
    say = _stage_printer()
    try:
        say("loading torch and transformers")
        from .model.parallel import model_source
        from .startup.preflight import check_model_size

        hf_config, _ = model_source(str(cfg.model.model))
        check_model_size(hf_config, model=str(cfg.model.model))
        say(f"{cfg.model.model}: {_describe(hf_config)}; building it on the meta device (no memory is used)")
        model = build_probe_model(hf_config)
        text = estimate(cfg, world_size=world_size, model=model, progress=say).render()
        text += "\n" + host_memory(cfg, world_size=world_size, model=model, progress=say).render()
    except (ConfigError, DataError) as e:
        return _fail(exit_code_for(e), f"kernelguard train: error: {e}")
    if is_rank0():
        print(text, flush=True)
    if (refusal := _would_refuse(cfg)) is not None:
        print_rank0(f"kernelguard train --dry-run: warning: the run itself would be refused: {refusal}")
    return EXIT_OK


def _would_refuse(cfg: Any) -> str | None:
    """The refusal preflight's input and flag checks would give this run (the estimate needs neither data nor
    a tokenizer, but a dry run that says "fits" for a run that cannot start would be a silent success)."""
    from .startup.preflight import check_flags, check_inputs

    try:
        check_flags(cfg)
        check_inputs(cfg)
    except (ConfigError, DataError) as e:
        return str(e).replace("\n", " ")
    return None


def _stage_printer() -> Any:
    import time

    start = time.perf_counter()
    return lambda what: print_rank0(f"kernelguard train --dry-run [{time.perf_counter() - start:.1f} s]: {what}")


def _describe(hf_config: Any) -> str:
    """``qwen3_5_moe_text, 60 layers, hidden 4096, vocab 248,320, 512 experts``: what is being sized."""
    from kernelguard.resolution import text_config

    text = text_config(hf_config)
    parts = [str(getattr(text, "model_type", "?"))]
    for label, name in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"), ("vocab", "vocab_size"),
                        ("experts", "num_experts")):
        value = getattr(text, name, None)
        if isinstance(value, int) and value:
            parts.append(f"{label} {value:,}" if label in ("hidden", "vocab") else f"{value:,} {label}")
    return ", ".join(parts)


if __name__ == "__main__":
    sys.exit(exit_program(main()))
