"""``python -m minidist.serve.offload TASK_JSON``: one measurement or checkpoint write, in a fresh process.

Started by ``measure._child`` (never by hand); prints the answer as JSON on its last line.
"""

import json
import sys

from minidist.serve.offload.demonstration import _write_here
from minidist.serve.offload.measure import _measure_here

if __name__ == "__main__":
    _task = json.loads(sys.argv[1])
    _kind = _task.pop("task")
    _fn = {"measure": _measure_here, "write": _write_here}[_kind]
    print(json.dumps(_fn(**_task)))
