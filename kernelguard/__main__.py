import sys

from kernelguard.cli import entry

sys.exit(entry.main())
