// The two interfaces every backend implements, and the constructors Buffer picks one from.
//
// A backend moves one Buffer's data: `threads` (ranks are threads of one process), `mpi` (processes,
// over MPI one-sided and two-sided calls) and `cuda_ipc` (the GPUs of one host over NVLink). Buffer
// (buffer.cpp) makes one backend at construction and forwards every call to it; each backend runs the
// argument checks of args/ before it communicates, so every backend raises the same error, with the
// same message, for the same bad argument. Layout of the folder:
//   args/      the argument checks, one rule and one message per argument, for every backend
//   group/     process groups (threads, MPI): ranks, collectives, bootstrap; no data movement
//   cpu/       normal and low-latency mode on CPU tensors, written once over a byte mover (Transport)
//   threads/   the byte mover of a threads group (peers' memory read directly)
//   mpi/       the byte mover of an MPI group (all-to-all exchange, RMA windows)
//   cuda_ipc/  both modes on CUDA tensors: device memory every peer maps, host sides, kernels
#pragma once

#include <epmoe/buffer.hpp>

#include <cstdint>
#include <memory>

namespace epmoe {

/// Normal (high-throughput) mode of one backend: what Buffer::dispatch and Buffer::combine forward to.
class NormalBackend {
 public:
  virtual ~NormalBackend() = default;
  /// See Buffer::dispatch. Collective.
  virtual DispatchResult dispatch(const DispatchArgs& args) = 0;
  /// See Buffer::combine. Collective.
  virtual CombineResult combine(const CombineArgs& args) = 0;
  /// See Buffer::comm_stream (the null Stream on CPU backends).
  virtual Stream comm_stream() const { return {}; }
  /// See Buffer::local_buffer (undefined on CPU backends).
  virtual TensorView local_buffer() const { return {}; }
};

/// Low-latency (decode) mode of one backend: what Buffer::low_latency_* forward to.
class LowLatencyBackend {
 public:
  virtual ~LowLatencyBackend() = default;
  /// See Buffer::low_latency_dispatch.
  virtual LowLatencyDispatchResult dispatch(const LowLatencyDispatchArgs& args) = 0;
  /// See Buffer::low_latency_combine.
  virtual LowLatencyCombineResult combine(const LowLatencyCombineArgs& args) = 0;
  /// Collective: zeroes the window; pending hooks and earlier handles become stale.
  virtual void clean(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_experts) = 0;
  /// See Buffer::local_buffer (undefined on CPU backends and before the window exists).
  virtual TensorView local_buffer() const { return {}; }
  /// See Buffer::get_next_low_latency_combine_buffer.
  virtual TensorView next_combine_buffer(const LowLatencyHandle& handle) = 0;
};

/// One backend: both modes of one Buffer.
struct BackendModes {
  std::unique_ptr<NormalBackend> normal;
  std::unique_ptr<LowLatencyBackend> low_latency;
};

/// Window bytes per rank that low-latency mode needs for these settings (both halves; the layout of
/// low_latency_protocol.hpp, the same on every backend). Defined in cpu/backend.cpp. Errors: invalid_argument for
/// non-positive sizes, num_experts % num_ranks != 0 or more than 1024 experts per rank.
std::int64_t low_latency_window_bytes(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_ranks,
                                      int num_experts);

/// Data bytes (num_nvl_bytes) a cuda_ipc buffer needs so that any normal-mode dispatch/combine of up to
/// `max_tokens_per_rank` tokens per rank fits: every rank may receive R * max_tokens rows, each as large as the larger
/// of a bf16 dispatch row (x, local ids, weights, source index) and a combine row. Defined in cuda_ipc/normal.cpp
/// (in every build). Errors: invalid_argument naming the argument out of range.
std::int64_t cuda_ipc_normal_size_hint(std::int64_t max_tokens_per_rank, std::int64_t hidden, int num_ranks,
                                       int num_topk);

/// The threads or mpi backend (`backend`: Backend::threads or Backend::mpi) over `group`, which must be
/// of that kind: both modes on CPU tensors (cpu/). Errors: unsupported when this build lacks MPI.
BackendModes make_cpu_backend(std::shared_ptr<Group> group, Backend backend, const BufferOptions& options,
                              std::uint64_t buffer_id);

/// The cuda_ipc backend (cuda_ipc/backend.cpp): normal mode on CUDA tensors; low-latency mode on CUDA tensors,
/// and on CPU tensors through the group's own CPU backend when it is a threads or MPI group. Collective.
/// Errors: unsupported in CPU-only builds, and those of CudaIpcNormal's construction.
BackendModes make_cuda_ipc_backend(std::shared_ptr<Group> group, const BufferOptions& options,
                                   std::uint64_t buffer_id);

}  // namespace epmoe
