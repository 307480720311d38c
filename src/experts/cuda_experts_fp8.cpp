// The fp8 block-scaled experts on one GPU (ExpertsQuant::fp8_block, DeepSeek-V3's format; make_cuda_experts
// dispatches here): argument checks, workspaces and cuBLASLt's block-scaled fp8 GEMMs (cuBLAS >= 12.9 on
// Hopper: A = weights with CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, B = activations with
// CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, "TN", float32 compute, no fast accumulation). The elementwise
// kernels live in cuda_experts_fp8_kernels.cu; the scale layouts are described in cuda_experts_fp8.hpp.
//
// Per expert (one GEMM per layer and non-empty expert, as vLLM's per-expert fallback and DeepGEMM's m-grouped
// GEMMs compute it):
//   x fp8 [n, H] (+ 1x128 scales) -> gemm1 -> g float32 [n, 2N or N] -> act, SPEC 6 quantization -> a fp8
//   [n, N] (+ 1x128 scales) -> gemm2 -> y bf16 [n, H].
// gemm1 writes float32, not bf16: the intermediate is re-quantized to fp8, and a bf16 rounding before that
// would move ~1.5% of the fp8 codes by one step (vs. the float64 reference), about 1% relative L2 -- SPEC 13's
// whole budget. Every GEMM's row count is a multiple of 4 (segments padded by make_permute_layout's
// expert_alignment, batched slabs rounded up), which keeps each expert's block of token-major scales aligned.
#include <epmoe/experts.hpp>

#include "core/check.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include <epmoe/permute.hpp>
#include <epmoe/stream.hpp>

#include <array>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/cuda_util.hpp"
#include "experts/cuda_workspace.hpp"
#include "experts/cuda_experts.hpp"
#include "experts/cuda_experts_fp8.hpp"
#include "experts/fp8.hpp"
#include "layout/layout.hpp"

