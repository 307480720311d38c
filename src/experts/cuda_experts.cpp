// The experts on one GPU (make_cuda_experts, SPEC 7): argument checks, workspaces, cuBLAS GEMMs, and the
// order of the steps. The elementwise kernels live in cuda_experts_kernels.cu.
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

#include <array>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/cuda_util.hpp"
#include "experts/cuda_workspace.hpp"
#include "experts/cuda_experts.hpp"
#include "experts/cuda_experts_fp8.hpp"
#include "layout/layout.hpp"
#endif

namespace epmoe {

#if defined(EPMOE_HAVE_CUDA)

namespace experts_cuda {

namespace {

[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line) {
  raise(status == CUBLAS_STATUS_NOT_SUPPORTED ? ErrorCode::unsupported : ErrorCode::internal,
        "{} failed: {} ({}) at {}:{}", expr, cublasGetStatusString(status), static_cast<int>(status), file, line);
}

#define EPMOE_CUBLAS_CHECK(expr)                                                          \
  do {                                                                                    \
    const cublasStatus_t epmoe_status_ = (expr);                                          \
    if (epmoe_status_ != CUBLAS_STATUS_SUCCESS) throw_cublas_error(epmoe_status_, #expr, __FILE__, __LINE__); \
  } while (0)

constexpr int kSideStreams = 4;
// cuBLAS's recommended workspace on Hopper (cuBLAS docs, "cublasSetWorkspace"): 32 MiB per stream.
constexpr std::size_t kBlasWorkspace = std::size_t{32} << 20;

using cuda_util::capturing;
using cuda_util::DeviceGuard;

// ---- argument checks ------------------------------------------------------------------------------

struct Problem {
  bool batched = false, reduce = true, gated = true, weight_on_input = false;
  Activation act = Activation::silu;
  Device device;
  std::int64_t e_local = 0, n = 0, h = 0, r1 = 0;  // r1: rows of w1 per expert (2N or N)
  std::int64_t m = 0, k = 0, max_tokens = 0;
  TensorView hidden, w1, w2, topk_weights, topk_idx, expert_map, counts;
  std::int64_t id_limit = 0;  // ids must lie in [-1, id_limit)
  Shape out_shape;
};

void check_device_tensor(const TensorView& t, std::string_view name, const Device& device) {
  EPMOE_CHECK_ARG(t.device.is_cuda(), name, "a CUDA tensor (make_cuda_experts)", describe(t));
  EPMOE_CHECK_ARG(t.device == device, name, fmt::format("a tensor on the weights' device {}", to_string(device)),
                  describe(t));
  EPMOE_CHECK_ARG(t.is_contiguous(), name, "a contiguous tensor", fmt::format("strides {}", t.strides));
  EPMOE_CHECK_ARG(t.numel() == 0 || t.data != nullptr, name, "non-null data", "nullptr");
}

void check_vector_rows(const TensorView& t, std::string_view name) {
  EPMOE_CHECK_ARG(t.numel() == 0 || cuda_util::aligned16(t.data), name, "a 16-byte-aligned data pointer on CUDA",
                  fmt::format("{} at {}", describe(t), t.data));
}

// Everything ExpertsInputs can get wrong, checked on the host without reading device memory. The values
// (ids, map entries) are checked on the device by map_ids and reported after the Standard format's one
// synchronisation; batched counts are clamped on the device.
Problem check_inputs(const ExpertsInputs& in, const ExpertsConfig& config) {
  Problem p;
  p.batched = config.format == ActivationFormat::batched_experts;
  p.reduce = config.reduce;
  p.act = in.activation;
  EPMOE_CHECK_ARG(in.activation == Activation::silu || in.activation == Activation::gelu ||
                      in.activation == Activation::swigluoai || in.activation == Activation::silu_no_mul ||
                      in.activation == Activation::gelu_no_mul || in.activation == Activation::relu2_no_mul,
                  "activation", "a valid Activation", static_cast<int>(in.activation));
  p.gated = is_gated(in.activation);

  EPMOE_CHECK_ARG(in.w1.defined(), "w1", "a bfloat16 [E_local, 2N or N, H] tensor", "None");
  EPMOE_CHECK_ARG(in.w2.defined(), "w2", "a bfloat16 [E_local, H, N] tensor", "None");
  EPMOE_CHECK_ARG(in.w2.device.is_cuda(), "w2", "a CUDA tensor (make_cuda_experts)", describe(in.w2));
  p.device = in.w2.device;
  check_device_tensor(in.w2, "w2", p.device);
  check_device_tensor(in.w1, "w1", p.device);
  EPMOE_CHECK_ARG(in.w1.dtype == DType::bf16, "w1", "bfloat16", describe(in.w1));
  EPMOE_CHECK_ARG(in.w2.dtype == DType::bf16, "w2", "bfloat16", describe(in.w2));
  EPMOE_CHECK_ARG(in.w2.ndim() == 3, "w2", "3 dimensions [E_local, H, N]", describe(in.w2));
  EPMOE_CHECK_ARG(in.w1.ndim() == 3, "w1", "3 dimensions [E_local, 2N or N, H]", describe(in.w1));
  p.e_local = in.w2.size(0);
  p.h = in.w2.size(1);
  p.n = in.w2.size(2);
  EPMOE_CHECK_ARG(p.e_local >= 1 && p.h >= 1 && p.n >= 1, "w2", "[E_local, H, N] with all sizes >= 1",
                  describe(in.w2));
  EPMOE_CHECK_ARG(p.h % 8 == 0 && p.n % 8 == 0, "w2",
                  "H % 8 == 0 and N % 8 == 0 on CUDA (rows of a multiple of 16 bytes)", describe(in.w2));
  EPMOE_CHECK_ARG(p.e_local <= 1024, "w2", "E_local <= 1024 (SPEC 1)", describe(in.w2));
  p.r1 = p.gated ? 2 * p.n : p.n;
  const Shape w1_shape{p.e_local, p.r1, p.h};
  EPMOE_CHECK_ARG(in.w1.shape == w1_shape, "w1",
                  fmt::format("shape {} ({} activation '{}', from w2 {})", w1_shape, p.gated ? "gated" : "non-gated",
                              activation_name(in.activation), describe(in.w2)),
                  describe(in.w1));
  check_vector_rows(in.w1, "w1");
  check_vector_rows(in.w2, "w2");
  p.w1 = in.w1;
  p.w2 = in.w2;

  EPMOE_CHECK_ARG(in.hidden.defined(), "hidden",
                  p.batched ? "a [E_local, max_tokens, H] tensor" : "an [M, H] tensor", "None");
  check_device_tensor(in.hidden, "hidden", p.device);
  EPMOE_CHECK_ARG(in.hidden.dtype == DType::bf16 || in.hidden.dtype == DType::fp32, "hidden", "bfloat16 or float32",
                  describe(in.hidden));
  check_vector_rows(in.hidden, "hidden");
  p.hidden = in.hidden;
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();

  if (p.batched) {
    const Shape hidden_shape{p.e_local, in.hidden.ndim() == 3 ? in.hidden.size(1) : 0, p.h};
    EPMOE_CHECK_ARG(in.hidden.ndim() == 3 && in.hidden.shape == hidden_shape, "hidden",
                    fmt::format("[E_local={}, max_tokens, H={}] (from w2)", p.e_local, p.h), describe(in.hidden));
    p.max_tokens = in.hidden.size(1);
    EPMOE_CHECK_ARG(p.e_local * p.max_tokens <= kIntMax, "hidden", "E_local * max_tokens < 2^31 rows on CUDA",
                    describe(in.hidden));
    EPMOE_CHECK_ARG(!in.expert_map.defined(), "expert_map", "None in batched_experts format (slabs are local)",
                    describe(in.expert_map));
    EPMOE_CHECK_ARG(!in.apply_router_weight_on_input, "apply_router_weight_on_input",
                    "false in batched_experts format (no router weights; the producer applies them)", "true");
    EPMOE_CHECK_ARG(in.expert_num_tokens.defined(), "expert_num_tokens", fmt::format("int32 [{}]", p.e_local), "None");
    check_device_tensor(in.expert_num_tokens, "expert_num_tokens", p.device);
    EPMOE_CHECK_ARG(in.expert_num_tokens.dtype == DType::int32, "expert_num_tokens", "int32",
                    describe(in.expert_num_tokens));
    EPMOE_CHECK_ARG(in.expert_num_tokens.ndim() == 1 && in.expert_num_tokens.size(0) == p.e_local,
                    "expert_num_tokens", fmt::format("int32 [{}] (E_local)", p.e_local),
                    describe(in.expert_num_tokens));
    p.counts = in.expert_num_tokens;
    p.out_shape = Shape{p.e_local, p.max_tokens, p.h};
    return p;
  }

  EPMOE_CHECK_ARG(in.hidden.ndim() == 2 && in.hidden.size(1) == p.h, "hidden",
                  fmt::format("[M, H={}] (H from w2)", p.h), describe(in.hidden));
  p.m = in.hidden.size(0);
  EPMOE_CHECK_ARG(in.topk_idx.defined(), "topk_idx", fmt::format("an int64 or int32 [{}, K] tensor", p.m), "None");
  check_device_tensor(in.topk_idx, "topk_idx", p.device);
  EPMOE_CHECK_ARG(in.topk_idx.dtype == DType::int64 || in.topk_idx.dtype == DType::int32, "topk_idx",
                  "int64 or int32", describe(in.topk_idx));
  EPMOE_CHECK_ARG(in.topk_idx.ndim() == 2 && in.topk_idx.size(0) == p.m && in.topk_idx.size(1) >= 1, "topk_idx",
                  fmt::format("[M={}, K >= 1] (M from hidden)", p.m), describe(in.topk_idx));
  p.k = in.topk_idx.size(1);
  EPMOE_CHECK_ARG(p.k <= 512 && p.m * p.k <= kIntMax, "topk_idx", "K <= 512 and M * K < 2^31 on CUDA",
                  describe(in.topk_idx));
  p.topk_idx = in.topk_idx;
  EPMOE_CHECK_ARG(in.topk_weights.defined(), "topk_weights", fmt::format("float32 [{}, {}]", p.m, p.k), "None");
  check_device_tensor(in.topk_weights, "topk_weights", p.device);
  EPMOE_CHECK_ARG(in.topk_weights.dtype == DType::fp32, "topk_weights", "float32", describe(in.topk_weights));
  EPMOE_CHECK_ARG(in.topk_weights.shape == (Shape{p.m, p.k}), "topk_weights",
                  fmt::format("[{}, {}] (as topk_idx)", p.m, p.k), describe(in.topk_weights));
  p.topk_weights = in.topk_weights;
  EPMOE_CHECK_ARG(!in.apply_router_weight_on_input || p.k == 1, "apply_router_weight_on_input",
                  "K == 1 (one router weight per token to fold into the input)", fmt::format("true with K = {}", p.k));
  p.weight_on_input = in.apply_router_weight_on_input;
  p.id_limit = p.e_local;
  if (in.expert_map.defined()) {
    check_device_tensor(in.expert_map, "expert_map", p.device);
    EPMOE_CHECK_ARG(in.expert_map.dtype == DType::int32, "expert_map", "int32", describe(in.expert_map));
    EPMOE_CHECK_ARG(in.expert_map.ndim() == 1 && in.expert_map.size(0) >= 1, "expert_map", "int32 [E], E >= 1",
                    describe(in.expert_map));
    p.id_limit = in.expert_map.size(0);
    EPMOE_CHECK_ARG(in.global_num_experts == -1 || in.global_num_experts == p.id_limit, "global_num_experts",
                    fmt::format("-1 or {} (the size of expert_map)", p.id_limit), in.global_num_experts);
    p.expert_map = in.expert_map;
  }
  p.out_shape = p.reduce ? Shape{p.m, p.h} : Shape{p.m, p.k, p.h};
  return p;
}

void check_out(const Problem& p, const TensorView& out) {
  EPMOE_CHECK_ARG(out.defined(), "out", fmt::format("bfloat16{} on {}", p.out_shape, to_string(p.device)), "None");
  check_device_tensor(out, "out", p.device);
  EPMOE_CHECK_ARG(out.dtype == DType::bf16 && out.shape == p.out_shape, "out", fmt::format("bfloat16{}", p.out_shape),
                  describe(out));
  check_vector_rows(out, "out");
}

// ---- per-device and per-thread CUDA state -----------------------------------------------------------


// Per host thread and device: a cuBLAS handle (handles are not shared between threads) and, for
// GemmMode::streams, the side streams and their events. Never destroyed: destroying them at thread or
// process exit may run after the CUDA context is gone.
struct ThreadState {
  cublasHandle_t handle = nullptr;
  std::array<cudaStream_t, kSideStreams> side{};
  cudaEvent_t fork = nullptr;
  std::array<cudaEvent_t, kSideStreams> join{};
};

ThreadState& thread_state(int device, cudaStream_t s) {
  thread_local std::unordered_map<int, ThreadState> states;
  ThreadState& st = states[device];
  if (st.handle == nullptr) {
    if (capturing(s))
      raise(ErrorCode::unsupported,
            "CUDA experts: the first apply() of a thread on cuda:{} is being captured in a CUDA graph; it creates the "
            "cuBLAS handle, which cannot be captured: call apply() once before capturing",
            device);
    EPMOE_CUBLAS_CHECK(cublasCreate(&st.handle));
  }
  return st;
}

void side_streams(ThreadState& st) {
  if (st.fork != nullptr) return;
  for (int i = 0; i < kSideStreams; ++i) {
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st.side[static_cast<std::size_t>(i)], cudaStreamNonBlocking));
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&st.join[static_cast<std::size_t>(i)], cudaEventDisableTiming));
  }
  EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&st.fork, cudaEventDisableTiming));
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
      EPMOE_CUDA_CHECK(cudaEventRecord(st.fork, s));
      for (cudaStream_t side : st.side) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(side, st.fork, 0));
      for (std::size_t g = 0; g < groups; ++g) {
        const std::size_t i = g % kSideStreams;
        use_stream(st.handle, st.side[i], blas_ws + i * kBlasWorkspace);
        gemm(st.handle, l.w[g], l.x[g], l.c[g], out, l.rows[g], inner);
      }
      for (std::size_t i = 0; i < kSideStreams; ++i) {
        EPMOE_CUDA_CHECK(cudaEventRecord(st.join[i], st.side[i]));
        EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s, st.join[i], 0));
      }
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

