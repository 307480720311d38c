// Entry points of the MoE stage's CUDA kernels (cuda.cu; CUDA builds only: EPMOE_HAVE_CUDA), private to
// src/moe/: the no-EP prepare (id counts and checks, the BatchedExperts scatter) and semantics §11's host-mapped fault
// record (TopKWeightAndReduce: weight_and_reduce.hpp). The host side (no_ep_cuda.cpp, cuda.cpp) checks every
// argument first; everything here is asynchronous on `stream` and launches no zero-sized grid. No fmt here:
// nvcc compiles cuda.cu.
#pragma once

#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <cstdint>

namespace epmoe::moe_cuda {

/// The fault record of one device, in host-mapped page-locked memory (cudaHostAlloc, mapped). Kernels only
/// store constants or their own values into it (plain stores: every writer of a field writes an equally
/// good value), so no system-scope atomics are needed (hostNativeAtomicSupported is 0 on PCIe hosts).
struct FaultRecord {
  std::uint32_t invalid_id;      ///< 1 once an id outside [-1, E) was skipped
  std::uint32_t overflow;        ///< 1 once a slab got more choices than its rows
  std::int32_t overflow_expert;  ///< one expert that overflowed
  std::int32_t overflow_count;   ///< its choices
  std::int32_t overflow_limit;   ///< its rows (max_tokens)
};

/// The current device's record as the kernels see it (allocated and cleared on first use, which must not
/// happen during a CUDA-graph capture: cudaHostAlloc synchronises).
FaultRecord* fault_record_for_kernels();
/// The host's view of device `device`'s record, or nullptr when no kernel ever used one there.
volatile FaultRecord* fault_record_host(int device);

/// counts[e] = number of entries of topk_idx (int64/int32 [M, K], contiguous) equal to e, for e < E
/// (counts overwritten). Ids outside [-1, E) are skipped and flagged (the fault record, and the first one
/// in the device word cuda::check_invalid_ids reads).
void count_ids(const TensorView& topk_idx, int num_experts, std::int32_t* counts, Stream stream);

/// The BatchedExperts scatter of the no-EP prepare, after make_permute_layout_cuda(topk_idx, E, 1, M*K)
/// gave src2dst, seg_indptr, reorder_topk_ids and per_expert: entry (m, k) with permuted row d goes to slot
/// d - seg_indptr[e] of expert e = reorder[d]. Row m of x (bf16 [M, H], contiguous, H % 8 == 0) is copied to
/// slabs[e, slot] (bf16 [E, max_tokens, H]) and slot_of[m*K + k] = e * max_tokens + slot; entries that are
/// -1, out of range (flagged) or past max_tokens (flagged as overflow, dropped) get slot_of -1.
/// counts[e] = min(per_expert[e], max_tokens). Rows of a slab past its count are not written.
void scatter_to_slabs(const TensorView& x, const TensorView& topk_idx, const std::int32_t* src2dst,
                      const std::int64_t* seg_indptr, const std::int32_t* reorder, const std::int32_t* per_expert,
                      int num_experts, std::int64_t max_tokens, void* slabs, std::int32_t* slot_of,
                      std::int32_t* counts, Stream stream);

/// p[i] = value for i < n.
void fill(float* p, std::int64_t n, float value, Stream stream);

/// p[i] = value for i < n.
void fill_int32(std::int32_t* p, std::int64_t n, std::int32_t value, Stream stream);

/// cudaMemcpyAsync device to device (nothing for 0 bytes).
void copy(void* dst, const void* src, std::size_t bytes, Stream stream);

}  // namespace epmoe::moe_cuda
