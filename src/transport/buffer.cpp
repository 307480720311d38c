// Buffer: picks its backend once, at construction (backend.hpp), and forwards every call to its modes.
#include "core/check.hpp"
#include <epmoe/buffer.hpp>
#include <epmoe/error.hpp>

#include <atomic>
#include <cmath>

#include "transport/backend.hpp"

namespace epmoe {

// The backend is picked once, here; every call forwards to its modes.
struct Buffer::Impl {
  std::shared_ptr<Group> group;
  BackendModes modes;
  bool debug_validate = false;
};

namespace {
std::uint64_t next_buffer_id() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1);
}

// With debug_validate, a call's topk_weights on the CPU are read before anything is sent (semantics §11): a NaN or
// infinity would otherwise flow into every sum it weights. Opt-in as the id checks of GPU calls are: a scan of every
// weight on each call. Weights of another dtype, shape or device are left to the backend's checks, which name them.
void check_finite_weights(bool debug_validate, const TensorView& w) {
  if (!debug_validate || !w.defined() || !w.device.is_cpu() || w.dtype != DType::fp32 || w.ndim() != 2 ||
      w.data == nullptr)
    return;
  for (std::int64_t t = 0; t < w.size(0); ++t)
    for (std::int64_t k = 0; k < w.size(1); ++k)
      if (const float v = static_cast<const float*>(w.data)[t * w.stride(0) + k * w.stride(1)]; !std::isfinite(v))
        throw_invalid_argument("topk_weights", "finite weights (debug_validate)",
                               fmt::format("{} at [{}, {}]", v, t, k));
}

// Backend::automatic is the group's own kind (mpi for an MPI group, threads otherwise).
Backend resolve_backend(const Group& group, Backend backend) {
  if (backend != Backend::automatic) return backend;
  return group.backend() == "mpi" ? Backend::mpi : Backend::threads;
}
}  // namespace

Buffer::Buffer(std::shared_ptr<Group> group, BufferOptions options) : impl_(std::make_unique<Impl>()) {
  EPMOE_CHECK_ARG(group != nullptr, "group", "a Group", "null");
  EPMOE_CHECK_ARG(options.num_rdma_bytes >= 0, "num_rdma_bytes", ">= 0", options.num_rdma_bytes);
  impl_->group = group;
  impl_->debug_validate = options.debug_validate;
  const std::uint64_t id = next_buffer_id();
  const Backend backend = resolve_backend(*group, options.backend);
  impl_->modes = backend == Backend::cuda_ipc ? make_cuda_ipc_backend(group, options, id)
                                              : make_cpu_backend(group, backend, options, id);
}

Buffer::~Buffer() = default;

int Buffer::rank() const { return impl_->group->rank(); }
int Buffer::num_ranks() const { return impl_->group->size(); }
Group& Buffer::group() const { return *impl_->group; }
Stream Buffer::comm_stream() const { return impl_->modes.normal->comm_stream(); }
TensorView Buffer::local_buffer(bool low_latency_window) const {
  return low_latency_window ? impl_->modes.low_latency->local_buffer() : impl_->modes.normal->local_buffer();
}

std::int64_t Buffer::get_low_latency_rdma_size_hint(int num_max_dispatch_tokens_per_rank, std::int64_t hidden,
                                                   int num_ranks, int num_experts) {
  return low_latency_window_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts);
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
  check_finite_weights(impl_->debug_validate, args.topk_weights);
  return impl_->modes.normal->dispatch(args);
}
CombineResult Buffer::combine(const CombineArgs& args) {
  check_finite_weights(impl_->debug_validate, args.topk_weights);
  return impl_->modes.normal->combine(args);
}
LowLatencyDispatchResult Buffer::low_latency_dispatch(const LowLatencyDispatchArgs& args) {
  check_finite_weights(impl_->debug_validate, args.topk_weights);
  return impl_->modes.low_latency->dispatch(args);
}
LowLatencyCombineResult Buffer::low_latency_combine(const LowLatencyCombineArgs& args) {
  check_finite_weights(impl_->debug_validate, args.topk_weights);
  return impl_->modes.low_latency->combine(args);
}
TensorView Buffer::get_next_low_latency_combine_buffer(const LowLatencyHandle& handle) {
  return impl_->modes.low_latency->next_combine_buffer(handle);
}
void Buffer::clean_low_latency_buffer(int num_max_dispatch_tokens_per_rank, std::int64_t hidden, int num_experts) {
  impl_->modes.low_latency->clean(num_max_dispatch_tokens_per_rank, hidden, num_experts);
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
