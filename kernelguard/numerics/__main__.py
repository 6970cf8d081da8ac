"""``python -m kernelguard.numerics``: kernel numerics vs the fp32 torch reference, outside ``check --run``."""

from kernelguard.numerics.run import main

__all__: list[str] = []

raise SystemExit(main())