namespace epmoe::experts_cuda_fp8 {

namespace {

using cuda_util::capturing;
using experts_cuda::Carve;  // the host-side CUDA helpers shared with the bf16 experts (cuda_workspace.hpp)
using cuda_util::DeviceGuard;
using experts_cuda::Workspace;

using experts_fp8::blocks;
using experts_fp8::Fp8Sizes;

[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line) {
  raise(status == CUBLAS_STATUS_NOT_SUPPORTED ? ErrorCode::unsupported : ErrorCode::internal,
        "{} failed: {} ({}) at {}:{}", expr, cublasGetStatusString(status), static_cast<int>(status), file, line);
}

#define EPMOE_CUBLASLT_CHECK(expr)                                                                              \
  do {                                                                                                          \
    const cublasStatus_t epmoe_status_ = (expr);                                                                \
    if (epmoe_status_ != CUBLAS_STATUS_SUCCESS) throw_cublas_error(epmoe_status_, #expr, __FILE__, __LINE__); \
  } while (0)

// cuBLAS's recommended workspace on Hopper (cuBLAS docs, "cublasSetWorkspace"): 32 MiB.
constexpr std::size_t kLtWorkspace = std::size_t{32} << 20;
constexpr std::int64_t kRowAlign = 4;  // rows per GEMM: a multiple of 4 (16-byte columns of float32 scales)
constexpr int kMaxStreams = 4;
// Mean rows per expert up to which the GEMMs go to kMaxStreams forked streams by default. A guess from the bf16
// experts' measurements (4 streams won at 32 rows, lost at 1024; bench/gpu_experts.md), to be re-measured.
constexpr double kStreamsMaxMeanRows = 256;

std::int64_t round_up(std::int64_t v, std::int64_t m) { return (v + m - 1) / m * m; }

// ---- argument checks ------------------------------------------------------------------------------------

struct Problem {
  Fp8Sizes s;
  bool reduce = true, weight_on_input = false;
  Activation act = Activation::silu;
  Device device;
  TensorView hidden, hidden_scales, w1, w2, w1_scales, w2_scales, topk_weights, topk_idx, expert_map, counts;
  std::int64_t id_limit = 0;
  Shape out_shape;
};

void check_on_device(const TensorView& t, std::string_view name, const Device& device) {
  EPMOE_CHECK_ARG(t.device.is_cuda(), name, "a CUDA tensor (make_cuda_experts)", describe(t));
  EPMOE_CHECK_ARG(t.device == device, name, fmt::format("a tensor on the weights' device {}", to_string(device)),
                  describe(t));
  EPMOE_CHECK_ARG(t.is_contiguous(), name, "a contiguous tensor", fmt::format("strides {}", t.strides));
  EPMOE_CHECK_ARG(t.numel() == 0 || t.data != nullptr, name, "non-null data", "nullptr");
}

void check_aligned(const TensorView& t, std::string_view name) {
  EPMOE_CHECK_ARG(t.numel() == 0 || cuda_util::aligned16(t.data), name, "a 16-byte-aligned data pointer on CUDA",
                  fmt::format("{} at {}", describe(t), t.data));
}

Problem check_inputs(const ExpertsInputs& in, const ExpertsConfig& config) {
  Problem p;
  EPMOE_CHECK_ARG(in.w2.defined(), "w2", "a float8_e4m3fn [E_local, H, N] tensor (fp8_block)", "None");
  EPMOE_CHECK_ARG(in.w2.device.is_cuda(), "w2", "a CUDA tensor (make_cuda_experts)", describe(in.w2));
  p.device = in.w2.device;
  p.s = experts_fp8::check_fp8_inputs(in, config, [&](const TensorView& t, std::string_view name) {
    check_on_device(t, name, p.device);
  });
  check_aligned(in.w1, "w1");
  check_aligned(in.w2, "w2");
  check_aligned(in.hidden, "hidden");
  p.reduce = config.reduce;
  p.act = in.activation;
  p.hidden = in.hidden;
  p.hidden_scales = in.hidden_scales;
  p.w1 = in.w1;
  p.w2 = in.w2;
  p.w1_scales = in.w1_scales;
  p.w2_scales = in.w2_scales;
  Fp8Sizes& s = p.s;
  constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();

  if (s.batched) {
    const Shape hidden_shape{s.e_local, in.hidden.ndim() == 3 ? in.hidden.size(1) : 0, s.h};
    EPMOE_CHECK_ARG(in.hidden.ndim() == 3 && in.hidden.shape == hidden_shape, "hidden",
                    fmt::format("[E_local={}, max_tokens, H={}] (from w2)", s.e_local, s.h), describe(in.hidden));
    s.max_tokens = in.hidden.size(1);
    EPMOE_CHECK_ARG(s.e_local * round_up(s.max_tokens, kRowAlign) <= kIntMax, "hidden",
                    "E_local * max_tokens < 2^31 rows on CUDA", describe(in.hidden));
    EPMOE_CHECK_ARG(!in.expert_map.defined(), "expert_map", "None in batched_experts format (slabs are local)",
                    describe(in.expert_map));
    EPMOE_CHECK_ARG(!in.apply_router_weight_on_input, "apply_router_weight_on_input",
                    "false in batched_experts format (no router weights; the producer applies them)", "true");
    EPMOE_CHECK_ARG(in.expert_num_tokens.defined(), "expert_num_tokens", fmt::format("int32 [{}]", s.e_local), "None");
    check_on_device(in.expert_num_tokens, "expert_num_tokens", p.device);
    EPMOE_CHECK_ARG(in.expert_num_tokens.dtype == DType::int32 && in.expert_num_tokens.ndim() == 1 &&
                        in.expert_num_tokens.size(0) == s.e_local,
                    "expert_num_tokens", fmt::format("int32 [{}] (E_local)", s.e_local),
                    describe(in.expert_num_tokens));
    p.counts = in.expert_num_tokens;
    p.out_shape = Shape{s.e_local, s.max_tokens, s.h};
    return p;
  }

  EPMOE_CHECK_ARG(in.hidden.ndim() == 2 && in.hidden.size(1) == s.h, "hidden",
                  fmt::format("[M, H={}] (H from w2)", s.h), describe(in.hidden));
  s.m = in.hidden.size(0);
  EPMOE_CHECK_ARG(in.topk_idx.defined(), "topk_idx", fmt::format("an int64 or int32 [{}, K] tensor", s.m), "None");
  check_on_device(in.topk_idx, "topk_idx", p.device);
  EPMOE_CHECK_ARG(in.topk_idx.dtype == DType::int64 || in.topk_idx.dtype == DType::int32, "topk_idx",
                  "int64 or int32", describe(in.topk_idx));
  EPMOE_CHECK_ARG(in.topk_idx.ndim() == 2 && in.topk_idx.size(0) == s.m && in.topk_idx.size(1) >= 1, "topk_idx",
                  fmt::format("[M={}, K >= 1] (M from hidden)", s.m), describe(in.topk_idx));
  s.k = in.topk_idx.size(1);
  EPMOE_CHECK_ARG(s.k <= 512 && s.m * s.k <= kIntMax / 2, "topk_idx", "K <= 512 and M * K < 2^30 on CUDA",
                  describe(in.topk_idx));
  p.topk_idx = in.topk_idx;
  EPMOE_CHECK_ARG(in.topk_weights.defined(), "topk_weights", fmt::format("float32 [{}, {}]", s.m, s.k), "None");
  check_on_device(in.topk_weights, "topk_weights", p.device);
  EPMOE_CHECK_ARG(in.topk_weights.dtype == DType::fp32, "topk_weights", "float32", describe(in.topk_weights));
  EPMOE_CHECK_ARG(in.topk_weights.shape == (Shape{s.m, s.k}), "topk_weights",
                  fmt::format("[{}, {}] (as topk_idx)", s.m, s.k), describe(in.topk_weights));
  p.topk_weights = in.topk_weights;
  EPMOE_CHECK_ARG(!in.apply_router_weight_on_input || s.k == 1, "apply_router_weight_on_input",
                  "K == 1 (one router weight per token to fold into the input)", fmt::format("true with K = {}", s.k));
  p.weight_on_input = in.apply_router_weight_on_input;
  p.id_limit = s.e_local;
  if (in.expert_map.defined()) {
    check_on_device(in.expert_map, "expert_map", p.device);
    EPMOE_CHECK_ARG(in.expert_map.dtype == DType::int32, "expert_map", "int32", describe(in.expert_map));
    EPMOE_CHECK_ARG(in.expert_map.ndim() == 1 && in.expert_map.size(0) >= 1, "expert_map", "int32 [E], E >= 1",
                    describe(in.expert_map));
    p.id_limit = in.expert_map.size(0);
    EPMOE_CHECK_ARG(in.global_num_experts == -1 || in.global_num_experts == p.id_limit, "global_num_experts",
                    fmt::format("-1 or {} (the size of expert_map)", p.id_limit), in.global_num_experts);
    p.expert_map = in.expert_map;
  }
  p.out_shape = p.reduce ? Shape{s.m, s.h} : Shape{s.m, s.k, s.h};
  return p;
}

void check_out(const Problem& p, const TensorView& out) {
  EPMOE_CHECK_ARG(out.defined(), "out", fmt::format("bfloat16{} on {}", p.out_shape, to_string(p.device)), "None");
  check_on_device(out, "out", p.device);
  EPMOE_CHECK_ARG(out.dtype == DType::bf16 && out.shape == p.out_shape, "out", fmt::format("bfloat16{}", p.out_shape),
                  describe(out));
  check_aligned(out, "out");
}

// ---- device memory ---------------------------------------------------------------------------------------


TensorView device_view(void* p, DType t, Shape s, const Device& d) { return TensorView(p, t, s, d); }

// ---- cuBLASLt ----------------------------------------------------------------------------------------------

// One GEMM shape's descriptors and the algorithm cuBLASLt's heuristic chose for it (the heuristic query costs
// tens of microseconds of host time, more than a decode-sized GEMM: it runs once per shape and thread).
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

struct PlanKey {
  std::int64_t m, n, k;
  bool out_f32;
  bool operator==(const PlanKey& o) const { return m == o.m && n == o.n && k == o.k && out_f32 == o.out_f32; }
};
struct PlanKeyHash {
  std::size_t operator()(const PlanKey& k) const {
    return std::hash<std::int64_t>()(k.m * 1000003 + k.n * 10007 + k.k * 2 + (k.out_f32 ? 1 : 0));
  }
};

// Per host thread and device: the cuBLASLt handle and the plans (descriptors carry per-call scale pointers,
// so they are not shared between threads). Never destroyed (see cuda_experts.cpp's ThreadState).
struct ThreadState {
  cublasLtHandle_t handle = nullptr;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
  std::unordered_map<PlanKey, bool, PlanKeyHash> pad_k;  // needs_k_padding's answers
  // Side streams the per-expert GEMMs can be spread over (forked from and joined back into the caller's
  // stream with events, so it also works inside a CUDA graph capture).
  std::array<cudaStream_t, kMaxStreams> side{};
  cudaEvent_t fork = nullptr;
  std::array<cudaEvent_t, kMaxStreams> join{};
};

ThreadState& thread_state(int device, cudaStream_t s) {
  thread_local std::unordered_map<int, ThreadState> states;
  ThreadState& st = states[device];
  if (st.handle == nullptr) {
    if (capturing(s))
      raise(ErrorCode::unsupported,
            "fp8 CUDA experts: the first apply() of a thread on cuda:{} is being captured in a CUDA graph; it creates "
            "the cuBLASLt handle, which cannot be captured: call apply() once before capturing",
            device);
    EPMOE_CUBLASLT_CHECK(cublasLtCreate(&st.handle));
    for (std::size_t i = 0; i < kMaxStreams; ++i) {
      EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st.side[i], cudaStreamNonBlocking));
      EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&st.join[i], cudaEventDisableTiming));
    }
    EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&st.fork, cudaEventDisableTiming));
  }
  return st;
}

