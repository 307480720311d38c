"""Groups over another runtime's all-gather (what the torch.distributed and mpi4py adapters build on), and
the Buffer's group and backend checks. No torch needed (the torch adapter is tested in test_torch_tensors.py,
the mpi4py one in test_mpi4py.py)."""

from __future__ import annotations

import pytest

import epmoe
from conftest import TIMEOUT_S


def test_a_callback_group_runs_every_collective():
    """Group.from_all_gather (what the torch / mpi4py adapters build on), driven by thread ranks."""
    R = 3

    def rank_main(threads_group):
        calls = []

        def all_gather(data, phase):
            calls.append(phase)
            return b"".join(threads_group.all_gather_bytes(data))

        g = epmoe.Group.from_all_gather(threads_group.rank(), R, "test", all_gather)
        assert (g.rank(), g.size(), g.backend) == (threads_group.rank(), R, "test")
        g.barrier("b")
        gathered = g.all_gather_bytes(bytes([g.rank()]) * (g.rank() + 2))
        root = g.broadcast_bytes(bytes([10 + g.rank()] * 3), 1)
        g.check_agreement([("hidden", 256), ("topk", 8)])
        with pytest.raises(epmoe.Error) as mismatch:
            g.check_agreement([("hidden", 256 + (g.rank() == 2))], "mismatch phase")
        return gathered, root, mismatch.value.code, str(mismatch.value), calls

    for r, (gathered, root, code, msg, calls) in enumerate(epmoe.run_thread_ranks(R, rank_main, timeout_s=TIMEOUT_S)):
        assert gathered == [bytes([s]) * (s + 2) for s in range(R)]
        assert root == bytes([11] * 3)
        assert code == "rank_mismatch" and "hidden" in msg
        assert "b" in calls and "mismatch phase" in calls


def test_a_failing_all_gather_names_rank_and_phase():
    def broken(data, phase):
        raise RuntimeError("peer went away")

    g = epmoe.Group.from_all_gather(0, 2, "test", broken)
    with pytest.raises(epmoe.Error) as e:
        g.barrier("my phase")
    assert e.value.code == "internal"
    assert "rank 0" in str(e.value) and "my phase" in str(e.value) and "peer went away" in str(e.value)
    with pytest.raises(epmoe.Error) as again:  # the group is unusable afterwards
        g.barrier("next")
    assert again.value.code == "unusable"
    short = epmoe.Group.from_all_gather(0, 2, "test", lambda data, phase: data)  # returns 1 rank's bytes
    with pytest.raises(epmoe.Error, match=r"returned 1 bytes, expected 2 \(2 ranks x 1 bytes\)"):
        short.barrier("short phase")
    for bad in (dict(rank=2, size=2), dict(rank=0, size=0)):
        with pytest.raises(epmoe.Error, match="invalid argument"):
            epmoe.Group.from_all_gather(backend="test", all_gather=broken, **bad)
    with pytest.raises(epmoe.Error, match="'backend'"):
        epmoe.Group.from_all_gather(0, 1, "threads", broken)


def test_buffer_rejects_bad_groups_and_backends():
    with pytest.raises(epmoe.Error, match="'comm'"):
        epmoe.Buffer(None, comm=object())

    def rank_main(group):
        with pytest.raises(epmoe.Error, match="'backend'"):
            epmoe.Buffer(group, backend="nvshmem")
        with pytest.raises(epmoe.Error, match="'device'"):
            epmoe.Buffer(group, backend="threads", device=-2)
        buf = epmoe.Buffer(group, backend="threads")
        assert buf.backend == "threads"
        return True

    assert all(epmoe.run_thread_ranks(2, rank_main, timeout_s=TIMEOUT_S))
