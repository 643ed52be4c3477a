"""Run under torchrun by test_torchrun.py: the same worker code as on one machine."""

import json
import os

import minidist as md
import workers

if __name__ == "__main__":
    outs = md.launch(workers.torchrun_ring, transport="torch", timeout=60)
    # one file per rank: parsing the shared stdout of several processes is fragile
    with open(os.path.join(os.environ["MINIDIST_TEST_OUT"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(outs, f)