// The streams a layer's GEMMs go to: the caller's stream alone, or `n` side streams that wait for it first.
struct Lanes {
  ThreadState& st;
  cudaStream_t main;
  int n;  // 1: the caller's stream; > 1: side streams 0..n-1
  char* workspace;  // n * kLtWorkspace bytes

  cudaStream_t stream(std::size_t i) const { return n == 1 ? main : st.side[i % static_cast<std::size_t>(n)]; }
  void* work(std::size_t i) const { return workspace + (n == 1 ? 0 : i % static_cast<std::size_t>(n)) * kLtWorkspace; }
  void fork() const {
    if (n == 1) return;
    EPMOE_CUDA_CHECK(cudaEventRecord(st.fork, main));
    for (int i = 0; i < n; ++i) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(st.side[static_cast<std::size_t>(i)], st.fork, 0));
  }
  void join() const {
    if (n == 1) return;
    for (int i = 0; i < n; ++i) {
      EPMOE_CUDA_CHECK(cudaEventRecord(st.join[static_cast<std::size_t>(i)], st.side[static_cast<std::size_t>(i)]));
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(main, st.join[static_cast<std::size_t>(i)], 0));
    }
  }
};

// Streams for GEMMs of `mean_rows` rows on average: small GEMMs (decode) stream their weights faster when several
// run at once (their ramp-up and tail overlap); large ones lose a little to the contention. `requested` > 0
// overrides (make_cuda_experts_fp8's `streams`).
int lane_count(int requested, double mean_rows) {
  if (requested > 0) return requested > kMaxStreams ? kMaxStreams : requested;
  return mean_rows <= kStreamsMaxMeanRows ? kMaxStreams : 1;
}

void destroy(Plan& p) {
  if (p.d != nullptr) cublasLtMatrixLayoutDestroy(p.d);
  if (p.b != nullptr) cublasLtMatrixLayoutDestroy(p.b);
  if (p.a != nullptr) cublasLtMatrixLayoutDestroy(p.a);
  if (p.desc != nullptr) cublasLtMatmulDescDestroy(p.desc);
}

void set_scales(const Plan& p, const float* a_scales, const float* b_scales) {
  EPMOE_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scales, sizeof a_scales));
  EPMOE_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scales, sizeof b_scales));
}

