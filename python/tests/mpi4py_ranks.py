"""Run under mpirun by test_mpi4py.py: epmoe.Buffer(None, comm=mpi4py_comm) on CPU ranks as MPI processes.

Usage: mpirun -n 2 python mpi4py_ranks.py SEED. Every process draws all ranks' inputs from SEED, computes the
reference with thread ranks in-process (ep_scenarios.reference_outputs), runs its own rank through a Buffer
over the communicator (epmoe's native MPI group), and compares bit for bit; then checks the all-gather adapter
(native_mpi=False). Prints 'mpi4py ranks OK <rank>' at the end; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mpi4py import MPI  # noqa: E402  (initialises MPI)

import epmoe  # noqa: E402
from ep_scenarios import CASES_BY_NAME, assert_same, make_inputs, numpy_identity, reference_outputs, run_rank  # noqa

NAMES = ["bf16", "fp8_ue8m0_scales", "zero_token_rank", "num_worst_tokens", "cached"]


def main() -> None:
    seed = int(sys.argv[1])
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    assert comm.Get_size() == 2, "run with mpirun -n 2"
    buf = epmoe.Buffer(None, comm=comm, backend="mpi")
    assert buf.native_group.backend == "mpi" and (buf.rank, buf.group_size) == (rank, 2)
    for i, name in enumerate(NAMES):
        case = CASES_BY_NAME[name]
        inputs = make_inputs(case, seed + i)
        ref = reference_outputs(case, inputs)
        for variant in ("sync", "async", "positional"):
            got = run_rank(buf, case, inputs[rank], rank, numpy_identity, numpy_identity, variant)
            assert_same(got, ref[rank], f"{name}/{variant} rank {rank} (seed {seed + i})")

    # Low-latency mode over MPI: the same bits as thread ranks.
    rng = np.random.default_rng(seed)
    E, T, H, K, tmax = 8, 6, 256, 2, 8
    xs = [rng.uniform(-4, 4, size=(T, H)).astype(epmoe.BFLOAT16) for _ in range(2)]
    idxs = [np.stack([rng.choice(E, size=K, replace=False) for _ in range(T)]).astype(np.int64) for _ in range(2)]
    ws = [rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32) for _ in range(2)]

    def low_latency(b, r):
        (rx, rs), count, handle, _, _ = b.low_latency_dispatch(xs[r], idxs[r], tmax, E)
        y = np.zeros(rx.shape, epmoe.BFLOAT16)
        for e in range(len(count)):
            y[e, :count[e]] = (rx[e, :count[e]].astype(np.float32) * 2).astype(epmoe.BFLOAT16)
        out, _, _ = b.low_latency_combine(y, idxs[r], ws[r], handle)
        return count.copy(), out.copy()

    ref_ll = epmoe.run_thread_ranks(2, lambda g: low_latency(epmoe.Buffer(g), g.rank()))
    count, out = low_latency(buf, rank)
    np.testing.assert_array_equal(count, ref_ll[rank][0])
    np.testing.assert_array_equal(out.view(np.uint16), ref_ll[rank][1].view(np.uint16))

    # The all-gather adapter over the same communicator (what a different MPI library would get).
    g = epmoe.as_group(None, comm, native_mpi=False)
    assert g.backend == "mpi4py" and (g.rank(), g.size()) == (rank, 2)
    g.barrier()
    assert g.all_gather_bytes(bytes([rank]) * (rank + 1)) == [b"\x00", b"\x01\x01"]
    assert g.broadcast_bytes(bytes([rank] * 4), 1) == b"\x01" * 4
    comm.Barrier()
    print(f"mpi4py ranks OK {rank}", flush=True)


if __name__ == "__main__":
    main()
