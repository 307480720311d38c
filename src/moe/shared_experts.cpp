// Shared experts on a GPU (semantics §8): the layer's side stream that overlaps them with the dispatch, experts
// and combine on the caller's stream, and the built-in dense MLP on the CUDA experts (make_cuda_shared_experts).
#include <epmoe/experts.hpp>
#include <epmoe/moe.hpp>

#include <algorithm>
#include <mutex>
#include <utility>

#include "core/check.hpp"
#include "core/cuda_util.hpp"
#include "moe/layer_extensions.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include "moe/cuda.hpp"
#endif

namespace epmoe {

struct SharedExpertsStream {
#if defined(EPMOE_HAVE_CUDA)
  int device = -1;
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  SharedExpertsStream() = default;
  SharedExpertsStream(const SharedExpertsStream&) = delete;
  SharedExpertsStream& operator=(const SharedExpertsStream&) = delete;
  ~SharedExpertsStream() {
    // Work still queued on the side stream completes first (cudaStreamDestroy defers); errors (a context
    // already torn down at exit) cannot be reported from a destructor.
    if (device < 0) return;
    cuda_util::DeviceGuard guard(device, std::nothrow);
    if (side != nullptr) cudaStreamDestroy(side);
    if (fork != nullptr) cudaEventDestroy(fork);
    if (join != nullptr) cudaEventDestroy(join);
    cudaGetLastError();
  }
#endif
};

namespace layer_detail {

#if defined(EPMOE_HAVE_CUDA)
GpuSharedRun start_gpu_shared_experts(std::shared_ptr<SharedExpertsStream>& state, const SharedExperts& fn,
                                      const TensorView& hidden) {
  const Device d = hidden.device;
  cuda_util::DeviceGuard guard(d);
  const Stream main = current_stream();
  const cudaStream_t main_s = cuda_util::to_cuda(main);
  if (!state || state->device != d.index) {
    // Made once per layer (and device): creating streams and events is not a stream operation to capture.
    if (cuda_util::capturing(main_s))
      raise(ErrorCode::unsupported, "MoELayer: the shared experts' side stream on {} would be made while the current "
            "stream is being captured in a CUDA graph: run one forward eagerly before capturing", to_string(d));
    auto s = std::make_shared<SharedExpertsStream>();
    s->device = d.index;
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s->side, cudaStreamNonBlocking));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&s->join, cudaEventDisableTiming));
    state = std::move(s);
  }
  GpuSharedRun run;
  run.state = state.get();
  run.main = main;
  // The side stream starts where the caller's stream is now (hidden is ready there).
  EPMOE_CUDA_CHECK(cudaEventRecord(state->fork, main_s));
  EPMOE_CUDA_CHECK(cudaStreamWaitEvent(state->side, state->fork, 0));
  run.active = true;
  try {
    const StreamGuard on_side(Stream{state->side});
    run.output = fn(hidden);
  } catch (...) {
    run.error = std::current_exception();
  }
  // Recorded now, waited on by the caller's stream at the end of forward: what the callable enqueued overlaps
  // everything forward enqueues on the caller's stream in between.
  const cudaError_t err = cudaEventRecord(state->join, state->side);
  if (err != cudaSuccess && !run.error) {
    cudaGetLastError();
    try {
      raise(ErrorCode::internal, "MoELayer: cudaEventRecord on the shared experts' side stream failed: {}",
            cudaGetErrorString(err));
    } catch (...) {
      run.error = std::current_exception();
    }
  }
  return run;
}

void join_gpu_shared_experts(GpuSharedRun& run) noexcept {
  if (!run.active) return;
  run.active = false;
  cuda_util::DeviceGuard guard(run.state->device, std::nothrow);
  if (cudaStreamWaitEvent(cuda_util::to_cuda(run.main), run.state->join, 0) != cudaSuccess) cudaGetLastError();
}
#else
GpuSharedRun start_gpu_shared_experts(std::shared_ptr<SharedExpertsStream>&, const SharedExperts&,
                                      const TensorView& hidden) {
  raise(ErrorCode::unsupported, "argument 'hidden' is on {} but epmoe was built without CUDA",
        to_string(hidden.device));
}
void join_gpu_shared_experts(GpuSharedRun&) noexcept {}
#endif

}  // namespace layer_detail

namespace {

void check_shared_weight(const Tensor& w, std::string_view name, std::string_view layout) {
  EPMOE_CHECK_ARG(w.defined() && w.dtype() == DType::bf16 && w.view().ndim() == 2 && w.view().is_contiguous() &&
                      w.device().is_cuda() && cuda_util::aligned16(w.data()),
                  name, fmt::format("a contiguous bfloat16 {} CUDA tensor (16-byte aligned)", layout), describe(w));
}

// The dense MLP as one CUDA expert of the batched_experts format holding all T tokens.
struct CudaSharedMlp {
  Tensor w1, w2;
  Activation activation;
  std::int64_t H = 0, N = 0;
  std::shared_ptr<Experts> experts;
  std::mutex mutex;  // the buffers below; a callable may be shared by layers on several threads
  Tensor out;        // bfloat16 [capacity, H]
  Tensor count;      // int32 [1]

