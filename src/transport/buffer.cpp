// Buffer: picks the transport for the group and forwards to the mode implementations.
#include "core/check.hpp"
#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>

#include <atomic>

#include "transport/cuda_ipc.hpp"
#include "transport/cuda_ipc_low_latency.hpp"
#include "transport/low_latency_mode.hpp"
#include "transport/normal_mode.hpp"
#include "transport/transport.hpp"

namespace epmoe {

#if defined(EPMOE_HAVE_MPI)
std::unique_ptr<Transport> make_mpi_transport(std::shared_ptr<Group> group);
#endif

struct Buffer::Impl {
  std::shared_ptr<Group> group;
  std::unique_ptr<Transport> transport;
  std::uint64_t id;
  std::unique_ptr<NormalMode> normal;
  std::unique_ptr<LowLatencyMode> low_latency;
  std::unique_ptr<CudaIpcNormal> cuda_ipc;  ///< set for Backend::cuda_ipc: normal mode runs there
  /// cuda_ipc: low-latency calls on CUDA tensors (created at the first one; CPU tensors use `low_latency`).
  std::unique_ptr<CudaIpcLowLatency> cuda_low_latency;
  BufferOptions options;
  CudaIpcLowLatency& gpu_low_latency() {
    if (!cuda_low_latency) cuda_low_latency = make_cuda_ipc_low_latency(group, cuda_ipc->device(), options, id);
    return *cuda_low_latency;
  }
};

namespace {
std::uint64_t next_buffer_id() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1);
}

std::unique_ptr<Transport> make_transport(const std::shared_ptr<Group>& group, Backend backend) {
  const std::string_view kind = group->backend();
  if (backend == Backend::automatic) backend = kind == "mpi" ? Backend::mpi : Backend::threads;
  switch (backend) {
    case Backend::threads: return make_threads_transport(group);
#if defined(EPMOE_HAVE_MPI)
    case Backend::mpi: return make_mpi_transport(group);
#endif
    default: break;
  }
  raise(ErrorCode::unsupported, "backend {} is not available for a '{}' group in this build",
        static_cast<int>(backend), kind);
}
}  // namespace

Buffer::Buffer(std::shared_ptr<Group> group, BufferOptions options) : impl_(std::make_unique<Impl>()) {
  EPMOE_CHECK_ARG(group != nullptr, "group", "a Group", "null");
  EPMOE_CHECK_ARG(options.num_rdma_bytes >= 0, "num_rdma_bytes", ">= 0", options.num_rdma_bytes);
  impl_->group = group;
  impl_->options = options;
  // cuda_ipc moves normal mode over NVLink; the group's own transport still serves low-latency mode.
  const bool ipc = options.backend == Backend::cuda_ipc;
  // A group of another kind (e.g. one adapted from Python's torch.distributed) has no CPU transport: with
  // cuda_ipc it still serves normal mode (the group only bootstraps), and low-latency calls are unsupported.
  const std::string_view kind = group->backend();
  const bool cpu_transport = !ipc || kind == "threads" || kind == "mpi";
  if (cpu_transport) impl_->transport = make_transport(group, ipc ? Backend::automatic : options.backend);
  impl_->id = next_buffer_id();
  if (ipc) impl_->cuda_ipc = make_cuda_ipc_normal(group, options, impl_->id);
  if (!impl_->transport) return;
  impl_->normal = std::make_unique<NormalMode>(*impl_->transport, impl_->id);
  impl_->low_latency = std::make_unique<LowLatencyMode>(*impl_->transport, impl_->id, options.num_rdma_bytes);
}

namespace {
// Low-latency mode runs on the group's CPU transport, which only threads and MPI groups have.
void require_low_latency(const std::unique_ptr<LowLatencyMode>& ll, const Group& group) {
  if (!ll)
    raise(ErrorCode::unsupported,
          "low-latency mode needs a CPU transport, which a '{}' group does not have (use a threads or MPI group)",
          group.backend());
}
}  // namespace

