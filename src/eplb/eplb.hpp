// Module interface of the eplb stage (the one header of src/eplb/ other folders may include): the recorder's CUDA
// entry points (cuda.cu, CUDA builds only: EPMOE_HAVE_CUDA). Arguments are checked by load_recorder.cpp; everything
// here runs on `device` (made current for the call) and is asynchronous on `stream` unless it says otherwise.
#pragma once

#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <cstddef>
#include <cstdint>

namespace epmoe::eplb_detail {

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

}  // namespace epmoe::eplb_detail
