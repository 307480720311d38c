// The bf16 experts on one GPU (make_cuda_experts, semantics §7): workspaces, cuBLAS GEMMs, and the order of the
// steps. The argument checks are experts.cpp's (check_bf16_weights, check_experts_routing), what both CUDA
// experts share is in cuda_common.cpp, and the elementwise kernels live in cuda.cu.
//
// Per layer the GEMM is row-major C[rows, out] = X[rows, inner] @ W[out, inner]^T with bf16 operands, float32
// accumulation and a bf16 result (cuBLAS rounds to nearest even), which is what vLLM's kernels and the
// CPU fast path (blas.cpp) store between the layers. In cuBLAS's column-major terms that is
// C^T = W^T(op T) X^T(op N): m = out, n = rows, k = inner, lda = ldb = inner, ldc = out (the "TN" GEMM).
//
// Workspaces come from one stream-ordered memory pool per device (cudaMallocFromPoolAsync, kept rather
// than released at synchronisations), so an apply() does no cudaMalloc/cudaFree and, in the batched
// format, can be captured in a CUDA graph (the allocations become graph memory nodes).
#include <epmoe/experts.hpp>

#include "core/check.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include <epmoe/permute.hpp>
#include <epmoe/stream.hpp>

#include <cstdlib>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/cuda_util.hpp"
#include "experts/cuda.hpp"
#include "experts/cuda_common.hpp"
#include "experts/experts.hpp"
#include "experts/problem.hpp"
#endif

namespace epmoe {

#if defined(EPMOE_HAVE_CUDA)

namespace experts_cuda {

namespace {

using cuda_util::capturing;
using cuda_util::DeviceGuard;

// cuBLAS's recommended workspace on Hopper (cuBLAS docs, "cublasSetWorkspace"): 32 MiB per stream.
constexpr std::size_t kBlasWorkspace = std::size_t{32} << 20;

constexpr CudaIndexLimits kIndexLimits{1, std::numeric_limits<int>::max(), "K <= 512 and M * K < 2^31 on CUDA"};

// ---- per-thread CUDA state --------------------------------------------------------------------------------

// Per host thread and device: a cuBLAS handle (handles are not shared between threads) and, for
// GemmMode::streams, the side streams. Never destroyed: destroying them at thread or process exit may run
// after the CUDA context is gone.
struct ThreadState {
  cublasHandle_t handle = nullptr;
  SideStreams streams;
};

ThreadState& thread_state(int device, cudaStream_t s) {
  thread_local std::unordered_map<int, ThreadState> states;
  ThreadState& st = states[device];
  if (st.handle == nullptr) {
    refuse_capture_of_first_use(s, device, "CUDA experts", "cuBLAS");
    EPMOE_CUBLAS_CHECK(cublasCreate(&st.handle));
  }
  return st;
}

void use_stream(cublasHandle_t h, cudaStream_t s, void* workspace) {
  EPMOE_CUBLAS_CHECK(cublasSetStream(h, s));
  // After cublasSetStream, which resets the workspace to cuBLAS's own pool (cuBLAS docs).
  EPMOE_CUBLAS_CHECK(cublasSetWorkspace(h, workspace, kBlasWorkspace));
}

// Row-major c[rows, out] = x[rows, inner] @ w[out, inner]^T, bf16 in and out, float32 accumulation.
void gemm(cublasHandle_t h, const void* w, const void* x, void* c, std::int64_t out, std::int64_t rows,
          std::int64_t inner) {
  const float alpha = 1.0f, beta = 0.0f;
  const int m = static_cast<int>(out), n = static_cast<int>(rows), k = static_cast<int>(inner);
  EPMOE_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, w, CUDA_R_16BF, k, x, CUDA_R_16BF, k,
                                  &beta, c, CUDA_R_16BF, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// The same for `batch` equally shaped problems at fixed strides (elements).
void gemm_strided(cublasHandle_t h, const void* w, std::int64_t w_stride, const void* x, std::int64_t x_stride, void* c,
                  std::int64_t c_stride, std::int64_t out, std::int64_t rows, std::int64_t inner, std::int64_t batch) {
  const float alpha = 1.0f, beta = 0.0f;
  const int m = static_cast<int>(out), n = static_cast<int>(rows), k = static_cast<int>(inner);
  EPMOE_CUBLAS_CHECK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, w, CUDA_R_16BF, k,
                                                w_stride, x, CUDA_R_16BF, k, x_stride, &beta, c, CUDA_R_16BF, m,
                                                c_stride, static_cast<int>(batch), CUBLAS_COMPUTE_32F,
                                                CUBLAS_GEMM_DEFAULT));
}

// One layer of the Standard format: for every non-empty expert g, c_g[rows_g, out] = x_g @ w_g^T.
struct LayerGemms {
  std::vector<const void*> w, x;
  std::vector<void*> c;
  std::vector<int> rows;
};

void run_layer(ThreadState& st, GemmMode mode, cudaStream_t s, char* blas_ws, const LayerGemms& l, std::int64_t out,
               std::int64_t inner, void* const* device_ptrs) {
  const std::size_t groups = l.rows.size();
  if (groups == 0) return;
  switch (mode) {
    case GemmMode::loop:
      for (std::size_t g = 0; g < groups; ++g) gemm(st.handle, l.w[g], l.x[g], l.c[g], out, l.rows[g], inner);
      return;
    case GemmMode::streams: {
      st.streams.fork(s, kSideStreams);
      for (std::size_t g = 0; g < groups; ++g) {
        const std::size_t i = g % kSideStreams;
        use_stream(st.handle, st.streams.side[i], blas_ws + i * kBlasWorkspace);
        gemm(st.handle, l.w[g], l.x[g], l.c[g], out, l.rows[g], inner);
      }
      st.streams.join(s, kSideStreams);
      use_stream(st.handle, s, blas_ws);
      return;
    }
    case GemmMode::automatic:  // resolved by the caller
    case GemmMode::grouped: {
      const int count = static_cast<int>(groups);
      const std::vector<cublasOperation_t> ta(groups, CUBLAS_OP_T), tb(groups, CUBLAS_OP_N);
      const std::vector<int> m(groups, static_cast<int>(out)), k(groups, static_cast<int>(inner)), ones(groups, 1);
      const std::vector<float> alpha(groups, 1.0f), beta(groups, 0.0f);
      // device_ptrs: [A (w) | B (x) | C] arrays of `groups` device pointers each.
      EPMOE_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
          st.handle, ta.data(), tb.data(), m.data(), l.rows.data(), k.data(), alpha.data(), device_ptrs, CUDA_R_16BF,
          k.data(), device_ptrs + groups, CUDA_R_16BF, k.data(), beta.data(), device_ptrs + 2 * groups,
          CUDA_R_16BF, m.data(), count, ones.data(), CUBLAS_COMPUTE_32F));
      return;
    }
  }
}

