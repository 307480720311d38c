"""Groups: what a Buffer's ranks are made of.

``as_group`` turns whatever the caller hands to ``Buffer(group, ...)`` into an epmoe ``Group``:

- an epmoe ``Group`` from :func:`epmoe.run_thread_ranks` (threads backend, CPU ranks as threads);
- a ``torch.distributed.ProcessGroup`` (gloo, nccl or a mixed "cpu:gloo,cuda:nccl" group): one process
  per rank, the layout of DeepEP and the engines on it;
- an ``mpi4py`` communicator (``comm=``): one process per rank under mpirun.

A torch group becomes a Group whose collectives are one all-gather of bytes through torch.distributed
(``epmoe._ext.Group.from_all_gather``): only control data crosses it (the cuda_ipc backend's IPC handles
at construction and its per-call settings check); tokens move over NVLink. Its waits are
torch.distributed's (its timeout), not epmoe's ``timeout_s``. An mpi4py communicator becomes epmoe's
native MPI group (backend 'mpi', whose CPU transport also serves both modes on CPU ranks) when this build
has MPI and mpi4py uses the same MPI library; otherwise the same all-gather adapter over
``comm.Allgather`` (backend 'mpi4py', no timeout of its own).
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Callable, List, Optional

from . import _ext
from ._tensor import int_arg, invalid_argument

Group = _ext.Group


def _is_torch_process_group(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = getattr(torch, "distributed", None)
    process_group = getattr(dist, "ProcessGroup", None) if dist is not None else None
    return process_group is not None and isinstance(obj, process_group)


def _is_mpi4py_comm(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "mpi4py" and hasattr(obj, "Allgather")


def torch_all_gather(group: Any) -> Callable[[bytes, str], bytes]:
    """The all-gather of bytes over a torch.distributed ProcessGroup: uint8 tensors through
    ``dist.all_gather``, on the CPU for a group with gloo, else on the current CUDA device (nccl)."""
    import torch
    import torch.distributed as dist

    size = group.size()
    backend = str(dist.get_backend(group)).lower()
    on_cpu = "gloo" in backend or "nccl" not in backend

    def all_gather(data: bytes, phase: str) -> bytes:
        n = len(data)
        if n == 0:  # every rank passes the same length: nothing to exchange anywhere
            return b""
        device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        send = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        out = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(size)]
        dist.all_gather(out, send, group=group)
        return torch.cat(out).cpu().numpy().tobytes()

    return all_gather


def mpi4py_all_gather(comm: Any) -> Callable[[bytes, str], bytes]:
    """The all-gather of bytes over an mpi4py communicator (``comm.Allgather`` of uint8 buffers)."""
    import numpy as np
    from mpi4py import MPI

    size = comm.Get_size()

    def all_gather(data: bytes, phase: str) -> bytes:
        send = np.frombuffer(data, dtype=np.uint8)
        recv = np.empty(len(data) * size, dtype=np.uint8)
        comm.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])
        return recv.tobytes()

    return all_gather


def _same_mpi_library() -> bool:
    """Whether mpi4py and this extension use one MPI library (so a communicator handle means the same)."""
    if not getattr(_ext, "has_mpi", False):
        return False
    from mpi4py import MPI
    return MPI.Get_library_version().strip() == _ext.mpi_library_version().strip()


def as_group(group: Any, comm: Any = None, native_mpi: bool = True) -> Group:
    """The epmoe Group for `group` (or for `comm` when `group` is None).

    Arguments:
        group: an epmoe ``Group``, a ``torch.distributed.ProcessGroup``, or None.
        comm: an ``mpi4py.MPI.Comm`` (used when `group` is None). Collective over it.
        native_mpi: use epmoe's own MPI group for `comm` where possible (False: always the all-gather
            adapter).

    Errors (epmoe.Error 'invalid_argument'): both None; `group` of another type; `comm` that is not an
    mpi4py communicator.
    """
    if isinstance(group, Group):
        return group
    if group is None and comm is None:
        raise invalid_argument("group", "an epmoe.Group, a torch.distributed.ProcessGroup, or comm=", "None "
                               "(and comm is None)")
    if group is None:
        if not _is_mpi4py_comm(comm):
            raise invalid_argument("comm", "an mpi4py communicator (mpi4py.MPI.Comm)",
                                   f"an object of type {type(comm).__name__}")
        if native_mpi and _same_mpi_library():
            return _ext.mpi_group_from_fortran(comm.py2f())
        return Group.from_all_gather(comm.Get_rank(), comm.Get_size(), "mpi4py", mpi4py_all_gather(comm))
    if _is_torch_process_group(group):
        return Group.from_all_gather(group.rank(), group.size(), "torch", torch_all_gather(group))
    raise invalid_argument("group", "an epmoe.Group (from epmoe.run_thread_ranks) or a torch.distributed."
                           "ProcessGroup", f"an object of type {type(group).__name__}")


def run_thread_ranks(num_ranks: int, fn: Callable[[Group], Any], timeout_s: Optional[float] = None) -> List[Any]:
    """Runs ``fn(group)`` once per rank, each on its own thread, and returns their results by rank.

    The ranks form one threads-backend group (shared memory). Every collective releases the GIL, so the
    ranks progress together. If any rank raises, the root cause is re-raised after all ranks have
    finished: the first error (in the order the ranks failed) that is not a timeout or 'unusable', else the
    first timeout (a rank that never came), else the first 'unusable'. It is re-raised as the same object,
    so its type, attributes (an epmoe error's code) and traceback are those of the raise, and it names the
    rank that raised it: where its message is its one string argument (an epmoe error, ValueError("bad"), most
    exceptions) that argument is prefixed, "epmoe: rank 1: invalid argument ..." or "rank 1: bad" (unless it
    names a rank first already); for any other (KeyError and OSError, whose arguments are data; no argument;
    several) a note "raised by rank 1 of run_thread_ranks" is added instead (Python 3.11+, shown under the
    traceback; older Pythons leave it unnamed). Editing the object, not wrapping it, keeps `except ValueError`
    working. A rank that raises, or returns while others
    wait for it in a collective, releases them at once: their collectives raise 'unusable' naming it instead
    of waiting out `timeout_s` (the ranks' collective timeout in seconds; default epmoe.default_timeout_s(),
    100 s unless EPMOE_TIMEOUT_S says otherwise; float('inf') or anything past 1e9 s waits 1e9 s).

    Errors: epmoe.Error('invalid_argument') for num_ranks that is not an int in 1..2**31-1, fn that is not
    callable, or timeout_s that is not None or a number > 0.
    """
    num_ranks = int_arg("num_ranks", num_ranks, 1, 2**31 - 1)
    if not callable(fn):
        raise invalid_argument("fn", "a callable fn(group) run once per rank", f"an object of type {type(fn).__name__}")
    # A string or another object would reach the binding's float conversion, whose TypeError names no argument.
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)):
        raise invalid_argument("timeout_s", "None or a number of seconds > 0", repr(timeout_s))
    return _ext.run_thread_ranks(num_ranks, fn, timeout_s)
