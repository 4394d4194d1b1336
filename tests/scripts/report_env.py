"""Report how this process was launched: used by the Slurm and baguarun-over-ssh tests.

Usage: report_env.py OUT_DIR [--hold SECONDS]
Calls ``bagua.init_process_group()`` with no arguments, allreduces ``rank + 1`` to prove the ranks are connected,
and writes ``OUT_DIR/rank{RANK}.json`` (rank, sizes, rendezvous address, the allreduced sum, this process's pid
and its parent's, and ``BAGUA_TEST_MARK``). With ``--hold``, it then sleeps (the launcher-kill test).
"""

import argparse
import json
import os
import time

import torch

import bagua.torch_api as bagua
from bagua.torch_api import env

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--hold", type=float, default=0.0)
args = parser.parse_args()

bagua.init_process_group()
total = torch.tensor([bagua.get_rank() + 1.0])
bagua.allreduce_inplace(total)
report = {
    "rank": bagua.get_rank(), "world_size": bagua.get_world_size(), "local_rank": env.get_local_rank(),
    "local_world_size": env.get_local_size(), "node_rank": env.get_node_rank(), "master_addr": env.get_master_addr(),
    "master_port": env.get_master_port(), "sum": total.item(), "pid": os.getpid(), "ppid": os.getppid(),
    "mark": os.environ.get("BAGUA_TEST_MARK"),
}
path = os.path.join(args.out, f"rank{report['rank']}.json")
with open(path + ".tmp", "w") as f:
    json.dump(report, f)
os.replace(path + ".tmp", path)
time.sleep(args.hold)
