"""Groups: what a Buffer's ranks are made of.

``as_group`` turns whatever the caller hands to ``Buffer(group, ...)`` into an epmoe ``Group``. Today
that is a Group from :func:`epmoe.run_thread_ranks` (threads backend). The adapters for a
``torch.distributed.ProcessGroup`` (GPU backends) and an ``mpi4py`` communicator plug in here, so the
Buffer itself never changes.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from . import _ext
from ._tensor import invalid_argument, unsupported

Group = _ext.Group


def _is_torch_process_group(obj: Any) -> bool:
    t = type(obj)
    return t.__module__.startswith("torch") and t.__name__ in ("ProcessGroup", "ProcessGroupNCCL", "ProcessGroupGloo")


def as_group(group: Any, comm: Any = None) -> Group:
    """The epmoe Group for `group` (or `comm` when `group` is None).

    Errors (epmoe.Error): invalid_argument for anything that is not a group; unsupported for a torch
    ProcessGroup or an mpi4py communicator, which need the GPU / MPI adapters of a later release.
    """
    if isinstance(group, Group):
        return group
    if group is None and comm is None:
        raise invalid_argument("group", "an epmoe.Group (from epmoe.run_thread_ranks)", "None (and comm is None)")
    if group is None:
        raise unsupported("Buffer(comm=...): mpi4py communicators are not supported by the Python package yet "
                          "(the C++ MPI backend is; the Python adapter will come with it)")
    if _is_torch_process_group(group):
        raise unsupported("Buffer(group=torch ProcessGroup): torch.distributed groups arrive with the GPU "
                          "(cuda-ipc) backend; on CPU use epmoe.run_thread_ranks")
    raise invalid_argument("group", "an epmoe.Group (from epmoe.run_thread_ranks)", f"an object of type "
                           f"{type(group).__name__}")


def run_thread_ranks(num_ranks: int, fn: Callable[[Group], Any], timeout_s: Optional[float] = None) -> List[Any]:
    """Runs ``fn(group)`` once per rank, each on its own thread, and returns their results by rank.

    The ranks form one threads-backend group (shared memory). Every collective releases the GIL, so the
    ranks progress together. If any rank raises, the root cause is re-raised after all ranks have
    finished: the lowest rank's error that is not a timeout or 'unusable', else the lowest rank's
    (ranks still waiting for the failed one give up after `timeout_s`,
    default epmoe.default_timeout_s(), 100 s unless EPMOE_TIMEOUT_S says otherwise).

    Errors: epmoe.Error('invalid_argument') for num_ranks < 1 or timeout_s <= 0.
    """
    return _ext.run_thread_ranks(num_ranks, fn, timeout_s)
