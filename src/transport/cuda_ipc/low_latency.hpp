// cuda_ipc backend, low-latency mode on GPUs (semantics §5): decode-time dispatch and combine between the GPUs of one
// host over NVLink, with no host synchronisation (CUDA-graph capturable) and receive hooks. CUDA-free header:
// Buffer includes it in every build; the class is only constructed in CUDA builds.
//
// Semantics and byte protocol are the CPU implementation's (cpu/low_latency_mode.hpp/.cpp), and results are
// bit-identical to the threads backend: each rank's window (a CudaIpcMemory mapped by every peer) holds a control
// block (data / consumed flags, the device call counter) and then the CPU layout's two halves
// (LowLatencyMode::Layout); call i since the last clean uses half i % 2; a token is sent once per destination rank
// with its (k, local expert) list (TokenMeta) and fanned out by the receiver into packed per-expert rows in
// ascending source rank and source token order; combine sends one bf16 row per (token, k) back, summed over k
// ascending on the token's rank; consumed flags keep a slow receiver (a pending hook) from being overwritten.
//
// Kernels per call: one (dispatch_kernel / combine_kernel, send and receive phases; nvfp4 and the separate fp8
// quantization add a quantize kernel before it); with a recv hook the call launches the send phase and the hook
// the receive phase. The call index lives on the device (Control::calls), so graph replays use fresh indices; the host
// keeps the two-buffer bookkeeping (handles carry a generation), which replays do not touch: a graph must hold
// whole calls (send and receive, or send and its hook), an even number of them keeps the host's half parity equal
// to the device's, and the host checks only eager calls. Errors the kernels find (timeouts, a peer in another call
// or with other settings, ids outside [-1, E) or repeated in a token, a combine topk_idx that differs from the
// dispatch's) go to a host-mapped record and are raised by the next call (timeouts and mismatches make the buffer
// unusable). With BufferOptions::debug_validate (opt-in) and an eager call, topk_idx is also copied to the host
// and checked before any communication, as on CPU ranks (a host synchronisation: turn it off for speed).
#pragma once

#include <epmoe/buffer.hpp>

#include "transport/backend.hpp"

#include <cstdint>
#include <memory>

namespace epmoe {

/// Low-latency dispatch/combine of a cuda_ipc Buffer on CUDA tensors. Collective as the CPU class; the window is
/// allocated (and mapped by every peer) on the first call, with the settings compared across ranks.
class CudaIpcLowLatency : public LowLatencyBackend {
 public:
  /// See Buffer::low_latency_dispatch. Tensors on this rank's device. Outputs are views of the window.
  LowLatencyDispatchResult dispatch(const LowLatencyDispatchArgs& args) override = 0;
  /// See Buffer::low_latency_combine. topk_idx, topk_weights (and out) must stay alive until the receive ran
  /// (the hook, when return_recv_hook).
  LowLatencyCombineResult combine(const LowLatencyCombineArgs& args) override = 0;
  /// Collective: zeroes every rank's window (flags and counters); pending hooks and older handles become stale.
  void clean(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_experts) override = 0;
  /// Whether a call (or clean) has fixed num_max_dispatch_tokens_per_rank, hidden and num_experts and allocated the
  /// window.
  virtual bool configured() const = 0;
};

namespace cuda_ipc {
class CommStream;
}

/// Constructs the GPU low-latency mode of a cuda_ipc buffer on cuda:`device` (no collective until the first call);
/// async_finish work runs on `comm`, the buffer's communication stream. Errors: unsupported in CPU-only builds.
std::unique_ptr<CudaIpcLowLatency> make_cuda_ipc_low_latency(std::shared_ptr<Group> group, int device,
                                                             const BufferOptions& options, std::uint64_t buffer_id,
                                                             std::shared_ptr<cuda_ipc::CommStream> comm);

}  // namespace epmoe