TensorView device_view(void* p, DType dtype, Shape shape, const Device& d) { return TensorView(p, dtype, shape, d); }

[[noreturn]] void report_bad_ids(const Problem& p, const IdFlags& flags) {
  if (flags.bad_map != ~0ull) {
    std::int32_t v = 0;
    EPMOE_CUDA_CHECK(cudaMemcpy(&v, static_cast<const std::int32_t*>(p.expert_map.data) + flags.bad_map, sizeof v,
                                cudaMemcpyDeviceToHost));
    throw_invalid_argument("expert_map", fmt::format("entries in [-1, {}) (E_local)", p.e_local),
                           fmt::format("{} at {}", v, flags.bad_map));
  }
  const auto i = static_cast<std::int64_t>(flags.bad_id);
  std::int64_t id = 0;
  if (p.topk_idx.dtype == DType::int64) {
    EPMOE_CUDA_CHECK(cudaMemcpy(&id, static_cast<const std::int64_t*>(p.topk_idx.data) + i, sizeof id,
                                cudaMemcpyDeviceToHost));
  } else {
    std::int32_t v = 0;
    EPMOE_CUDA_CHECK(cudaMemcpy(&v, static_cast<const std::int32_t*>(p.topk_idx.data) + i, sizeof v,
                                cudaMemcpyDeviceToHost));
    id = v;
  }
  throw_invalid_argument("topk_idx",
                         fmt::format("ids in [-1, {}) ({})", p.id_limit,
                                     p.expert_map.defined() ? "E, the size of expert_map" : "E_local"),
                         fmt::format("{} at [{}, {}]", id, i / p.k, i % p.k));
}

