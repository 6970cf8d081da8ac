"""`torchrun --nproc-per-node N -m kernelguard.train ...` (or `kernelguard train ...`).

Exit codes: 0 ok; 2 usage, config or data error (nothing trained, nothing half-written left behind);
3 the guard refused to start because a kernel would run a slow fallback that was not ``--allow``-ed.
"""

from __future__ import annotations

import sys

from kernelguard.errors import ConfigError, DataError

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_GUARD = 3


def main(argv: list[str] | None = None) -> int:
    from .config import parse_args

    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"kernelguard train: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help
        return int(e.code or 0)

    import torch.distributed as dist

    from .loop import GuardRefused, run
    from .parallel import init_distributed

    info = init_distributed()
    try:
        return run(cfg, info)
    except GuardRefused as e:
        if info.is_main:
            print(e.report, file=sys.stderr)
            print(
                "kernelguard train: refused to start (exit 3); pass --allow ID only for a fallback you accept.",
                file=sys.stderr,
            )
        return EXIT_GUARD
    except (ConfigError, DataError) as e:
        if info.is_main:
            print(f"kernelguard train: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
