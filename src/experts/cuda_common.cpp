// What the bf16 and fp8 CUDA experts share on the host (see cuda_common.hpp).
#if defined(EPMOE_HAVE_CUDA)
#include "experts/cuda_common.hpp"

#include <epmoe/stream.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "core/check.hpp"
#include "core/cuda_util.hpp"
#include "layout/layout.hpp"

namespace epmoe::experts_cuda {

// ---- workspaces ---------------------------------------------------------------------------------------------

cudaMemPool_t workspace_pool(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = pools.find(device); it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  EPMOE_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
  std::uint64_t keep = std::numeric_limits<std::uint64_t>::max();
  EPMOE_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  pools.emplace(device, pool);
  return pool;
}

Workspace::Workspace(int device, std::size_t bytes, cudaStream_t stream) : stream_(stream) {
  if (bytes == 0) return;
  const cudaError_t err = cudaMallocFromPoolAsync(&data_, bytes, workspace_pool(device), stream);
  if (err != cudaSuccess)
    raise(ErrorCode::out_of_memory, "CUDA experts: a workspace of {} bytes on cuda:{} could not be allocated: {}",
          bytes, device, cudaGetErrorString(err));
}

Workspace::~Workspace() {
  if (data_ != nullptr) cudaFreeAsync(data_, stream_);
}

// ---- cuBLAS and streams ------------------------------------------------------------------------------------

void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line) {
  raise(status == CUBLAS_STATUS_NOT_SUPPORTED ? ErrorCode::unsupported : ErrorCode::internal,
        "{} failed: {} ({}) at {}:{}", expr, cublasGetStatusString(status), static_cast<int>(status), file, line);
}

void refuse_capture_of_first_use(cudaStream_t s, int device, std::string_view who, std::string_view library) {
  if (cuda_util::capturing(s))
    raise(ErrorCode::unsupported,
          "{}: the first apply() of a thread on cuda:{} is being captured in a CUDA graph; it creates the {} handle, "
          "which cannot be captured: call apply() once before capturing",
          who, device, library);
}

void SideStreams::create() {
  if (fork_event != nullptr) return;
  for (std::size_t i = 0; i < side.size(); ++i) {
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&side[i], cudaStreamNonBlocking));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&join_event[i], cudaEventDisableTiming));
  }
  EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&fork_event, cudaEventDisableTiming));
}

void SideStreams::fork(cudaStream_t main, int n) const {
  EPMOE_CUDA_CHECK(cudaEventRecord(fork_event, main));
  for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i)
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(side[i], fork_event, 0));
}

void SideStreams::join(cudaStream_t main, int n) const {
  for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i) {
    EPMOE_CUDA_CHECK(cudaEventRecord(join_event[i], side[i]));
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(main, join_event[i], 0));
  }
}

// ---- the checked call ---------------------------------------------------------------------------------------

CudaProblem cuda_problem(const ExpertsInputs& in, const ExpertsSizes& sizes) {
  CudaProblem p;
  static_cast<ExpertsSizes&>(p) = sizes;
  p.act = in.activation;
  p.hidden = in.hidden;
  p.w1 = in.w1;
  p.w2 = in.w2;
  p.hidden_scales = in.hidden_scales;
  p.w1_scales = in.w1_scales;
  p.w2_scales = in.w2_scales;
  if (p.batched) {
    p.counts = in.expert_num_tokens;
  } else {
    p.topk_idx = in.topk_idx;
    p.topk_weights = in.topk_weights;
    p.expert_map = in.expert_map;
  }
  return p;
}

Shape CudaExpertsBase::output_shape(const ExpertsInputs& in) const { return check(in).out_shape; }

void CudaExpertsBase::apply(const ExpertsInputs& in, const TensorView& out) const {
  const CudaProblem p = check(in);
  check_out(p, out);
  if (p.signal && !writes_combine_signal())
    raise(ErrorCode::unsupported, "the {} experts ({}) do not write a combine_signal", name(),
          experts_quant_name(config().quant));
  if (p.batched) {
    if (p.max_tokens > 0) run_batched(p, out);  // all-zero counts are only known on the device
  } else if (p.m > 0) {
    run_standard(p, out);
  }
}