// ---- Standard format ------------------------------------------------------------------------------

void run_standard(const Problem& p, const TensorView& out, GemmMode mode) {
  const cudaStream_t s = static_cast<cudaStream_t>(current_stream().handle);
  const int dev = p.device.index;
  DeviceGuard guard(dev);
  if (capturing(s))
    raise(ErrorCode::unsupported,
          "CUDA experts: the standard format waits for per-expert row counts and cannot be captured in a CUDA graph "
          "(use the batched_experts format)");
  ThreadState& st = thread_state(dev, s);

  const std::int64_t M = p.m, K = p.k, E = p.e_local, H = p.h, N = p.n, R = p.r1;
  const std::int64_t slots = M * K;
  const std::int64_t cap = permute_capacity(M, static_cast<int>(K), static_cast<int>(E), 1);
  const bool prepare = p.hidden.dtype == DType::fp32 || p.weight_on_input;
  const std::size_t bf16_row = static_cast<std::size_t>(H) * 2;

  // Phase 1 (before the synchronisation): flags and seg_indptr side by side (one copy to the host), local ids,
  // the layout, the (prepared) input and its permuted copy.
  Carve c1;
  const std::size_t o_flags = c1.take(sizeof(IdFlags) + sizeof(std::int64_t) * static_cast<std::size_t>(E + 1));
  const std::size_t o_seg = o_flags + sizeof(IdFlags);
  const std::size_t o_counts = c1.take(sizeof(std::int32_t) * static_cast<std::size_t>(E));
  const std::size_t o_local = c1.take(sizeof(std::int32_t) * static_cast<std::size_t>(slots));
  const std::size_t o_src2dst = c1.take(sizeof(std::int32_t) * static_cast<std::size_t>(slots));
  const std::size_t o_dst2src = c1.take(sizeof(std::int32_t) * static_cast<std::size_t>(cap));
  const std::size_t o_reorder = c1.take(sizeof(std::int32_t) * static_cast<std::size_t>(cap));
  const std::size_t o_lws = c1.take(layout_detail::permute_layout_workspace_bytes(slots, static_cast<int>(E)));
  const std::size_t o_prep = prepare ? c1.take(bf16_row * static_cast<std::size_t>(M)) : 0;
  const std::size_t o_xp = c1.take(bf16_row * static_cast<std::size_t>(cap));
  Workspace w1(dev, c1.size, s);
  auto* flags = reinterpret_cast<IdFlags*>(w1.at(o_flags));
  auto* seg = reinterpret_cast<std::int64_t*>(w1.at(o_seg));
  auto* local = reinterpret_cast<std::int32_t*>(w1.at(o_local));

  EPMOE_CUDA_CHECK(cudaMemsetAsync(flags, 0xff, sizeof(IdFlags), s));
  map_ids(p.topk_idx.data, p.topk_idx.dtype == DType::int64, slots,
          p.expert_map.defined() ? static_cast<const std::int32_t*>(p.expert_map.data) : nullptr,
          p.expert_map.defined() ? p.expert_map.size(0) : 0, p.id_limit, static_cast<int>(E), local, flags, s);

  PermuteLayout layout;
  layout.num_tokens = M;
  layout.num_topk = static_cast<int>(K);
  layout.num_local_experts = static_cast<int>(E);
  layout.expert_alignment = 1;
  layout.capacity = cap;
  layout.seg_indptr = Tensor::wrap(device_view(seg, DType::int64, {E + 1}, p.device), nullptr);
  layout.num_tokens_per_expert = Tensor::wrap(device_view(w1.at(o_counts), DType::int32, {E}, p.device), nullptr);
  layout.src2dst = Tensor::wrap(device_view(w1.at(o_src2dst), DType::int32, {M, K}, p.device), nullptr);
  layout.dst2src = Tensor::wrap(device_view(w1.at(o_dst2src), DType::int32, {cap}, p.device), nullptr);
  layout.reorder_topk_ids = Tensor::wrap(device_view(w1.at(o_reorder), DType::int32, {cap}, p.device), nullptr);
  layout_detail::make_permute_layout_cuda(
      device_view(local, DType::int32, {M, K}, p.device), static_cast<int>(E), 1, cap,
      {seg, layout.num_tokens_per_expert.ptr<std::int32_t>(), layout.src2dst.ptr<std::int32_t>(),
       layout.dst2src.ptr<std::int32_t>(), layout.reorder_topk_ids.ptr<std::int32_t>(), w1.at(o_lws)},
      Stream{s});

  TensorView x = p.hidden;
  if (prepare) {
    prepare_hidden(p.hidden.data, p.hidden.dtype == DType::fp32, M, H,
                   p.weight_on_input ? static_cast<const float*>(p.topk_weights.data) : nullptr, K, w1.at(o_prep), s);
    x = device_view(w1.at(o_prep), DType::bf16, {M, H}, p.device);
  }
  const TensorView xp = device_view(w1.at(o_xp), DType::bf16, {cap, H}, p.device);
  permute_into(x, layout, xp, {}, {}, Stream{s});

  // The one synchronisation: cuBLAS needs each expert's row count on the host.
  std::vector<std::uint64_t> host(2 + static_cast<std::size_t>(E + 1));
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(host.data(), flags, host.size() * sizeof(std::uint64_t), cudaMemcpyDeviceToHost, s));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  IdFlags got{};
  std::memcpy(&got, host.data(), sizeof got);
  if (got.bad_id != ~0ull || got.bad_map != ~0ull) report_bad_ids(p, got);
  std::vector<std::int64_t> start(static_cast<std::size_t>(E + 1));
  std::memcpy(start.data(), host.data() + 2, start.size() * sizeof(std::int64_t));
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
  if (mode == GemmMode::streams) side_streams(st);
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
  const TensorView yv = device_view(y, DType::bf16, {cap, H}, p.device);
  if (p.reduce && !p.weight_on_input) {
    unpermute_into(yv, layout, p.topk_weights, out, Stream{s});
  } else {
    // Unreduced [M, K, H] (a zero row per slot without a local expert), or K == 1 with the weight already
    // applied to the input: each output row is its slot's expert row.
    gather_rows(y, layout.src2dst.ptr<std::int32_t>(), slots, H, out.data, s);
  }
}