Plan& plan(ThreadState& st, const PlanKey& key, const float* a_scales, const float* b_scales) {
  if (auto it = st.plans.find(key); it != st.plans.end()) return it->second;
  if (st.plans.size() >= 4096) {  // row counts vary from call to call: keep the cache bounded
    for (auto& [k, p] : st.plans) destroy(p);
    st.plans.clear();
  }
  Plan p;
  try {
    EPMOE_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    EPMOE_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
    EPMOE_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
    const cublasLtMatmulMatrixScale_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const cublasLtMatmulMatrixScale_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    EPMOE_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof a_mode));
    EPMOE_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof b_mode));
    set_scales(p, a_scales, b_scales);
    const auto m = static_cast<std::uint64_t>(key.m), n = static_cast<std::uint64_t>(key.n),
               k = static_cast<std::uint64_t>(key.k);
    EPMOE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, k, m, static_cast<std::int64_t>(k)));
    EPMOE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_8F_E4M3, k, n, static_cast<std::int64_t>(k)));
    EPMOE_CUBLASLT_CHECK(
        cublasLtMatrixLayoutCreate(&p.d, key.out_f32 ? CUDA_R_32F : CUDA_R_16BF, m, n, static_cast<std::int64_t>(m)));
    cublasLtMatmulPreference_t pref = nullptr;
    EPMOE_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const std::size_t ws = kLtWorkspace;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t status =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulAlgoGetHeuristic(st.handle, p.desc, p.a, p.b, p.d, p.d, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    EPMOE_CUBLASLT_CHECK(status);
    if (found == 0)
      raise(ErrorCode::unsupported,
            "fp8 CUDA experts: cuBLASLt {} has no block-scaled fp8 GEMM (A 128x128 blocks, B 1x128 groups) for m={}, "
            "n={}, k={} with a {} output on this device (it needs cuBLAS >= 12.9 on a Hopper GPU)",
            cublasLtGetVersion(), key.m, key.n, key.k, key.out_f32 ? "float32" : "bfloat16");
    p.algo = result.algo;
  } catch (...) {
    destroy(p);
    throw;
  }
  return st.plans.emplace(key, p).first->second;
}

// Row-major c[rows, out] = x[rows, inner] @ w[out, inner]^T with block-scaled fp8 operands: w with w_scales
// [ceil(out/128)][ceil(inner/128) rounded to 4], x with x_scales [ceil(inner/128)][rows] (rows % 4 == 0).
void gemm(ThreadState& st, cudaStream_t s, void* workspace, const std::uint8_t* w, const float* w_scales,
          const std::uint8_t* x, const float* x_scales, void* c, bool c_f32, std::int64_t out, std::int64_t rows,
          std::int64_t inner) {
  const PlanKey key{out, rows, inner, c_f32};
  const Plan& p = plan(st, key, w_scales, x_scales);
  set_scales(p, w_scales, x_scales);
  const float alpha = 1.0f, beta = 0.0f;
  EPMOE_CUBLASLT_CHECK(cublasLtMatmul(st.handle, p.desc, &alpha, w, p.a, x, p.b, &beta, c, p.d, c, p.d, &p.algo,
                                      workspace, kLtWorkspace, s));
}

// Whether GEMMs of inner size k need k zero-padded to whole 128-blocks (operands copied with row stride
// round_up(k, 128); the block scales are the same). Only when k is not a multiple of 128 and cuBLASLt has no
// block-scaled kernel for the partial last block: probed once per shape. EPMOE_CUDA_EXPERTS_FP8_PAD_K=1 forces
// the padding whenever k % 128 != 0 (the tests cover both ways).
bool needs_k_padding(ThreadState& st, std::int64_t m, std::int64_t k, bool out_f32, const float* a_scales,
                     const float* b_scales) {
  if (k % experts_fp8::kBlock == 0) return false;
  const char* force = std::getenv("EPMOE_CUDA_EXPERTS_FP8_PAD_K");
  if (force != nullptr && std::string(force) == "1") return true;
  const PlanKey key{m, 128, k, out_f32};
  if (auto it = st.pad_k.find(key); it != st.pad_k.end()) return it->second;
  bool pad = false;
  try {
    plan(st, key, a_scales, b_scales);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::unsupported) throw;
    pad = true;
  }
  st.pad_k.emplace(key, pad);
  return pad;
}

// rows x k bytes (row stride k) -> rows x kp (kp > k), the extra columns zero.
void copy_padded(const void* src, std::int64_t rows, std::int64_t k, std::int64_t kp, void* dst, cudaStream_t s) {
  if (rows == 0) return;
  const auto uk = static_cast<std::size_t>(k), ukp = static_cast<std::size_t>(kp), ur = static_cast<std::size_t>(rows);
  EPMOE_CUDA_CHECK(cudaMemset2DAsync(static_cast<char*>(dst) + uk, ukp, 0, ukp - uk, ur, s));
  EPMOE_CUDA_CHECK(cudaMemcpy2DAsync(dst, ukp, src, uk, uk, ur, cudaMemcpyDeviceToDevice, s));
}

// ---- ids ---------------------------------------------------------------------------------------------------

[[noreturn]] void report_bad_ids(const Problem& p, const experts_cuda::IdFlags& flags) {
  if (flags.bad_map != ~0ull) {
    std::int32_t v = 0;
    EPMOE_CUDA_CHECK(cudaMemcpy(&v, static_cast<const std::int32_t*>(p.expert_map.data) + flags.bad_map, sizeof v,
                                cudaMemcpyDeviceToHost));
    throw_invalid_argument("expert_map", fmt::format("entries in [-1, {}) (E_local)", p.s.e_local),
                           fmt::format("{} at {}", v, flags.bad_map));
  }
  const auto i = static_cast<std::int64_t>(flags.bad_id);
  std::int64_t id = 0;
  if (p.topk_idx.dtype == DType::int64) {
    EPMOE_CUDA_CHECK(
        cudaMemcpy(&id, static_cast<const std::int64_t*>(p.topk_idx.data) + i, sizeof id, cudaMemcpyDeviceToHost));
  } else {
    std::int32_t v = 0;
    EPMOE_CUDA_CHECK(
        cudaMemcpy(&v, static_cast<const std::int32_t*>(p.topk_idx.data) + i, sizeof v, cudaMemcpyDeviceToHost));
    id = v;
  }
  throw_invalid_argument(
      "topk_idx",
      fmt::format("ids in [-1, {}) ({})", p.id_limit, p.expert_map.defined() ? "E, the size of expert_map" : "E_local"),
      fmt::format("{} at [{}, {}]", id, i / p.s.k, i % p.s.k));
}

