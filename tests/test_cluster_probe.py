"""benchmarks/cluster_probe.py compiles its probes for sm_90 on any machine and reports each one."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "cluster_probe.py"


def test_cluster_probe_reports_every_probe():
    # A fresh process without the interpreter, which would replace the kernels being compiled.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len([line for line in lines if line.startswith("tile [")]) == 8
    assert len([line for line in lines if line.startswith("Gluon TMA copy")]) == 2
    assert all("multicast" in line or "does not compile" in line for line in lines[1:])