// ---- BatchedExperts format ---------------------------------------------------------------------------

void run_batched(const Problem& p, const TensorView& out) {
  const cudaStream_t s = static_cast<cudaStream_t>(current_stream().handle);
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
  gemm_strided(st.handle, p.w2.data, H * N, w.at(o_a), T * N, w.at(o_y), T * H, H, T, N, E);
  masked_copy(w.at(o_y), counts, static_cast<int>(E), T, H, out.data, s);
}

// ---- the Experts object -------------------------------------------------------------------------------

class CudaExperts final : public Experts {
 public:
  CudaExperts(const ExpertsConfig& config, GemmMode mode) : Experts(config), mode_(mode) {}
  std::string_view name() const override { return "cuda"; }

  Shape output_shape(const ExpertsInputs& in) const override { return check_inputs(in, config()).out_shape; }

  void apply(const ExpertsInputs& in, const TensorView& out) const override {
    const Problem p = check_inputs(in, config());
    check_out(p, out);
    if (p.batched) {
      if (p.max_tokens > 0) run_batched(p, out);  // all-zero counts are only known on the device
    } else if (p.m > 0) {
      run_standard(p, out, mode_);
    }
  }

  Tensor apply(const ExpertsInputs& in) const override {
    const Problem p = check_inputs(in, config());
    Tensor out = Tensor::empty(DType::bf16, p.out_shape, p.device);
    if (p.batched && out.nbytes() > 0) {  // rows past the counts read as zero
      DeviceGuard guard(p.device.index);
      EPMOE_CUDA_CHECK(
          cudaMemsetAsync(out.data(), 0, out.nbytes(), static_cast<cudaStream_t>(current_stream().handle)));
    }
    apply(in, out.view());
    return out;
  }

 protected:
  void run(const ExpertsProblem&, const TensorView&) const override {
    // apply() is overridden: the CPU problem (which reads ids on the host) is never built here.
    raise(ErrorCode::internal, "CudaExperts::run called");
  }

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
  // fp8 block-scaled weights run on cuBLASLt (cuda_experts_fp8.cpp); `mode` only concerns the bf16 GEMMs.
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
