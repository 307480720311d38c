// The EPLB stage's interface to other folders (src/moe): its CUDA entry points (cuda.cu; CUDA builds only:
// EPMOE_HAVE_CUDA), the id mappings and the load recorder. Arguments are checked by the host files (planner.cpp,
// load_recorder.cpp); everything here is asynchronous on `stream` unless it says otherwise. No fmt here: nvcc
// compiles cuda.cu.
#pragma once

#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <cstddef>
#include <cstdint>

namespace epmoe::eplb_cuda {

/// map_to_physical (semantics §9) on one GPU: out[t, k] = logical_to_physical[e * X + t mod count[e]] for a
/// logical id e = topk_idx[t, k] in [0, E); -1 stays -1. topk_idx and out: int64 or int32 [T, K] (the same
/// dtype), contiguous, on the current device; logical_to_physical int64 [E, X] and logical_replica_count int64
/// [E] (one layer's rows, already checked on the host: counts in [1, X], slots in [0, P)) on that device.
/// An id it cannot map (outside [-1, E)) is not checked here (that would cost a synchronisation): it stays out
/// of range for the dispatch, which flags it (ids < -1 unchanged, ids e >= E become e - E + P).
void map_to_physical(const TensorView& topk_idx, const std::int64_t* logical_to_physical,
                     const std::int64_t* logical_replica_count, std::int64_t num_logical_experts,
                     std::int64_t max_replicas, std::int64_t num_physical_experts, const TensorView& out,
                     Stream stream);

/// expert_map applied to ids (semantics §8, no expert parallelism): out[t, k] = expert_map[g] for a global id
/// g = topk_idx[t, k] in [0, E), -1 stays -1; expert_map int32 [E] on the current device (checked on the host).
/// Ids outside [-1, E) stay out of range: ids < -1 unchanged, ids g >= E become g - E + E_local.
void apply_expert_map(const TensorView& topk_idx, const std::int32_t* expert_map, std::int64_t num_experts,
                      std::int64_t num_local_experts, const TensorView& out, Stream stream);

/// A synchronous copy from host to the current device (small tables, at setup).
void copy_to_device(void* dst, const void* src, std::size_t bytes);
/// Copies `bytes` of host memory to the current device on `stream`, ordered after the work already queued there
/// (a kernel of an earlier forward still reading dst). `src` may be freed on return: pageable memory is staged
/// before cudaMemcpyAsync returns (CUDA runtime API, "API synchronization behavior").
void copy_to_device_async(void* dst, const void* src, std::size_t bytes, Stream stream);

/// One record of one layer, one block, no host read: the kernel reads the ring slot from `next`, sets
/// history[slot] to the record (counts [n] (int32 or int64, stride counts.stride(0)) at experts
/// [expert_offset, expert_offset + n), zeros elsewhere), updates sums [E] by the difference to the dropped record,
/// then advances *next modulo `window` and *held up to `window`. A CUDA-graph replay therefore records into the
/// next slot too. history: int64 [window, E] of the layer; sums int64 [E]; held, next: one int64 each.
void record_loads_cuda(int device, const TensorView& counts, std::int64_t expert_offset, std::int64_t num_experts,
                       std::int64_t window, std::int64_t* history, std::int64_t* sums, std::int64_t* held,
                       std::int64_t* next, Stream stream);

/// cudaMemsetAsync(p, 0, bytes) on `stream`.
void zero_cuda(int device, void* p, std::size_t bytes, Stream stream);

/// Copies `bytes` from device memory to host memory on `stream` and waits for the stream (the one read that
/// synchronises).
void copy_to_host_cuda(int device, void* dst, const void* src, std::size_t bytes, Stream stream);

/// Waits for `stream`.
void synchronize_cuda(int device, Stream stream);

}  // namespace epmoe::eplb_cuda