// Weight block scales in cuBLASLt's layout (row stride rounded up to 4 floats, 16-byte aligned).
struct WeightScales {
  std::int64_t kb1, kb1p, kb2, kb2p, nb1, nb2;
};
WeightScales weight_scale_sizes(const Fp8Sizes& s) {
  WeightScales w{};
  w.nb1 = blocks(s.r1);
  w.kb1 = blocks(s.h);
  w.kb1p = round_up(w.kb1, 4);
  w.nb2 = blocks(s.h);
  w.kb2 = blocks(s.n);
  w.kb2p = round_up(w.kb2, 4);
  return w;
}

// ---- Standard format ---------------------------------------------------------------------------------------

void run_standard(const Problem& p, const TensorView& out, int streams) {
  const cudaStream_t s = static_cast<cudaStream_t>(current_stream().handle);
  const int dev = p.device.index;
  DeviceGuard guard(dev);
  if (capturing(s))
    raise(ErrorCode::unsupported,
          "fp8 CUDA experts: the standard format synchronises once to read the per-expert row counts and cannot be "
          "captured in a CUDA graph (use the batched_experts format)");
  ThreadState& st = thread_state(dev, s);
  const Fp8Sizes& z = p.s;
  const std::int64_t M = z.m, K = z.k, E = z.e_local, H = z.h, N = z.n, R = z.r1;
  const std::int64_t GH = blocks(H), GN = blocks(N);
  const std::int64_t slots = M * K;
  const std::int64_t cap = permute_capacity(M, static_cast<int>(K), static_cast<int>(E), kRowAlign);
  const WeightScales ws = weight_scale_sizes(z);
  const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };

  Carve c1;
  const std::size_t o_flags = c1.take(sizeof(experts_cuda::IdFlags) + sizeof(std::int64_t) * sz(E + 1));
  const std::size_t o_seg = o_flags + sizeof(experts_cuda::IdFlags);
  const std::size_t o_counts = c1.take(sizeof(std::int32_t) * sz(E));
  const std::size_t o_local = c1.take(sizeof(std::int32_t) * sz(slots));
  const std::size_t o_src2dst = c1.take(sizeof(std::int32_t) * sz(slots));
  const std::size_t o_dst2src = c1.take(sizeof(std::int32_t) * sz(cap));
  const std::size_t o_reorder = c1.take(sizeof(std::int32_t) * sz(cap));
  const std::size_t o_lws = c1.take(layout_detail::permute_layout_workspace_bytes(slots, static_cast<int>(E)));
  const bool quantize = !z.hidden_fp8;
  const std::size_t o_xq = quantize ? c1.take(sz(M * H)) : 0;
  const std::size_t o_xs = quantize ? c1.take(sizeof(float) * sz(M * GH)) : 0;
  const std::size_t o_xp = c1.take(sz(cap * H));
  const std::size_t o_xps = c1.take(sizeof(float) * sz(cap * GH));
  Workspace w1(dev, c1.size, s);
  auto* flags = reinterpret_cast<experts_cuda::IdFlags*>(w1.at(o_flags));
  auto* seg = reinterpret_cast<std::int64_t*>(w1.at(o_seg));
  auto* local = reinterpret_cast<std::int32_t*>(w1.at(o_local));

  EPMOE_CUDA_CHECK(cudaMemsetAsync(flags, 0xff, sizeof(experts_cuda::IdFlags), s));
  experts_cuda::map_ids(p.topk_idx.data, p.topk_idx.dtype == DType::int64, slots,
                        p.expert_map.defined() ? static_cast<const std::int32_t*>(p.expert_map.data) : nullptr,
                        p.expert_map.defined() ? p.expert_map.size(0) : 0, p.id_limit, static_cast<int>(E), local,
                        flags, s);
  PermuteLayout layout;
  layout.num_tokens = M;
  layout.num_topk = static_cast<int>(K);
  layout.num_local_experts = static_cast<int>(E);
  layout.expert_alignment = static_cast<int>(kRowAlign);
  layout.capacity = cap;
  layout.seg_indptr = Tensor::wrap(device_view(seg, DType::int64, {E + 1}, p.device), nullptr);
  layout.num_tokens_per_expert = Tensor::wrap(device_view(w1.at(o_counts), DType::int32, {E}, p.device), nullptr);
  layout.src2dst = Tensor::wrap(device_view(w1.at(o_src2dst), DType::int32, {M, K}, p.device), nullptr);
  layout.dst2src = Tensor::wrap(device_view(w1.at(o_dst2src), DType::int32, {cap}, p.device), nullptr);
  layout.reorder_topk_ids = Tensor::wrap(device_view(w1.at(o_reorder), DType::int32, {cap}, p.device), nullptr);
  layout_detail::make_permute_layout_cuda(
      device_view(local, DType::int32, {M, K}, p.device), static_cast<int>(E), static_cast<int>(kRowAlign), cap,
      {seg, layout.num_tokens_per_expert.ptr<std::int32_t>(), layout.src2dst.ptr<std::int32_t>(),
       layout.dst2src.ptr<std::int32_t>(), layout.reorder_topk_ids.ptr<std::int32_t>(), w1.at(o_lws)},
      Stream{s});

  // The input in fp8 with row-major scales (quantized here unless given), then grouped by expert.
  TensorView xq = p.hidden, xs = p.hidden_scales;
  if (quantize) {
    quantize_rows(p.hidden.data, p.hidden.dtype == DType::fp32, M, H,
                  p.weight_on_input ? static_cast<const float*>(p.topk_weights.data) : nullptr, K, M, M,
                  reinterpret_cast<std::uint8_t*>(w1.at(o_xq)), reinterpret_cast<float*>(w1.at(o_xs)), false,
                  Segments{}, s);
    xq = device_view(w1.at(o_xq), DType::fp8_e4m3, {M, H}, p.device);
    xs = device_view(w1.at(o_xs), DType::fp32, {M, GH}, p.device);
  }
  const TensorView xp = device_view(w1.at(o_xp), DType::fp8_e4m3, {cap, H}, p.device);
  const TensorView xps = device_view(w1.at(o_xps), DType::fp32, {cap, GH}, p.device);
  permute_into(xq, layout, xp, xs, xps, Stream{s});

  // The one synchronisation: cuBLASLt needs each expert's row count on the host.
  std::vector<std::uint64_t> host(2 + sz(E + 1));
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(host.data(), flags, host.size() * sizeof(std::uint64_t), cudaMemcpyDeviceToHost, s));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
  experts_cuda::IdFlags got{};
  std::memcpy(&got, host.data(), sizeof got);
  if (got.bad_id != ~0ull || got.bad_map != ~0ull) report_bad_ids(p, got);
  std::vector<std::int64_t> start(sz(E + 1));
  std::memcpy(start.data(), host.data() + 2, start.size() * sizeof(std::int64_t));
  const std::int64_t rows = start[sz(E)];
  if (rows == 0) {  // no slot has a local expert: the output is zero
    EPMOE_CUDA_CHECK(cudaMemsetAsync(out.data, 0, out.nbytes(), s));
    return;
  }

  const auto* w1_user = static_cast<const float*>(p.w1_scales.data);
  const auto* w2_user = static_cast<const float*>(p.w2_scales.data);
  const std::int64_t K1 = needs_k_padding(st, R, H, true, w1_user, w2_user) ? round_up(H, experts_fp8::kBlock) : H;
  const std::int64_t K2 = needs_k_padding(st, H, N, false, w2_user, w1_user) ? round_up(N, experts_fp8::kBlock) : N;
  Carve c2;
  const std::size_t o_xpad = K1 != H ? c2.take(sz(rows * K1)) : 0;
  const std::size_t o_w1pad = K1 != H ? c2.take(sz(E * R * K1)) : 0;
  const std::size_t o_w2pad = K2 != N ? c2.take(sz(E * H * K2)) : 0;
  const std::size_t o_xst = c2.take(sizeof(float) * sz(rows * GH));
  const std::size_t o_w1s = c2.take(sizeof(float) * sz(E * ws.nb1 * ws.kb1p));
  const std::size_t o_w2s = c2.take(sizeof(float) * sz(E * ws.nb2 * ws.kb2p));
  const std::size_t o_g = c2.take(sizeof(float) * sz(rows * R));
  const std::size_t o_a = c2.take(sz(rows * K2));
  const std::size_t o_ast = c2.take(sizeof(float) * sz(rows * GN));
  const std::size_t o_y = c2.take(sizeof(std::uint16_t) * sz(cap * H));
  std::size_t groups = 0;
  for (std::size_t e = 0; e < sz(E); ++e) groups += start[e + 1] > start[e];
  const int lanes_n = lane_count(streams, static_cast<double>(rows) / static_cast<double>(groups));
  const std::size_t o_lt = c2.take(kLtWorkspace * static_cast<std::size_t>(lanes_n));
  Workspace w2(dev, c2.size, s);
  auto* xst = reinterpret_cast<float*>(w2.at(o_xst));
  auto* w1s = reinterpret_cast<float*>(w2.at(o_w1s));
  auto* w2s = reinterpret_cast<float*>(w2.at(o_w2s));
  auto* g = reinterpret_cast<float*>(w2.at(o_g));
  auto* a = reinterpret_cast<std::uint8_t*>(w2.at(o_a));
  auto* ast = reinterpret_cast<float*>(w2.at(o_ast));
  char* y = w2.at(o_y);
  Segments segs;
  segs.seg = seg;
  segs.e_local = static_cast<int>(E);
  transpose_scales(static_cast<const float*>(xps.data), rows, GH, segs, xst, s);
  pad_weight_scales(static_cast<const float*>(p.w1_scales.data), E * ws.nb1, ws.kb1, ws.kb1p, w1s, s);
  pad_weight_scales(static_cast<const float*>(p.w2_scales.data), E * ws.nb2, ws.kb2, ws.kb2p, w2s, s);

  const auto* w1p = static_cast<const std::uint8_t*>(p.w1.data);
  const auto* w2p = static_cast<const std::uint8_t*>(p.w2.data);
  const auto* xpp = static_cast<const std::uint8_t*>(xp.data);
  if (K1 != H) {  // whole 128-blocks along H for cuBLASLt (see needs_k_padding)
    copy_padded(xpp, rows, H, K1, w2.at(o_xpad), s);
    copy_padded(w1p, E * R, H, K1, w2.at(o_w1pad), s);
    xpp = reinterpret_cast<const std::uint8_t*>(w2.at(o_xpad));
    w1p = reinterpret_cast<const std::uint8_t*>(w2.at(o_w1pad));
  }
  if (K2 != N) {
    copy_padded(w2p, E * H, N, K2, w2.at(o_w2pad), s);
    w2p = reinterpret_cast<const std::uint8_t*>(w2.at(o_w2pad));
    EPMOE_CUDA_CHECK(cudaMemset2DAsync(a + N, sz(K2), 0, sz(K2 - N), sz(rows), s));
  }
  const Lanes lanes{st, s, lanes_n, w2.at(o_lt)};
  lanes.fork();
  for (std::int64_t e = 0, i = 0; e < E; ++e) {
    const std::int64_t r0 = start[sz(e)], n = start[sz(e + 1)] - r0;
    if (n == 0) continue;
    gemm(st, lanes.stream(sz(i)), lanes.work(sz(i)), w1p + e * R * K1, w1s + e * ws.nb1 * ws.kb1p, xpp + r0 * K1,
         xst + r0 * GH, g + r0 * R, true, R, n, K1);
    ++i;
  }
  lanes.join();
  activation_quant(p.act, g, rows, N, segs, a, K2, ast, s);
  lanes.fork();
  for (std::int64_t e = 0, i = 0; e < E; ++e) {
    const std::int64_t r0 = start[sz(e)], n = start[sz(e + 1)] - r0;
    if (n == 0) continue;
    gemm(st, lanes.stream(sz(i)), lanes.work(sz(i)), w2p + e * H * K2, w2s + e * ws.nb2 * ws.kb2p, a + r0 * K2,
         ast + r0 * GN, y + r0 * H * 2, false, H, n, K2);
    ++i;
  }
  lanes.join();

  const TensorView yv = device_view(y, DType::bf16, {cap, H}, p.device);
  if (p.reduce && !p.weight_on_input) {
    unpermute_into(yv, layout, p.topk_weights, out, Stream{s});
  } else {
    experts_cuda::gather_rows(y, layout.src2dst.ptr<std::int32_t>(), slots, H, out.data, s);
  }
}