Tensor CudaExpertsBase::apply(const ExpertsInputs& in) const {
  const CudaProblem p = check(in);
  Tensor out = Tensor::empty(DType::bf16, p.out_shape, p.device);
  if (p.batched && out.nbytes() > 0) {  // rows past the counts read as zero
    cuda_util::DeviceGuard guard(p.device);
    EPMOE_CUDA_CHECK(cudaMemsetAsync(out.data(), 0, out.nbytes(), cuda_util::to_cuda(current_stream())));
  }
  apply(in, out.view());
  return out;
}

void CudaExpertsBase::run(const ExpertsProblem&, const TensorView&) const {
  // apply() is overridden: the CPU problem (which reads ids on the host) is never built here.
  raise(ErrorCode::internal, "the CUDA experts' run() was called");
}

void CudaExpertsBase::check_out(const CudaProblem& p, const TensorView& out) const {
  EPMOE_CHECK_ARG(out.defined(), "out", fmt::format("bfloat16{} on {}", p.out_shape, to_string(p.device)), "None");
  check_experts_tensor(out, "out", p.device);
  EPMOE_CHECK_ARG(out.dtype == DType::bf16 && out.shape == p.out_shape, "out", fmt::format("bfloat16{}", p.out_shape),
                  describe(out));
  check_aligned16(out, "out");
}

// ---- the Standard format's first phase ----------------------------------------------------------------------

StandardRouting::StandardRouting(const CudaProblem& p, int alignment, Carve& c) : p_(p) {
  const auto E = static_cast<std::size_t>(p.e_local);
  const auto slots = static_cast<std::size_t>(p.m * p.k);
  layout_.num_tokens = p.m;
  layout_.num_topk = static_cast<int>(p.k);
  layout_.num_local_experts = static_cast<int>(p.e_local);
  layout_.expert_alignment = alignment;
  layout_.capacity = permute_capacity(p.m, static_cast<int>(p.k), static_cast<int>(p.e_local), alignment);
  const auto cap = static_cast<std::size_t>(layout_.capacity);
  o_flags_ = c.take(sizeof(IdFlags) + sizeof(std::int64_t) * (E + 1));
  o_counts_ = c.take(sizeof(std::int32_t) * E);
  o_local_ = c.take(sizeof(std::int32_t) * slots);
  o_src2dst_ = c.take(sizeof(std::int32_t) * slots);
  o_dst2src_ = c.take(sizeof(std::int32_t) * cap);
  o_reorder_ = c.take(sizeof(std::int32_t) * cap);
  o_layout_ = c.take(layout_detail::permute_layout_workspace_bytes(p.m * p.k, static_cast<int>(p.e_local)));
}

void StandardRouting::enqueue(const Workspace& w, cudaStream_t s) {
  const std::int64_t M = p_.m, K = p_.k, E = p_.e_local, cap = layout_.capacity;
  const Device d = p_.device;
  flags_ = reinterpret_cast<IdFlags*>(w.at(o_flags_));
  seg_ = reinterpret_cast<std::int64_t*>(w.at(o_flags_ + sizeof(IdFlags)));
  auto* local = reinterpret_cast<std::int32_t*>(w.at(o_local_));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(flags_, 0xff, sizeof(IdFlags), s));
  map_ids(p_.topk_idx.data, p_.topk_idx.dtype == DType::int64, M * K,
          p_.expert_map.defined() ? static_cast<const std::int32_t*>(p_.expert_map.data) : nullptr,
          p_.expert_map.defined() ? p_.expert_map.size(0) : 0, p_.id_limit, static_cast<int>(E), local, flags_, s);
  layout_.seg_indptr = Tensor::wrap(TensorView(seg_, DType::int64, {E + 1}, d), nullptr);
  layout_.num_tokens_per_expert = Tensor::wrap(TensorView(w.at(o_counts_), DType::int32, {E}, d), nullptr);
  layout_.src2dst = Tensor::wrap(TensorView(w.at(o_src2dst_), DType::int32, {M, K}, d), nullptr);
  layout_.dst2src = Tensor::wrap(TensorView(w.at(o_dst2src_), DType::int32, {cap}, d), nullptr);
  layout_.reorder_topk_ids = Tensor::wrap(TensorView(w.at(o_reorder_), DType::int32, {cap}, d), nullptr);
  layout_detail::make_permute_layout_cuda(
      TensorView(local, DType::int32, {M, K}, d), static_cast<int>(E), layout_.expert_alignment, cap,
      {seg_, layout_.num_tokens_per_expert.ptr<std::int32_t>(), layout_.src2dst.ptr<std::int32_t>(),
       layout_.dst2src.ptr<std::int32_t>(), layout_.reorder_topk_ids.ptr<std::int32_t>(), w.at(o_layout_)},
      Stream{s});
}

