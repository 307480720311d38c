// cuda-ipc backend, normal mode (semantics §4, 10): dispatch and combine between the GPUs of one host over
// NVLink, through one worst-case-sized device buffer per rank that every peer maps (CUDA IPC handles
// between processes, plain peer access within one process). CUDA-free header: Buffer includes it in
// every build; the class is only constructed in CUDA builds (cuda_ipc/normal.cpp, cuda_ipc/normal_kernels.cu).
//
// Buffer of each rank: [control | data]. Addresses inside it are computed directly from the rank
// prefix matrix (no ring queues), after DeepEP's maintainers' suggestion (deepseek-ai/DeepEP#39):
//  - control: count slots [parity][source] (tag = op sequence number, written last with release),
//    done flags [source][sender block] (= sequence number once that block's rows are written);
//  - data: one op at a time. Dispatch: rows of this rank's recv_x in final order (source rank
//    ascending, token order within), as separate field arrays (x, scales, local topk ids, weights, src
//    index). Combine: for this rank's tokens, the rows each destination rank sends back, grouped by
//    destination (ascending), in this rank's send order.
// Every op (dispatch, cached dispatch, combine) starts with a handshake in which each rank writes its
// tag (and, for dispatch, its counts) into every peer's slot and waits for every peer's: an op's
// handshake completes only after every peer finished its previous op on its communication stream, so
// the one data region is never overwritten while a peer still reads it.
//
// Results are bit-identical to the threads backend (include/epmoe/buffer.hpp): rows land where the CPU
// puts them, local ids and zeroed weights are computed with the same formula, and combine sums in
// float32 in ascending destination rank order with __fadd_rn (no contraction), biases last, one
// rounding with the CPU's float_to_bf16.
#pragma once

#include <epmoe/buffer.hpp>

#include "transport/backend.hpp"

#include <cstdint>
#include <memory>

namespace epmoe {

namespace cuda_ipc {
class CommStream;
}

/// Normal-mode dispatch/combine of a cuda_ipc Buffer. Collective: every rank of the group constructs
/// one, with equal num_nvl_bytes and num_sms (compared at construction: rank_mismatch).
class CudaIpcNormal : public NormalBackend {
 public:
  /// See Buffer::dispatch. Tensors must be CUDA tensors on this rank's device. Errors as the CPU
  /// backend's, plus out_of_memory (num_nvl_bytes too small; names the bytes needed), timeout
  /// (device-side, names rank, peer and phase; the buffer is unusable afterwards), unusable.
  DispatchResult dispatch(const DispatchArgs& args) override = 0;
  /// See Buffer::combine.
  CombineResult combine(const CombineArgs& args) override = 0;
  /// The CUDA device of this rank.
  virtual int device() const = 0;
  /// The communication stream, shared with the buffer's low-latency mode (cuda_ipc/stream.hpp).
  virtual std::shared_ptr<cuda_ipc::CommStream> shared_comm_stream() const = 0;
};


/// Constructs the backend (CUDA builds; elsewhere throws unsupported). Collective over `group`.
std::unique_ptr<CudaIpcNormal> make_cuda_ipc_normal(std::shared_ptr<Group> group, const BufferOptions& options,
                                                    std::uint64_t buffer_id);

}  // namespace epmoe