// ---- BatchedExperts format ---------------------------------------------------------------------------------

void run_batched(const Problem& p, const TensorView& out, int streams) {
  const cudaStream_t s = static_cast<cudaStream_t>(current_stream().handle);
  const int dev = p.device.index;
  DeviceGuard guard(dev);
  ThreadState& st = thread_state(dev, s);
  const Fp8Sizes& z = p.s;
  const std::int64_t E = z.e_local, T = z.max_tokens, H = z.h, N = z.n, R = z.r1;
  const std::int64_t Tp = round_up(T, kRowAlign), rows = E * Tp;
  const std::int64_t GH = blocks(H), GN = blocks(N);
  const WeightScales ws = weight_scale_sizes(z);
  const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  const auto* counts = static_cast<const std::int32_t*>(p.counts.data);
  const bool own_x = !z.hidden_fp8 || Tp != T;
  const auto* w1_user = static_cast<const float*>(p.w1_scales.data);
  const auto* w2_user = static_cast<const float*>(p.w2_scales.data);
  const std::int64_t K1 = needs_k_padding(st, R, H, true, w1_user, w2_user) ? round_up(H, experts_fp8::kBlock) : H;
  const std::int64_t K2 = needs_k_padding(st, H, N, false, w2_user, w1_user) ? round_up(N, experts_fp8::kBlock) : N;

  Carve c;
  const std::size_t o_x = own_x ? c.take(sz(rows * H)) : 0;
  const std::size_t o_xpad = K1 != H ? c.take(sz(rows * K1)) : 0;
  const std::size_t o_w1pad = K1 != H ? c.take(sz(E * R * K1)) : 0;
  const std::size_t o_w2pad = K2 != N ? c.take(sz(E * H * K2)) : 0;
  const std::size_t o_xst = c.take(sizeof(float) * sz(rows * GH));
  const std::size_t o_w1s = c.take(sizeof(float) * sz(E * ws.nb1 * ws.kb1p));
  const std::size_t o_w2s = c.take(sizeof(float) * sz(E * ws.nb2 * ws.kb2p));
  const std::size_t o_g = c.take(sizeof(float) * sz(rows * R));
  const std::size_t o_a = c.take(sz(rows * K2));
  const std::size_t o_ast = c.take(sizeof(float) * sz(rows * GN));
  const std::size_t o_y = c.take(sizeof(std::uint16_t) * sz(rows * H));
  const int lanes_n = lane_count(streams, static_cast<double>(Tp));
  const std::size_t o_lt = c.take(kLtWorkspace * static_cast<std::size_t>(lanes_n));
  Workspace w(dev, c.size, s);
  auto* xst = reinterpret_cast<float*>(w.at(o_xst));
  auto* w1s = reinterpret_cast<float*>(w.at(o_w1s));
  auto* w2s = reinterpret_cast<float*>(w.at(o_w2s));
  auto* g = reinterpret_cast<float*>(w.at(o_g));
  auto* a = reinterpret_cast<std::uint8_t*>(w.at(o_a));
  auto* ast = reinterpret_cast<float*>(w.at(o_ast));
  char* y = w.at(o_y);

  Segments segs;
  segs.e_local = static_cast<int>(E);
  segs.slab = Tp;
  segs.valid = T;
  segs.counts = counts;
  // Every row of every slab goes through the GEMMs (the counts stay on the device); the quantization, the
  // activation and the final copy skip the rows past each count. Columns of a GEMM are independent, so the
  // stale rows never touch a counted one.
  const std::uint8_t* x = static_cast<const std::uint8_t*>(p.hidden.data);
  if (!z.hidden_fp8) {
    quantize_rows(p.hidden.data, p.hidden.dtype == DType::fp32, E * T, H, nullptr, 0, T, Tp,
                  reinterpret_cast<std::uint8_t*>(w.at(o_x)), xst, true, segs, s);
    x = reinterpret_cast<const std::uint8_t*>(w.at(o_x));
  } else {
    if (own_x) {
      copy_slab_rows(p.hidden.data, T, w.at(o_x), Tp, static_cast<int>(E), T, H, counts, s);
      x = reinterpret_cast<const std::uint8_t*>(w.at(o_x));
    }
    Segments all = segs;
    all.counts = nullptr;
    transpose_scales(static_cast<const float*>(p.hidden_scales.data), rows, GH, all, xst, s);
  }
  pad_weight_scales(static_cast<const float*>(p.w1_scales.data), E * ws.nb1, ws.kb1, ws.kb1p, w1s, s);
  pad_weight_scales(static_cast<const float*>(p.w2_scales.data), E * ws.nb2, ws.kb2, ws.kb2p, w2s, s);
  const auto* w1p = static_cast<const std::uint8_t*>(p.w1.data);
  const auto* w2p = static_cast<const std::uint8_t*>(p.w2.data);
  if (K1 != H) {  // whole 128-blocks along H for cuBLASLt (see needs_k_padding)
    copy_padded(x, rows, H, K1, w.at(o_xpad), s);
    copy_padded(w1p, E * R, H, K1, w.at(o_w1pad), s);
    x = reinterpret_cast<const std::uint8_t*>(w.at(o_xpad));
    w1p = reinterpret_cast<const std::uint8_t*>(w.at(o_w1pad));
  }
  if (K2 != N) {
    copy_padded(w2p, E * H, N, K2, w.at(o_w2pad), s);
    w2p = reinterpret_cast<const std::uint8_t*>(w.at(o_w2pad));
    EPMOE_CUDA_CHECK(cudaMemset2DAsync(a + N, sz(K2), 0, sz(K2 - N), sz(rows), s));
  }
  const Lanes lanes{st, s, lanes_n, w.at(o_lt)};
  lanes.fork();
  for (std::int64_t e = 0; e < E; ++e)
    gemm(st, lanes.stream(sz(e)), lanes.work(sz(e)), w1p + e * R * K1, w1s + e * ws.nb1 * ws.kb1p, x + e * Tp * K1,
         xst + e * Tp * GH, g + e * Tp * R, true, R, Tp, K1);
  lanes.join();
  activation_quant(p.act, g, rows, N, segs, a, K2, ast, s);
  lanes.fork();
  for (std::int64_t e = 0; e < E; ++e)
    gemm(st, lanes.stream(sz(e)), lanes.work(sz(e)), w2p + e * H * K2, w2s + e * ws.nb2 * ws.kb2p, a + e * Tp * K2,
         ast + e * Tp * GN, y + e * Tp * H * 2, false, H, Tp, K2);
  lanes.join();
  copy_slab_rows(y, Tp, out.data, T, static_cast<int>(E), T, H * 2, counts, s);
}