std::vector<std::int64_t> StandardRouting::segment_starts(cudaStream_t s) const {
  const auto E = static_cast<std::size_t>(p_.e_local);
  std::vector<std::uint64_t> host(2 + (E + 1));  // the flags, then seg
  EPMOE_CUDA_CHECK(
      cudaMemcpyAsync(host.data(), flags_, host.size() * sizeof(std::uint64_t), cudaMemcpyDeviceToHost, s));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  IdFlags got{};
  std::memcpy(&got, host.data(), sizeof got);
  if (got.bad_id != ~0ull || got.bad_map != ~0ull) report_bad_ids(got);
  std::vector<std::int64_t> start(E + 1);
  std::memcpy(start.data(), host.data() + 2, start.size() * sizeof(std::int64_t));
  return start;
}

void StandardRouting::to_token_order(const void* y, const TensorView& out, cudaStream_t s) const {
  if (p_.reduce && !p_.weight_on_input) {
    const TensorView yv(const_cast<void*>(y), DType::bf16, {layout_.capacity, p_.h}, p_.device);
    unpermute_into(yv, layout_, p_.topk_weights, out, Stream{s});
  } else {
    // Unreduced [M, K, H] (a zero row per slot without a local expert), or K == 1 with the weight already
    // applied to the input: each output row is its slot's expert row.
    gather_rows(y, layout_.src2dst.ptr<std::int32_t>(), p_.m * p_.k, p_.h, out.data, s);
  }
}

void StandardRouting::report_bad_ids(const IdFlags& flags) const {
  if (flags.bad_map != ~0ull) {
    std::int32_t v = 0;
    EPMOE_CUDA_CHECK(cudaMemcpy(&v, static_cast<const std::int32_t*>(p_.expert_map.data) + flags.bad_map, sizeof v,
                                cudaMemcpyDeviceToHost));
    throw_invalid_argument("expert_map", fmt::format("entries in [-1, {}) (E_local)", p_.e_local),
                           fmt::format("{} at {}", v, flags.bad_map));
  }
  const auto i = static_cast<std::int64_t>(flags.bad_id);
  std::int64_t id = 0;
  if (p_.topk_idx.dtype == DType::int64) {
    EPMOE_CUDA_CHECK(cudaMemcpy(&id, static_cast<const std::int64_t*>(p_.topk_idx.data) + i, sizeof id,
                                cudaMemcpyDeviceToHost));
  } else {
    std::int32_t v = 0;
    EPMOE_CUDA_CHECK(cudaMemcpy(&v, static_cast<const std::int32_t*>(p_.topk_idx.data) + i, sizeof v,
                                cudaMemcpyDeviceToHost));
    id = v;
  }
  throw_invalid_argument("topk_idx",
                         fmt::format("ids in [-1, {}) ({})", p_.id_limit,
                                     p_.expert_map.defined() ? "E, the size of expert_map" : "E_local"),
                         fmt::format("{} at [{}, {}]", id, i / p_.k, i % p_.k));
}

}  // namespace epmoe::experts_cuda
#endif  // EPMOE_HAVE_CUDA
