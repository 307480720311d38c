"""Expert load statistics and expert-parallel load balancing (semantics §9).

``rebalance_experts`` is DeepSeek's EPLB (github.com/deepseek-ai/EPLB, ``eplb.rebalance_experts``: same
names, argument order and outputs), computed in float64 by epmoe's C++ core with every tie fixed (see
``rebalance_experts``). ``map_to_physical`` routes logical expert ids to the replicas of a plan, and
``ExpertLoadRecorder`` collects the loads to plan from: attached to a layer (``MoELayer.set_load_recorder``) it
records every forward's received counts per expert, on the host or on the layer's GPU (no synchronisation), and
``global_loads(group)`` sums every rank's. The planner runs on the host. Errors are ``epmoe.Error`` naming the
argument, what was expected and what came.
"""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from . import _ext
from ._tensor import (BFLOAT16, FLOAT8_E4M3FN, arg, describe, framework_of, int64_arg, invalid_argument, is_torch,
                      on_stream, required)


def _host_numpy(name: str, x: Any, dtype: Any) -> np.ndarray:
    """A C-contiguous NumPy array of `dtype` with x's values (torch tensors are moved to the CPU). Refused naming
    `name` (epmoe.Error('invalid_argument')): None (NumPy would make it a 0-d object array, and the error would describe
    that instead), nested lists of different lengths (NumPy's own ValueError names no argument), and values `dtype`
    does not hold as they are (check_numeric_array)."""
    required(name, x)
    if is_torch(x):
        x = x.detach().cpu().numpy()
    try:
        a = np.asarray(x)
    except ValueError:  # e.g. [[1, 2], [3]]: "inhomogeneous shape"
        raise invalid_argument(name, "an array (or nested lists of one shape)", describe(x)) from None
    check_numeric_array(name, a, dtype)
    return np.ascontiguousarray(a, dtype=dtype)


# ml_dtypes' floating types: NumPy gives them kind 'V', yet their values are real numbers.
_ML_FLOATS = (BFLOAT16, FLOAT8_E4M3FN)


def check_numeric_array(name: str, a: np.ndarray, dtype: Any = np.int64) -> None:
    """Refuses a non-empty array `a` whose values epmoe, reading them as `dtype`, would not take as they are, naming
    `name`, the dtypes taken and a's dtype (epmoe.Error('invalid_argument')). For an integer `dtype`: integer arrays
    (any width, signed or not); a float one would be truncated (0.9 counts as 0, a NaN as a count nobody gave). For
    a floating `dtype`: integer or floating arrays (ml_dtypes' bfloat16 and float8_e4m3fn too); NumPy would read
    digit strings as numbers, drop imaginary parts and count booleans, and objects could be anything. An empty array
    passes, whatever its dtype (np.asarray([]) is float64)."""
    target = np.dtype(dtype)
    kind = a.dtype.kind
    if target.kind in "iu":
        ok, taken = kind in "iu", "an integer array"
    else:
        ok, taken = kind in "iuf" or a.dtype in _ML_FLOATS, "an integer or floating array"
    if a.size > 0 and not ok:
        raise invalid_argument(name, f"{taken} ({target.name} values)", describe(a))


def _like(x: Any, *arrays: np.ndarray) -> Any:
    """The arrays as torch CPU tensors when x is a torch tensor, else as they are."""
    if is_torch(x):
        import torch
        return tuple(torch.from_numpy(a) for a in arrays)
    return arrays


