"""ctest's entry to the Python tests (ctest Python.pytest): runs pytest on this folder, or exits 77
(ctest's skip) with a message when pytest or numpy is not installed for this interpreter."""
import importlib.util
import os
import sys

missing = [m for m in ("pytest", "numpy") if importlib.util.find_spec(m) is None]
if missing:
    print(f"skipped: {', '.join(missing)} not installed for {sys.executable} (scripts/install-deps.sh)")
    sys.exit(77)

import pytest  # noqa: E402

sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", os.path.dirname(os.path.abspath(__file__)), *sys.argv[1:]]))
