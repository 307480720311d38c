"""Buffer(None, comm=mpi4py_comm): CPU ranks as MPI processes, launched with mpirun (see mpi4py_ranks.py).

Skipped without mpi4py, mpirun, or an MPI build of epmoe. mpi4py is not imported here (importing it
initialises MPI in the test process); the ranks run in their own processes.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import subprocess
import sys

import pytest

import epmoe

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed")
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun")
@pytest.mark.skipif(not epmoe._ext.has_mpi, reason="epmoe was built without MPI")
def test_buffer_over_an_mpi4py_communicator_matches_thread_ranks():
    seed = int(os.environ.get("EPMOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={seed} (EPMOE_TEST_SEED={seed} reproduces it)")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", EPMOE_TIMEOUT_S="30",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = ["mpirun", "-n", "2", sys.executable, os.path.join(HERE, "mpi4py_ranks.py"), str(seed)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, f"mpirun exited {proc.returncode}"
    assert "mpi4py ranks OK 0" in proc.stdout and "mpi4py ranks OK 1" in proc.stdout
