"""The start shared by the plot scripts that `kvq bench --plot` and `kvq kv-error --plot` run:
matplotlib's headless backend and the RESULT.json OUT.png arguments. Imported before pyplot."""
import json
import sys

import matplotlib

matplotlib.use("Agg")


def read_result(usage):
    """The tool's --json object from sys.argv[1]; exits with `usage` unless given RESULT.json OUT.png."""
    if len(sys.argv) != 3:
        sys.exit(usage)
    with open(sys.argv[1]) as f:
        return json.load(f)