// ---- Standard format ------------------------------------------------------------------------------

void standard_format(const CudaProblem& p, const TensorView& out, GemmMode mode) {
  const cudaStream_t s = cuda_util::to_cuda(current_stream());
  const int dev = p.device.index;
  DeviceGuard guard(dev);
  if (capturing(s))
    raise(ErrorCode::unsupported,
          "CUDA experts: the standard format waits for per-expert row counts and cannot be captured in a CUDA graph "
          "(use the batched_experts format)");
  ThreadState& st = thread_state(dev, s);

  const std::int64_t M = p.m, K = p.k, E = p.e_local, H = p.h, N = p.n, R = p.r1;
  const bool prepare = p.hidden.dtype == DType::fp32 || p.weight_on_input;
  const std::size_t bf16_row = static_cast<std::size_t>(H) * 2;

  // Phase 1 (before the synchronisation): local ids and their layout, the (prepared) input and its permuted copy.
  Carve c1;
  StandardRouting routing(p, 1, c1);
  const std::int64_t cap = routing.capacity();
  const std::size_t o_prep = prepare ? c1.take(bf16_row * static_cast<std::size_t>(M)) : 0;
  const std::size_t o_xp = c1.take(bf16_row * static_cast<std::size_t>(cap));
  Workspace w1(dev, c1.size, s);
  routing.enqueue(w1, s);
  TensorView x = p.hidden;
  if (prepare) {
    prepare_hidden(p.hidden.data, p.hidden.dtype == DType::fp32, M, H,
                   p.weight_on_input ? static_cast<const float*>(p.topk_weights.data) : nullptr, K, w1.at(o_prep), s);
    x = TensorView(w1.at(o_prep), DType::bf16, {M, H}, p.device);
  }
  const TensorView xp(w1.at(o_xp), DType::bf16, {cap, H}, p.device);
  permute_into(x, routing.layout(), xp, {}, {}, Stream{s});

  const std::vector<std::int64_t> start = routing.segment_starts(s);
  const std::int64_t rows = start[static_cast<std::size_t>(E)];
  if (rows == 0) {  // no slot has a local expert: the output is zero
    EPMOE_CUDA_CHECK(cudaMemsetAsync(out.data, 0, out.nbytes(), s));
    return;
  }

  // Phase 2: the GEMMs and the activation.
  std::size_t groups = 0;
  for (std::size_t e = 0; e < static_cast<std::size_t>(E); ++e) groups += start[e + 1] > start[e];
  if (mode == GemmMode::automatic)
    mode = rows <= kGroupedMaxMeanRows * static_cast<std::int64_t>(groups) ? GemmMode::grouped : GemmMode::loop;
  if (mode == GemmMode::streams) st.streams.create();
  LayerGemms l1, l2;
  Carve c2;
  const std::size_t o_g = c2.take(static_cast<std::size_t>(rows * R) * 2);
  const std::size_t o_a = c2.take(static_cast<std::size_t>(rows * N) * 2);
  const std::size_t o_y = c2.take(bf16_row * static_cast<std::size_t>(cap));
  const std::size_t o_blas = c2.take(kBlasWorkspace * (mode == GemmMode::streams ? kSideStreams : 1));
  const std::size_t o_ptrs = mode == GemmMode::grouped ? c2.take(6 * groups * sizeof(void*)) : 0;
  Workspace w2(dev, c2.size, s);
  char* g = w2.at(o_g);
  char* a = w2.at(o_a);
  char* y = w2.at(o_y);
  const auto* w1p = static_cast<const char*>(p.w1.data);
  const auto* w2p = static_cast<const char*>(p.w2.data);
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t r0 = start[static_cast<std::size_t>(e)], n_rows = start[static_cast<std::size_t>(e + 1)] - r0;
    if (n_rows == 0) continue;
    l1.w.push_back(w1p + e * R * H * 2);
    l1.x.push_back(xp.data == nullptr ? nullptr : static_cast<const char*>(xp.data) + r0 * H * 2);
    l1.c.push_back(g + r0 * R * 2);
    l1.rows.push_back(static_cast<int>(n_rows));
    l2.w.push_back(w2p + e * H * N * 2);
    l2.x.push_back(a + r0 * N * 2);
    l2.c.push_back(y + r0 * H * 2);
    l2.rows.push_back(static_cast<int>(n_rows));
  }
  void** ptrs = nullptr;
  if (mode == GemmMode::grouped) {
    // Both layers' pointer arrays in one host-to-device copy, before the first GEMM.
    std::vector<void*> hp;
    hp.reserve(6 * groups);
    for (const void* v : l1.w) hp.push_back(const_cast<void*>(v));
    for (const void* v : l1.x) hp.push_back(const_cast<void*>(v));
    for (void* v : l1.c) hp.push_back(v);
    for (const void* v : l2.w) hp.push_back(const_cast<void*>(v));
    for (const void* v : l2.x) hp.push_back(const_cast<void*>(v));
    for (void* v : l2.c) hp.push_back(v);
    ptrs = reinterpret_cast<void**>(w2.at(o_ptrs));
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(ptrs, hp.data(), hp.size() * sizeof(void*), cudaMemcpyHostToDevice, s));
  }
  use_stream(st.handle, s, w2.at(o_blas));
  run_layer(st, mode, s, w2.at(o_blas), l1, R, H, ptrs);
  activation(p.act, g, rows, N, a, nullptr, 0, s);
  run_layer(st, mode, s, w2.at(o_blas), l2, H, N, ptrs == nullptr ? nullptr : ptrs + 3 * groups);

  // Phase 3: back to token order.
  routing.to_token_order(y, out, s);
}

