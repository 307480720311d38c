// The EPLB stage's interface to other folders (src/moe): the CUDA twins of the id mappings (cuda.cu; CUDA builds
// only: EPMOE_HAVE_CUDA). Asynchronous on `stream`, no host synchronisation, nothing launched for an empty
// topk_idx. No fmt here: nvcc compiles cuda.cu.
#pragma once

#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

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

/// Synchronous copies between host and the current device (small tables, at setup).
void copy_to_device(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);

}  // namespace epmoe::eplb_cuda