  Tensor operator()(const TensorView& hidden) {
    const Device d = w1.device();
    EPMOE_CHECK_ARG(hidden.dtype == DType::bf16 && hidden.ndim() == 2 && hidden.size(1) == H &&
                        hidden.is_contiguous() && hidden.device == d &&
                        (hidden.numel() == 0 || cuda_util::aligned16(hidden.data)),
                    "hidden",
                    fmt::format("contiguous bfloat16 [T, {}] on {} (the shared experts' weights' device, H from "
                                "w1_shared)", H, to_string(d)),
                    describe(hidden));
#if defined(EPMOE_HAVE_CUDA)
    const std::int64_t T = hidden.size(0);
    cuda_util::DeviceGuard guard(d);
    const Stream s = current_stream();
    const std::lock_guard lock(mutex);
    if (!out.defined() || out.size(0) < T) {
      if (cuda_util::capturing(cuda_util::to_cuda(s)))
        raise(ErrorCode::unsupported, "shared experts: the output buffer must grow to {} rows (has {}) while the "
              "stream is being captured in a CUDA graph: run the same shapes once before capturing", T,
              out.defined() ? out.size(0) : 0);
      out = Tensor::empty(DType::bf16, {std::max<std::int64_t>(T, 1), H}, d);
    }
    if (!count.defined()) {
      if (cuda_util::capturing(cuda_util::to_cuda(s)))
        raise(ErrorCode::unsupported, "shared experts: the first call is being captured in a CUDA graph: run the "
              "same shapes once before capturing");
      count = Tensor::empty(DType::int32, {1}, d);
    }
    const TensorView result(out.data(), DType::bf16, {T, H}, d);
    if (T == 0) return Tensor::wrap(result, std::make_shared<Tensor>(out));
    moe_cuda::fill_int32(count.ptr<std::int32_t>(), 1, static_cast<std::int32_t>(T), s);
    ExpertsInputs in;
    in.hidden = TensorView(hidden.data, DType::bf16, {1, T, H}, d);
    in.w1 = TensorView(w1.data(), DType::bf16, {1, w1.size(0), H}, d);
    in.w2 = TensorView(w2.data(), DType::bf16, {1, H, N}, d);
    in.activation = activation;
    in.expert_num_tokens = count;
    experts->apply(in, TensorView(out.data(), DType::bf16, {1, T, H}, d));
    // The view keeps the buffer alive should the callable go first.
    return Tensor::wrap(result, std::make_shared<Tensor>(out));
#else
    raise(ErrorCode::unsupported, "argument 'hidden' is on {} but epmoe was built without CUDA", to_string(d));
#endif
  }
};

}  // namespace

SharedExperts make_cuda_shared_experts(Tensor w1_shared, Tensor w2_shared, Activation activation) {
  const bool gated = is_gated(activation);
  check_shared_weight(w1_shared, "w1_shared", gated ? "[2N_s, H]" : "[N_s, H]");
  check_shared_weight(w2_shared, "w2_shared", "[H, N_s]");
  const std::int64_t H = w1_shared.size(1), rows = w1_shared.size(0);
  EPMOE_CHECK_ARG(rows >= 1 && (!gated || rows % 2 == 0) && H >= 1 && H % 8 == 0, "w1_shared",
                  fmt::format("[{}, H] with H % 8 == 0 ({} activation '{}')", gated ? "2N_s" : "N_s",
                              gated ? "gated" : "non-gated", activation_name(activation)),
                  describe(w1_shared));
  const std::int64_t N = gated ? rows / 2 : rows;
  EPMOE_CHECK_ARG(w2_shared.shape() == (Shape{H, N}) && N % 8 == 0 && w2_shared.device() == w1_shared.device(),
                  "w2_shared",
                  fmt::format("[{}, {}] on {} (H and N_s from w1_shared {}; N_s % 8 == 0)", H, N,
                              to_string(w1_shared.device()), describe(w1_shared)),
                  describe(w2_shared));
  ExpertsConfig c;
  c.format = ActivationFormat::batched_experts;
  auto mlp = std::make_shared<CudaSharedMlp>();
  mlp->experts = std::shared_ptr<Experts>(make_cuda_experts(c));  // unsupported in builds without CUDA
  mlp->w1 = std::move(w1_shared);
  mlp->w2 = std::move(w2_shared);
  mlp->activation = activation;
  mlp->H = H;
  mlp->N = N;
  return [mlp](const TensorView& hidden) { return (*mlp)(hidden); };
}

}  // namespace epmoe
