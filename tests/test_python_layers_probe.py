"""benchmarks/python_layers_host_time.py runs on any machine, and its fused cases reach the stand-in ops."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "python_layers_host_time.py"


def test_python_layers_probe_times_every_case_through_the_stand_ins():
    # A fresh process: the stand-ins replace the ops' CPU implementations for as long as it lives.
    args = [sys.executable, str(SCRIPT), "--calls", "40", "--rounds", "1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    timed = [line for line in done.stdout.splitlines()[2:] if line.strip()]
    assert len(timed) == 8
    assert all(float(line.split()[-1]) > 0 for line in timed)
