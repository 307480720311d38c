// The cuda_ipc backend: normal mode is CudaIpcNormal; low-latency mode runs on the GPUs for CUDA tensors
// (CudaIpcLowLatency, made at the first such call) and on the group's CPU backend for CPU tensors.
#include "transport/backend.hpp"

#include "core/check.hpp"
#include <epmoe/error.hpp>

#include <string_view>

#include "transport/cuda_ipc/low_latency.hpp"
#include "transport/cuda_ipc/normal.hpp"

namespace epmoe {

namespace {

class CudaIpcLowLatencyModes final : public LowLatencyBackend {
 public:
  CudaIpcLowLatencyModes(std::shared_ptr<Group> group, int device, const BufferOptions& options,
                         std::uint64_t buffer_id, std::unique_ptr<LowLatencyBackend> cpu,
                         std::shared_ptr<cuda_ipc::CommStream> comm)
      : group_(std::move(group)),
        device_(device),
        options_(options),
        buffer_id_(buffer_id),
        cpu_(std::move(cpu)),
        comm_(std::move(comm)) {}

  LowLatencyDispatchResult dispatch(const LowLatencyDispatchArgs& args) override {
    if (args.x.device.is_cuda()) return gpu().dispatch(args);
    return cpu().dispatch(args);
  }
  TensorView next_combine_buffer(const LowLatencyHandle& handle) override {
    if (handle.src_info.device.is_cuda()) return gpu().next_combine_buffer(handle);
    return cpu().next_combine_buffer(handle);
  }
  LowLatencyCombineResult combine(const LowLatencyCombineArgs& args) override {
    if (args.x.device.is_cuda() || (args.handle != nullptr && args.handle->src_info.device.is_cuda()))
      return gpu().combine(args);
    return cpu().combine(args);
  }
  // The GPU mode's window once it is in use (the same on every rank), else the CPU one.
  void clean(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_experts) override {
    if (gpu_ && gpu_->configured()) return gpu_->clean(num_max_dispatch_tokens_per_rank, hidden, num_experts);
    cpu().clean(num_max_dispatch_tokens_per_rank, hidden, num_experts);
  }
  TensorView local_buffer() const override { return gpu_ ? gpu_->local_buffer() : TensorView{}; }

 private:
  CudaIpcLowLatency& gpu() {
    if (!gpu_) gpu_ = make_cuda_ipc_low_latency(group_, device_, options_, buffer_id_, comm_);
    return *gpu_;
  }
  // Low-latency mode on CPU tensors runs on the group's CPU transport, which only threads and MPI groups have.
  LowLatencyBackend& cpu() {
    if (!cpu_)
      raise(ErrorCode::unsupported,
            "low-latency mode needs a CPU transport, which a '{}' group does not have (use a threads or MPI group)",
            group_->backend());
    return *cpu_;
  }

  std::shared_ptr<Group> group_;
  int device_;
  BufferOptions options_;
  std::uint64_t buffer_id_;
  std::unique_ptr<LowLatencyBackend> cpu_;
  std::shared_ptr<cuda_ipc::CommStream> comm_;  // the normal mode's, shared
  std::unique_ptr<CudaIpcLowLatency> gpu_;
};

}  // namespace

BackendModes make_cuda_ipc_backend(std::shared_ptr<Group> group, const BufferOptions& options,
                                   std::uint64_t buffer_id) {
  // A group of another kind (e.g. one adapted from Python's torch.distributed) has no CPU transport: it still
  // bootstraps normal mode and GPU low-latency mode.
  const std::string_view kind = group->backend();
  std::unique_ptr<LowLatencyBackend> cpu_low_latency;
  if (kind == "threads" || kind == "mpi")
    cpu_low_latency =
        make_cpu_backend(group, kind == "mpi" ? Backend::mpi : Backend::threads, options, buffer_id).low_latency;
  BackendModes modes;
  auto normal = make_cuda_ipc_normal(group, options, buffer_id);
  const int device = normal->device();
  std::shared_ptr<cuda_ipc::CommStream> comm = normal->shared_comm_stream();
  modes.normal = std::move(normal);
  modes.low_latency = std::make_unique<CudaIpcLowLatencyModes>(std::move(group), device, options, buffer_id,
                                                               std::move(cpu_low_latency), std::move(comm));
  return modes;
}

}  // namespace epmoe
