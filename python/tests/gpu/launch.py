"""What the GPU test modules share: the skip condition, which GPU each rank uses, the seed, the environment, and
the launch of WORLD ranks, as processes (torch.multiprocessing) or as thread ranks of one process.

Process ranks: ``spawn(job, backend, tmp_path, name)`` starts WORLD fresh processes; process r sets its CUDA
device to ``devices()[r]``, joins a torch.distributed group (gloo, or nccl), and runs ``job(Proc)``, a
module-level function of a worker module (gpu_workers.py, ll_workers.py) returning a picklable dict; the dicts
come back in rank order through a Manager dict. A failed assertion raises in the process, and
torch.multiprocessing.spawn re-raises it in the test with its traceback.

Share mode (EPMOE_TEST_SHARE_GPU=1, or one GPU visible and the variable unset): every process rank uses cuda:0.
The cuda_ipc backend maps a peer's buffer from another process with cudaIpcOpenMemHandle, which works on the
device that exported it too, and the two CUDA contexts time-slice the GPU, so each rank's spinning kernels let
the other's run (as the C++ MPI tests with EPMOE_TEST_SHARE_GPU=1: tests/mpi/mpi_test_util.hpp rank_device,
which there takes rank % GPUs; here sharing always means cuda:0). It tests the protocol, not its speed. Two
things cannot share a GPU and are skipped in share mode (``own_gpus``): a torch.distributed NCCL group (NCCL
refuses two ranks on one device), and thread ranks of one process (one context: a rank's spinning kernels can
hold the SMs the other rank's kernels need; docs/cuda_ipc_design.md, section "Tests on one GPU").
EPMOE_TEST_SHARE_GPU=0 turns share mode off (the tests then skip with fewer than WORLD GPUs).

Importing this module puts the parent folder (ep_scenarios.py) and this one on sys.path (spawned processes
inherit sys.path) and sets the environment defaults. No conftest.py in this folder: a second module named
conftest would shadow the parent's, which the other test modules import from.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

import epmoe

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(HERE), HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# NVLink multicast stays off on shared machines; epmoe never uses it, this guards the libraries (NCCL). A protocol
# bug costs seconds, not the 100 s default wait (EPMOE_TIMEOUT_S). Set before any group exists; the spawned
# processes inherit them.
ENV_DEFAULTS = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
                ("EPMOE_TIMEOUT_S", "20"))
for _name, _value in ENV_DEFAULTS:
    os.environ.setdefault(_name, _value)

WORLD = 2


def fresh_seed(name: str) -> int:
    """A fresh random seed (EPMOE_TEST_SEED forces one), printed so a failure can be replayed."""
    seed = int(os.environ.get("EPMOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"[{name}] seed={seed} (EPMOE_TEST_SEED={seed} reproduces it)")
    return seed


# ------------------------------------------------------------------------------------------ devices and skips

def gpu_count() -> int:
    """CUDA devices torch sees (0 without torch's CUDA)."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def share_gpu() -> bool:
    """Whether the WORLD process ranks share cuda:0: EPMOE_TEST_SHARE_GPU=1 with at least one GPU, or fewer GPUs
    than WORLD (but one) unless EPMOE_TEST_SHARE_GPU=0."""
    n = gpu_count()
    flag = os.environ.get("EPMOE_TEST_SHARE_GPU", "")
    if n == 0 or flag == "0":
        return False
    return flag == "1" or n < WORLD


def devices() -> Tuple[int, ...]:
    """Every process rank's CUDA device: rank r on cuda:r, or all on cuda:0 in share mode."""
    return (0,) * WORLD if share_gpu() else tuple(range(WORLD))


def skip_reason() -> Optional[str]:
    """Why the GPU tests cannot run here, or None: they need a CUDA build of epmoe and one GPU (share mode) or
    WORLD GPUs."""
    if not epmoe.built_with_cuda():
        return "needs a CUDA build of epmoe (this one is CPU-only)"
    n = gpu_count()
    if n == 0:
        return "needs a GPU (torch sees none)"
    if n < WORLD and not share_gpu():
        return f"needs {WORLD} GPUs (found {n}; EPMOE_TEST_SHARE_GPU=0 turns off sharing one)"
    return None


# The modules' pytestmark: every test of a GPU module skips with the reason above.
needs_gpu = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


def own_gpus(why: str) -> Any:
    """A skip mark for the tests that need one GPU per rank (not share mode); `why` says what cannot share."""
    return pytest.mark.skipif(skip_reason() is None and share_gpu(),
                              reason=f"share mode (all {WORLD} ranks on cuda:0): {why}")


NCCL_SHARED = "NCCL refuses two ranks on one GPU, so an nccl group needs one GPU per rank"
THREADS_SHARED = ("thread ranks share one CUDA context, where a rank's spinning kernels can hold the SMs the other "
                  "rank's kernels need (docs/cuda_ipc_design.md, section 'Tests on one GPU')")


# ------------------------------------------------------------------------------------------ process ranks

@dataclasses.dataclass(frozen=True)
class Proc:
    """One process rank, as a job sees it."""
    rank: int
    world: int
    seed: int
    group: Any  # dist.group.WORLD: a torch ProcessGroup, handed to epmoe.Buffer as DeepEP's engines do
    devices: Tuple[int, ...]  # every rank's CUDA device

    @property
    def device(self) -> int:
        """This rank's CUDA device index (also torch's current device in the process)."""
        return self.devices[self.rank]

    @property
    def cuda(self) -> str:
        """This rank's device as torch names it ('cuda:N')."""
        return f"cuda:{self.device}"


def _process_main(rank: int, world: int, init_file: str, backend: str, devs: Tuple[int, ...], seed: int,
                  job: Callable[[Proc], Dict[str, Any]], results: Any) -> None:
    """Entry point of one spawned process (torch.multiprocessing passes `rank` first): its CUDA device, a
    torch.distributed group over `backend` ('gloo' or 'nccl'), then job; the result lands in results[rank]."""
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(devs[rank])  # Buffer(device=None) takes torch's current device
    kwargs = {"device_id": torch.device("cuda", devs[rank])} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world, **kwargs)
    try:
        results[rank] = job(Proc(rank, world, seed, dist.group.WORLD, devs))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(job: Callable[[Proc], Dict[str, Any]], backend: str, tmp_path: Any, name: str) -> List[Dict[str, Any]]:
    """Runs `job` (a module-level function, pickled by name) on WORLD fresh processes over a `backend` group
    ('gloo' or 'nccl'; its rendezvous file lives in tmp_path) with a fresh seed; returns the ranks' results in
    rank order. Raises what a process raised (torch.multiprocessing.ProcessRaisedException)."""
    import torch.multiprocessing as mp
    devs = devices()
    assert backend != "nccl" or len(set(devs)) == len(devs), NCCL_SHARED  # the tests skip first (own_gpus)
    seed = fresh_seed(name)
    print(f"[{name}] {WORLD} processes over {backend} on cuda:{list(devs)}{' (share mode)' if share_gpu() else ''}")
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.spawn(_process_main, args=(WORLD, str(tmp_path / "init"), backend, devs, seed, job, results),
                 nprocs=WORLD, join=True)
        return [results[r] for r in range(WORLD)]


# ------------------------------------------------------------------------------------------ thread ranks

def on_thread_ranks(rank_main: Callable[[Any, int], List[str]]) -> List[str]:
    """Runs rank_main(group, device) on WORLD thread ranks of this process, thread rank r on cuda:r (torch's
    current device in that thread meanwhile; the cuda_ipc peer-access path); returns the ranks' lists joined in
    rank order. Needs WORLD GPUs: never in share mode (own_gpus(THREADS_SHARED))."""
    import torch

    def main(group: Any) -> List[str]:
        r = group.rank()
        with torch.cuda.device(r):
            return rank_main(group, r)

    return [d for per_rank in epmoe.run_thread_ranks(WORLD, main) for d in per_rank]


def error_of(call: Callable[[], Any]) -> Tuple[str, str]:
    """(code, message) of the epmoe.Error `call` raises, or ('no error', '')."""
    try:
        call()
    except epmoe.Error as e:
        return (e.code, str(e))
    return ("no error", "")
