"""Run under torchrun by test_torchrun.py: the same worker code as on one machine."""

import json
import os

import minidist as md
import workers

if __name__ == "__main__":
    outs = md.launch(workers.torchrun_ring, transport="torch", timeout=60)
    print(f"RESULT rank={os.environ['RANK']} " + json.dumps(outs), flush=True)
