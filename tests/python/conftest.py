"""Shared set-up of the kvq Python tests (README "From Python"; ctest Python.pytest).

The module, numpy, the shared data (KVQ_DATA_DIR, default ../shared beside the source tree) and the
kvq CLI (KVQ_BIN, default <source>/build/kvq) are each optional: a test that needs one that is
missing skips with a message naming it.
"""
import os
import pathlib
import shutil

import pytest

SOURCE_DIR = pathlib.Path(__file__).resolve().parents[2]


def data_dir():
    return pathlib.Path(os.environ.get("KVQ_DATA_DIR") or SOURCE_DIR.parent / "shared")


def data_path(rel):
    """Path of `rel` under the shared data, or a skip naming it."""
    p = data_dir() / rel
    if not p.exists():
        pytest.skip(f"shared data '{rel}' not found under {data_dir()} (set KVQ_DATA_DIR)")
    return p


def kvq_bin():
    """Path of the kvq CLI, or a skip naming where it was looked for."""
    p = os.environ.get("KVQ_BIN") or str(SOURCE_DIR / "build" / "kvq")
    if not (os.path.isfile(p) and os.access(p, os.X_OK)):
        found = shutil.which("kvq")
        if not found:
            pytest.skip(f"kvq CLI not found at {p} (set KVQ_BIN)")
        p = found
    return p


@pytest.fixture(scope="session")
def stories260k():
    return str(data_path("models/stories260K/stories260K.gguf"))
