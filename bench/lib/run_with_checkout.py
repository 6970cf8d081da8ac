"""`python bench/lib/run_with_checkout.py DIR PYTEST_ARGS...`: run pytest with `kernelguard` imported from DIR/kernelguard
(the editable install's finder is removed first), e.g. an older revision unpacked with `git archive REV kernelguard`."""
import sys

root = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "__editable___kernelguard" not in getattr(f, "__module__", "")]
sys.path.insert(0, root)
import pytest

sys.exit(pytest.main(sys.argv[2:]))
