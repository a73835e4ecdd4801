"""The repository's scripts as the docs run them: every script with a shebang is executable
(docs run `scripts/plot_passkey.py ...` directly), and plot_passkey.py refuses a file that is not
an eval-passkey --json result with one line naming it, and says "1 trial/cell", "3 trials/cell"."""
import json
import os
import subprocess
import sys

import pytest

from conftest import SOURCE_DIR

SCRIPTS = SOURCE_DIR / "scripts"


def test_scripts_with_a_shebang_are_executable():
    with_shebang = [p for p in sorted(SCRIPTS.iterdir()) if p.is_file() and p.read_bytes()[:2] == b"#!"]
    assert with_shebang, f"no script with a shebang in {SCRIPTS}"
    not_executable = [p.name for p in with_shebang if not os.access(p, os.X_OK)]
    assert not_executable == [], f"scripts with a shebang but mode -x: {not_executable}"


def test_plot_passkey_refuses_a_non_json_file_in_one_line(tmp_path):
    pytest.importorskip("matplotlib")
    bad = tmp_path / "not_json.txt"
    bad.write_text("passkey 5/5\n")
    r = subprocess.run([sys.executable, str(SCRIPTS / "plot_passkey.py"), str(bad), str(tmp_path / "out.png")],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and str(bad) in r.stderr and "not JSON" in r.stderr, r.stderr
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"ppl": 3.5}))
    r = subprocess.run([sys.executable, str(SCRIPTS / "plot_passkey.py"), str(other), str(tmp_path / "out.png")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and str(other) in r.stderr, r.stderr


@pytest.mark.parametrize("trials,word", [(1, "1 trial/cell"), (3, "3 trials/cell"), ("2-5", "2-5 trials/cell")])
def test_plot_passkey_title_counts_trials(trials, word):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(SCRIPTS))
    try:
        import plot_passkey
        import matplotlib.pyplot as plt
    finally:
        sys.path.remove(str(SCRIPTS))
    r = {"lengths": [1024], "depths": [0, 50], "kv_type_k": "q4", "kv_type_v": "q4", "kv_bytes_per_token": 100.0,
         "kv_cache": "q4", "accuracy": 1.0, "trials_per_cell": trials,
         "cells": [{"length": 1024, "depth": 0, "accuracy": 1.0}, {"length": 1024, "depth": 50, "accuracy": 1.0}]}
    fig, ax = plt.subplots()
    plot_passkey.panel(ax, r)
    title = ax.get_title()
    plt.close(fig)
    assert word in title, title
