"""``python -m kernelguard.stack.numerics``: kernel numerics vs the fp32 torch reference, outside ``check --run``."""

from kernelguard.stack.numerics.run import main

__all__: list[str] = []

raise SystemExit(main())