// ---- BatchedExperts format ---------------------------------------------------------------------------

void batched_format(const CudaProblem& p, const TensorView& out) {
  const cudaStream_t s = cuda_util::to_cuda(current_stream());
  const int dev = p.device.index;
  DeviceGuard guard(dev);
  ThreadState& st = thread_state(dev, s);
  const std::int64_t E = p.e_local, T = p.max_tokens, H = p.h, N = p.n, R = p.r1;
  const std::int64_t rows = E * T;
  const bool convert = p.hidden.dtype == DType::fp32;
  Carve c;
  const std::size_t o_x = convert ? c.take(static_cast<std::size_t>(rows * H) * 2) : 0;
  const std::size_t o_g = c.take(static_cast<std::size_t>(rows * R) * 2);
  const std::size_t o_a = c.take(static_cast<std::size_t>(rows * N) * 2);
  const std::size_t o_y = c.take(static_cast<std::size_t>(rows * H) * 2);
  const std::size_t o_blas = c.take(kBlasWorkspace);
  Workspace w(dev, c.size, s);
  const void* x = p.hidden.data;
  if (convert) {
    prepare_hidden(p.hidden.data, true, rows, H, nullptr, 0, w.at(o_x), s);
    x = w.at(o_x);
  }
  const auto* counts = static_cast<const std::int32_t*>(p.counts.data);
  use_stream(st.handle, s, w.at(o_blas));
  // Every row of every slab goes through the GEMMs (the counts stay on the device); the activation and
  // the final copy skip the rows past each count.
  gemm_strided(st.handle, p.w1.data, R * H, x, T * H, w.at(o_g), T * R, R, T, H, E);
  activation(p.act, w.at(o_g), rows, N, w.at(o_a), counts, T, s);
  if (p.signal == nullptr) {
    gemm_strided(st.handle, p.w2.data, H * N, w.at(o_a), T * N, w.at(o_y), T * H, H, T, N, E);
    masked_copy(w.at(o_y), counts, static_cast<int>(E), T, H, out.data, s);
    return;
  }
  // A combine signal: the down GEMM expert by expert, each followed by its rows' copy and its signal, so an
  // overlapped combine sends expert e while the GEMMs of the later experts run.
  const int adds = p.signal_per_expert ? 1 : static_cast<int>((H + p.signal_block_n - 1) / p.signal_block_n);
  for (std::int64_t e = 0; e < E; ++e) {
    auto* a_e = static_cast<char*>(w.at(o_a)) + static_cast<std::size_t>(e * T * N) * 2;
    auto* y_e = static_cast<char*>(w.at(o_y)) + static_cast<std::size_t>(e * T * H) * 2;
    gemm_strided(st.handle, static_cast<const char*>(p.w2.data) + static_cast<std::size_t>(e * H * N) * 2, H * N,
                 a_e, T * N, y_e, T * H, H, T, N, 1);
    masked_copy(y_e, counts + e, 1, T, H, static_cast<char*>(out.data) + static_cast<std::size_t>(e * T * H) * 2, s);
    write_combine_signal(p.signal, p.signal_per_expert, counts + e, static_cast<int>(e), T, p.signal_block_m,
                         p.signal_blocks, adds, s);
  }
}