// ---- the Experts object ------------------------------------------------------------------------------------

class CudaFp8Experts final : public Experts {
 public:
  CudaFp8Experts(const ExpertsConfig& config, int streams) : Experts(config), streams_(streams) {}
  std::string_view name() const override { return "cuda"; }

  Shape output_shape(const ExpertsInputs& in) const override { return check_inputs(in, config()).out_shape; }

  void apply(const ExpertsInputs& in, const TensorView& out) const override {
    const Problem p = check_inputs(in, config());
    check_out(p, out);
    if (p.s.batched) {
      if (p.s.max_tokens > 0) run_batched(p, out, streams_);  // all-zero counts are only known on the device
    } else if (p.s.m > 0) {
      run_standard(p, out, streams_);
    }
  }

  Tensor apply(const ExpertsInputs& in) const override {
    const Problem p = check_inputs(in, config());
    Tensor out = Tensor::empty(DType::bf16, p.out_shape, p.device);
    if (p.s.batched && out.nbytes() > 0) {  // rows past the counts read as zero
      DeviceGuard guard(p.device.index);
      EPMOE_CUDA_CHECK(
          cudaMemsetAsync(out.data(), 0, out.nbytes(), static_cast<cudaStream_t>(current_stream().handle)));
    }
    apply(in, out.view());
    return out;
  }

