"""``worker_pids`` counts only torchrun's workers among the agent's children (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from toolkit.core.supervise import child_pids, worker_pids

# a stand-in agent: starts one child with a worker's environment and one helper without it, then sleeps
AGENT = """
import os, subprocess, sys, time
env = dict(os.environ, TORCHELASTIC_RESTART_COUNT="0", LOCAL_RANK="0")
helper_env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=helper_env)
print(worker.pid, helper.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc/PID/environ (Linux)")
def test_only_children_with_a_workers_environment_count_as_workers():
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"}
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker, helper = (int(p) for p in agent.stdout.readline().split())
        deadline = time.monotonic() + 10
        while len(child_pids(agent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(child_pids(agent.pid)) == sorted([worker, helper])
        assert worker_pids(agent.pid) == [worker]
    finally:
        for pid in child_pids(agent.pid):
            os.kill(pid, 9)
        agent.kill()
        agent.wait()