// ---- the Experts object -------------------------------------------------------------------------------

class CudaExperts final : public CudaExpertsBase {
 public:
  CudaExperts(const ExpertsConfig& config, GemmMode mode) : CudaExpertsBase(config), mode_(mode) {}

 protected:
  CudaProblem check(const ExpertsInputs& in) const override {
    ExpertsSizes s = check_bf16_weights(in, config(), true);
    check_experts_routing(in, &kIndexLimits, s);
    return cuda_problem(in, s);
  }
  void run_standard(const CudaProblem& p, const TensorView& out) const override { standard_format(p, out, mode_); }
  void run_batched(const CudaProblem& p, const TensorView& out) const override { batched_format(p, out); }

 public:
  bool writes_combine_signal() const override { return true; }

 private:
  GemmMode mode_;
};

GemmMode default_mode() {
  const char* env = std::getenv("EPMOE_CUDA_EXPERTS_GEMM");
  if (env == nullptr || *env == '\0') return GemmMode::automatic;
  const std::string v(env);
  if (v == "auto") return GemmMode::automatic;
  if (v == "loop") return GemmMode::loop;
  if (v == "streams") return GemmMode::streams;
  if (v == "grouped") return GemmMode::grouped;
  throw_invalid_argument("EPMOE_CUDA_EXPERTS_GEMM", "auto, loop, streams or grouped", fmt::format("'{}'", v));
}

}  // namespace

void weight_hidden_cuda(const TensorView& hidden, const TensorView& topk_weights, const TensorView& out,
                        Stream stream) {
  prepare_hidden(hidden.data, hidden.dtype == DType::fp32, hidden.size(0), hidden.size(1),
                 static_cast<const float*>(topk_weights.data), topk_weights.size(1), out.data,
                 cuda_util::to_cuda(stream));
}

const char* gemm_mode_name(GemmMode mode) {
  switch (mode) {
    case GemmMode::loop: return "loop";
    case GemmMode::streams: return "streams";
    case GemmMode::grouped: return "grouped";
    case GemmMode::automatic: return "auto";
  }
  return "?";
}

std::unique_ptr<Experts> make_cuda_experts(const ExpertsConfig& config, GemmMode mode) {
  // fp8 block-scaled weights run on cuBLASLt (cuda_fp8.cpp); `mode` only concerns the bf16 GEMMs.
  if (config.quant == ExpertsQuant::fp8_block) return experts_cuda_fp8::make_cuda_experts_fp8(config);
  return std::make_unique<CudaExperts>(config, mode);
}

}  // namespace experts_cuda

std::unique_ptr<Experts> make_cuda_experts(const ExpertsConfig& config) {
  return experts_cuda::make_cuda_experts(config, experts_cuda::default_mode());
}

#else  // !EPMOE_HAVE_CUDA

std::unique_ptr<Experts> make_cuda_experts(const ExpertsConfig&) {
  raise(ErrorCode::unsupported, "make_cuda_experts: epmoe was built without CUDA");
}

#endif

}  // namespace epmoe