 protected:
  void run(const ExpertsProblem&, const TensorView&) const override {
    raise(ErrorCode::internal, "CudaFp8Experts::run called");
  }

 private:
  int streams_;
};

int default_streams() {
  const char* env = std::getenv("EPMOE_CUDA_EXPERTS_FP8_STREAMS");
  if (env == nullptr || *env == '\0') return 0;
  const std::string v(env);
  if (v == "auto") return 0;
  if (v.size() == 1 && v[0] >= '1' && v[0] <= '0' + kMaxStreams) return v[0] - '0';
  throw_invalid_argument("EPMOE_CUDA_EXPERTS_FP8_STREAMS", fmt::format("auto or 1..{}", kMaxStreams),
                         fmt::format("'{}'", v));
}

}  // namespace

std::unique_ptr<Experts> make_cuda_experts_fp8(const ExpertsConfig& config) {
  return std::make_unique<CudaFp8Experts>(config, default_streams());
}

std::unique_ptr<Experts> make_cuda_experts_fp8(const ExpertsConfig& config, int streams) {
  EPMOE_CHECK_ARG(streams >= 0 && streams <= kMaxStreams, "streams", fmt::format("0 (auto) .. {}", kMaxStreams),
                  streams);
  return std::make_unique<CudaFp8Experts>(config, streams);
}

}  // namespace epmoe::experts_cuda_fp8

#endif  // EPMOE_HAVE_CUDA