Buffer::~Buffer() = default;

int Buffer::rank() const { return impl_->group->rank(); }
int Buffer::num_ranks() const { return impl_->group->size(); }
Group& Buffer::group() const { return *impl_->group; }

std::int64_t Buffer::get_low_latency_rdma_size_hint(int tmax, std::int64_t hidden, int num_ranks, int num_experts) {
  return LowLatencyMode::size_hint(tmax, hidden, num_ranks, num_experts);
}

DispatchArgs make_dispatch_args(const DispatchLayout& layout, const TensorView& x, const TensorView& topk_idx,
                                const TensorView& topk_weights) {
  DispatchArgs a;
  a.x = x;
  a.topk_idx = topk_idx;
  a.topk_weights = topk_weights;
  a.num_tokens_per_rank = layout.num_tokens_per_rank;
  a.is_token_in_rank = layout.is_token_in_rank;
  a.num_tokens_per_expert = layout.num_tokens_per_expert;
  return a;
}

DispatchLayout Buffer::get_dispatch_layout(const TensorView& topk_idx, int num_experts) const {
  return epmoe::get_dispatch_layout(topk_idx, num_experts, num_ranks());
}

std::int64_t Buffer::get_normal_nvl_size_hint(std::int64_t max_tokens_per_rank, std::int64_t hidden, int num_ranks,
                                              int num_topk) {
  return cuda_ipc_normal_size_hint(max_tokens_per_rank, hidden, num_ranks, num_topk);
}

DispatchResult Buffer::dispatch(const DispatchArgs& args) {
  return impl_->cuda_ipc ? impl_->cuda_ipc->dispatch(args) : impl_->normal->dispatch(args);
}
CombineResult Buffer::combine(const CombineArgs& args) {
  return impl_->cuda_ipc ? impl_->cuda_ipc->combine(args) : impl_->normal->combine(args);
}
LowLatencyDispatchResult Buffer::low_latency_dispatch(const LowLatencyDispatchArgs& args) {
  // cuda_ipc: CUDA tensors take the GPU low-latency mode (cuda_ipc_low_latency.hpp).
  if (impl_->cuda_ipc && args.x.device.is_cuda()) return impl_->gpu_low_latency().dispatch(args);
  require_low_latency(impl_->low_latency, *impl_->group);
  return impl_->low_latency->dispatch(args);
}
LowLatencyCombineResult Buffer::low_latency_combine(const LowLatencyCombineArgs& args) {
  if (impl_->cuda_ipc &&
      (args.x.device.is_cuda() || (args.handle != nullptr && args.handle->src_info.device.is_cuda())))
    return impl_->gpu_low_latency().combine(args);
  require_low_latency(impl_->low_latency, *impl_->group);
  return impl_->low_latency->combine(args);
}
void Buffer::clean_low_latency_buffer(int tmax, std::int64_t hidden, int num_experts) {
  // cuda_ipc: the GPU mode's window once it is in use (the same on every rank), else the CPU one as before.
  if (impl_->cuda_low_latency && impl_->cuda_low_latency->configured()) {
    impl_->cuda_low_latency->clean(tmax, hidden, num_experts);
    return;
  }
  require_low_latency(impl_->low_latency, *impl_->group);
  impl_->low_latency->clean(tmax, hidden, num_experts);
}

// CPU events are complete; GPU backends' events forward to their EventImpl.
void Event::current_stream_wait() const {
  if (backend_) backend_->current_stream_wait();
}
bool Event::done() const { return !backend_ || backend_->done(); }

void RecvHook::operator()() const {
  if (!state_) raise(ErrorCode::stale_handle, "recv hook is empty (the call was made without return_recv_hook)");
  if (state_->called) raise(ErrorCode::stale_handle, "recv hook called twice: each hook must be called exactly once");
  state_->called = true;
  state_->fn();
}

}  // namespace epmoe