def rebalance_experts(weight: Any, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> Tuple[Any, Any, Any]:
    """DeepSeek's EPLB: replicate hot experts into spare slots and pack the slots onto GPUs.

    Arguments:
        weight: [L, E] load of each logical expert per layer (e.g. tokens; NumPy array or torch tensor of an
            integer or floating dtype, converted to float64), finite and >= 0.
        num_replicas: P, physical expert slots in total; P >= E and a multiple of num_gpus.
        num_groups: G expert groups (E % G == 0; group g = experts g*E/G .. (g+1)*E/G - 1).
        num_nodes: N server nodes; num_gpus % N == 0.
        num_gpus: M GPUs in total; slot p lives on GPU p // (P/M), GPU m on node m // (M/N).

    Hierarchical when G % N == 0: groups are packed onto nodes (G/N each) by balanced packing of their summed
    loads, each node's E/N experts get P/N slots (one more replica at a time to the expert with the largest
    load per replica), and each node's slots are packed onto its GPUs (P/M each) by load per replica. Else the
    same with one group on one node (global). Balanced packing puts items in descending load order into the
    lightest pack with room. Ties: lower item index first, lower pack index, lower expert index; with one
    item per pack, item i goes to pack i.

    Returns: (phy2log int64 [L, P], log2phy int64 [L, E, X] padded with -1 where X is the most replicas of
    any expert, logcnt int64 [L, E]); NumPy arrays, torch CPU tensors when weight is a torch tensor.
    log2phy[l, e, r] is the slot of expert e's replica r.
    Errors: epmoe.Error('invalid_argument') naming 'weight' (not 2-d, a negative or non-finite load, a dtype that
    is not an integer or floating one: bool, complex, strings, objects), 'num_replicas', 'num_groups', 'num_nodes' or
    'num_gpus'.
    """
    w = _host_numpy("weight", weight, np.float64)
    phy2log, log2phy, logcnt = _ext.rebalance_experts(w, int64_arg("num_replicas", num_replicas),
                                                      int64_arg("num_groups", num_groups),
                                                      int64_arg("num_nodes", num_nodes),
                                                      int64_arg("num_gpus", num_gpus))
    return _like(weight, phy2log, log2phy, logcnt)


def map_to_physical(topk_idx: Any, logical_to_physical: Any, logical_replica_count: Any, layer: int) -> Any:
    """Maps logical expert ids of one layer to physical slots of a rebalance_experts plan.

    Arguments:
        topk_idx: int32 or int64 [T, K] logical ids in [0, E) or -1 (NumPy array or torch CPU tensor).
        logical_to_physical: int64 [L, E, X] (log2phy); logical_replica_count: int64 [L, E] (logcnt).
        layer: which layer's plan, in [0, L).

    Token t's choice e goes to replica t mod logcnt[layer, e] (deterministic; spreads an expert's tokens
    evenly over its replicas); -1 stays -1.
    Returns: physical ids, topk_idx's dtype, shape and framework.
    Errors: epmoe.Error('invalid_argument') naming 'topk_idx', 'logical_to_physical', 'logical_replica_count'
    or 'layer'.
    """
    log2phy = _host_numpy("logical_to_physical", logical_to_physical, np.int64)
    logcnt = _host_numpy("logical_replica_count", logical_replica_count, np.int64)
    return _ext.map_to_physical(arg(required("topk_idx", topk_idx)), log2phy, logcnt, int64_arg("layer", layer),
                                framework_of(topk_idx))


def logical_loads(physical_loads: Any, physical_to_logical: Any, num_logical_experts: int) -> Any:
    """Folds loads counted per physical slot back to the logical experts of a plan.

    Arguments:
        physical_loads: int64 [L, P] tokens per physical slot (e.g. ExpertLoadRecorder.global_loads of layers
            running an EPLB plan: the dispatch routed physical slots).
        physical_to_logical: int64 [L, P] (rebalance_experts' phy2log).
        num_logical_experts: E.

    Returns: int64 [L, E], entry [l, e] the sum over expert e's replicas (the weight to plan the next placement
    from); NumPy, or a torch CPU tensor when physical_loads is one.
    Errors: epmoe.Error('invalid_argument') naming 'physical_loads' (shape, a negative count),
    'physical_to_logical' or 'plan' (an entry outside [0, E)).
    """
    out = _ext.logical_loads(_host_numpy("physical_loads", physical_loads, np.int64),
                             _host_numpy("physical_to_logical", physical_to_logical, np.int64),
                             int64_arg("num_logical_experts", num_logical_experts))
    return _like(physical_loads, out)[0]


def _device_index(device: Any) -> int:
    """-1 for 'cpu', N for 'cuda:N' (or an int N >= 0, or a torch.device); else invalid_argument naming device."""
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    text = str(device)
    if text == "cpu":
        return -1
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    if text == "cuda":
        return 0
    raise invalid_argument("device", "'cpu', 'cuda:N' or a CUDA device index >= 0", repr(device))


def load_balancedness(loads: Any, num_ranks: int) -> np.ndarray:
    """float64 [L]: for int64 [L, E] loads (e.g. ExpertLoadRecorder.global_loads), the mean over num_ranks ranks
    of a rank's load (expert e on rank e // (E // num_ranks)) divided by the most loaded rank's; 1 for a layer with
    no tokens. Errors: epmoe.Error('invalid_argument') naming 'loads' (not 2-d) or 'num_ranks' (< 1 or not dividing
    E)."""
    return _ext.load_balancedness(_host_numpy("loads", loads, np.int64), int64_arg("num_ranks", num_ranks))


class ExpertLoadRecorder:
    """Tokens per (layer, expert) over each layer's last `window` records; balancedness; JSON (semantics §9).

    Expert e belongs to rank e // (num_experts // num_ranks). Feed it either by hand (``record``: int32/int64 [E]
    counts, e.g. ``get_dispatch_layout``'s num_tokens_per_expert) or by attaching it to layers
    (``MoELayer.set_load_recorder(recorder, layer)``): every forward then records the counts of the experts this
    rank received tokens for (normal: num_recv_tokens_per_expert; low-latency: masked_m; no-EP: all E), at this
    rank's experts [rank * E_local, (rank + 1) * E_local), zeros elsewhere. Each rank records its own experts;
    ``global_loads(group)`` sums every rank's record into the [L, E] loads rebalance_experts plans from.

    device: 'cpu' (default) or 'cuda:N' (an int N too): where the state and the recorded counts live. On a GPU
    each record is one kernel on the current stream (the ring slot is kept and advanced on the device, so a
    forward captured in a CUDA graph records into the next slot on every replay); reading (loads, num_records,
    balancedness, to_json, global_loads) copies to the host and waits for the current stream. Record, reset and
    read on one stream. Not thread-safe: one recorder per rank.

    Errors: epmoe.Error('invalid_argument') naming 'num_layers', 'num_experts', 'num_ranks' (must divide
    num_experts), 'window' (each >= 1; an int that is not one, or one outside int64, named as well) or 'device';
    epmoe.Error('out_of_memory') naming 'window' when a host recorder's num_layers x window x num_experts int64
    counts exceed this machine's memory (checked before allocating); 'unsupported' for a GPU in a build without
    CUDA.
    """

    def __init__(self, num_layers: int, num_experts: int, num_ranks: int, window: int, device: Any = "cpu") -> None:
        self._impl = _ext.ExpertLoadRecorder(int64_arg("num_layers", num_layers), int64_arg("num_experts", num_experts),
                                             int64_arg("num_ranks", num_ranks), int64_arg("window", window),
                                             _device_index(device))

    num_layers = property(lambda self: self._impl.num_layers)
    num_experts = property(lambda self: self._impl.num_experts)
    num_ranks = property(lambda self: self._impl.num_ranks)
    window = property(lambda self: self._impl.window)
    device = property(lambda self: self._impl.device, doc="'cpu' or 'cuda:N': where the state lives.")

    def record(self, layer: int, num_tokens_per_expert: Any) -> None:
        """Adds one step's counts (int32 or int64 [E], >= 0, on the recorder's device: NumPy or torch/CuPy) for
        `layer`; the oldest record of the layer drops out once it holds `window`. A GPU record is enqueued on the
        tensor's current stream and its values are not checked on the host. Errors name 'layer' or
        'num_tokens_per_expert'; a rejected record changes nothing."""
        required("num_tokens_per_expert", num_tokens_per_expert)
        with on_stream(num_tokens_per_expert):
            self._impl.record(int64_arg("layer", layer), arg(num_tokens_per_expert))

    def record_local(self, layer: int, num_recv_tokens_per_expert: Any, expert_offset: int) -> None:
        """As record, for counts known for experts [expert_offset, expert_offset + n) only (int32 or int64 [n]: one
        rank's received counts, what a layer records); the record's other experts get 0. Errors name 'layer',
        'num_recv_tokens_per_expert' or 'expert_offset' (< 0, or expert_offset + n > E)."""
        required("num_recv_tokens_per_expert", num_recv_tokens_per_expert)
        with on_stream(num_recv_tokens_per_expert):
            self._impl.record_local(int64_arg("layer", layer), arg(num_recv_tokens_per_expert),
                                    int64_arg("expert_offset", expert_offset))

    def loads(self) -> np.ndarray:
        """int64 [L, E]: tokens per expert summed over each layer's window, this rank's records (the weight for
        rebalance_experts with one rank; with several use global_loads). A GPU recorder copies them to the host
        and waits for the current stream."""
        return self._impl.loads()

    def global_loads(self, group: Any) -> np.ndarray:
        """int64 [L, E]: the sum over every rank of `group` of its recorder's loads() (collective: every rank
        calls it with its own recorder of the same num_layers and num_experts; one all-gather). With recorders
        fed by MoELayer, the loads of all experts over all ranks. group: an epmoe Group (run_thread_ranks), or
        whatever epmoe.as_group accepts. Errors: epmoe.Error('rank_mismatch') when the ranks' shapes differ."""
        from ._group import as_group
        return self._impl.global_loads(as_group(group))

    def balancedness(self) -> np.ndarray:
        """float64 [L]: mean load per rank / max load per rank of loads() (1 is balanced; 1 for a layer with no
        tokens). For recorders fed by MoELayer use load_balancedness(global_loads(group), num_ranks)."""
        return self._impl.balancedness()

    def num_records(self) -> np.ndarray:
        """int64 [L]: records in each layer's window."""
        return self._impl.num_records()

    def to_json(self, group: Any = None) -> str:
        """{"num_layers", "num_experts", "num_ranks", "window", "num_records", "loads", "balancedness"}: of this
        rank's records, or with `group` of the global loads (collective, as global_loads)."""
        if group is None:
            return self._impl.to_json()
        from ._group import as_group
        return self._impl.to_json(as_group(group))

    def reset(self) -> None:
        """Forgets every record (on a GPU: a memset on the current stream)."""
        self._impl.reset()

    def __repr__(self) -> str:
        return (f"epmoe.ExpertLoadRecorder(num_layers={self.num_layers}, num_experts={self.num_experts}, "
                f"num_ranks={self.num_ranks}, window={self.window}, device='{self.device}')")


__all__ = ["ExpertLoadRecorder", "load_balancedness", "map_to_physical", "rebalance_experts"]
