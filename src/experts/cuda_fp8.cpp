// The fp8 block-scaled experts on one GPU (ExpertsQuant::fp8_block, DeepSeek-V3's format; make_cuda_experts
// dispatches here): workspaces and cuBLASLt's block-scaled fp8 GEMMs (cuBLAS >= 12.9 on Hopper: A = weights with
// CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, B = activations with CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F,
// "TN", float32 compute, no fast accumulation). The argument checks are check_fp8_inputs and
// check_experts_routing, what both CUDA experts share is in cuda_common.cpp, the elementwise kernels live in
// cuda_fp8.cu and the scale layouts are described in cuda_fp8.hpp.
//
// Per expert (one GEMM per layer and non-empty expert, as vLLM's per-expert fallback and DeepGEMM's m-grouped
// GEMMs compute it):
//   x fp8 [n, H] (+ 1x128 scales) -> gemm1 -> g float32 [n, 2N or N] -> act, semantics §6 quantization -> a fp8
//   [n, N] (+ 1x128 scales) -> gemm2 -> y bf16 [n, H].
// gemm1 writes float32, not bf16: the intermediate is re-quantized to fp8, and a bf16 rounding before that
// would move ~1.5% of the fp8 codes by one step (vs. the float64 reference), about 1% relative L2 -- semantics §13's
// whole budget. Every GEMM's row count is a multiple of 4 (segments padded by make_permute_layout's
// expert_alignment, batched slabs rounded up), which keeps each expert's block of token-major scales aligned.
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

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/cuda_util.hpp"
#include "experts/cuda_common.hpp"
#include "experts/cuda_fp8.hpp"
#include "experts/experts.hpp"
#include "experts/fp8.hpp"

namespace epmoe::experts_cuda_fp8 {

namespace {

using cuda_util::capturing;
using cuda_util::DeviceGuard;
// What both CUDA experts share (cuda_common.hpp).
using experts_cuda::Carve;
using experts_cuda::CudaExpertsBase;
using experts_cuda::CudaProblem;
using experts_cuda::SideStreams;
using experts_cuda::StandardRouting;
using experts_cuda::Workspace;

using experts_fp8::blocks;

// cuBLAS's recommended workspace on Hopper (cuBLAS docs, "cublasSetWorkspace"): 32 MiB.
constexpr std::size_t kLtWorkspace = std::size_t{32} << 20;
constexpr std::int64_t kRowAlign = 4;  // rows per GEMM: a multiple of 4 (16-byte columns of float32 scales)
constexpr int kMaxStreams = experts_cuda::kSideStreams;
// Mean rows per expert up to which the GEMMs go to kMaxStreams forked streams by default: between the bf16 experts'
// measured points (4 streams won at 32 rows, lost at 1024; bench/results/2026-11-30-gpu-experts.md).
constexpr double kStreamsMaxMeanRows = 256;

constexpr CudaIndexLimits kIndexLimits{kRowAlign, std::numeric_limits<int>::max() / 2,
                                       "K <= 512 and M * K < 2^30 on CUDA"};

std::int64_t round_up(std::int64_t v, std::int64_t m) { return (v + m - 1) / m * m; }
std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

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

// Per host thread and device: the cuBLASLt handle, the plans (descriptors carry per-call scale pointers, so
// they are not shared between threads) and the side streams the per-expert GEMMs can be spread over. Never
// destroyed (see SideStreams).
struct ThreadState {
  cublasLtHandle_t handle = nullptr;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
  std::unordered_map<PlanKey, bool, PlanKeyHash> pad_k;  // needs_k_padding's answers
  SideStreams streams;
};

ThreadState& thread_state(int device, cudaStream_t s) {
  thread_local std::unordered_map<int, ThreadState> states;
  ThreadState& st = states[device];
  if (st.handle == nullptr) {
    experts_cuda::refuse_capture_of_first_use(s, device, "fp8 CUDA experts", "cuBLASLt");
    EPMOE_CUBLAS_CHECK(cublasLtCreate(&st.handle));
    st.streams.create();
  }
  return st;
}

// The streams a layer's GEMMs go to: the caller's stream alone, or `n` side streams that wait for it first.
struct Lanes {
  ThreadState& st;
  cudaStream_t main;
  int n;  // 1: the caller's stream; > 1: side streams 0..n-1
  char* workspace;  // n * kLtWorkspace bytes

  cudaStream_t stream(std::size_t i) const { return n == 1 ? main : st.streams.side[i % static_cast<std::size_t>(n)]; }
  void* work(std::size_t i) const { return workspace + (n == 1 ? 0 : i % static_cast<std::size_t>(n)) * kLtWorkspace; }
  void fork() const {
    if (n > 1) st.streams.fork(main, n);
  }
  void join() const {
    if (n > 1) st.streams.join(main, n);
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
  EPMOE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scales, sizeof a_scales));
  EPMOE_CUBLAS_CHECK(
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
    EPMOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    EPMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
    EPMOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
    const cublasLtMatmulMatrixScale_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    const cublasLtMatmulMatrixScale_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    EPMOE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof a_mode));
    EPMOE_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof b_mode));
    set_scales(p, a_scales, b_scales);
    const auto m = static_cast<std::uint64_t>(key.m), n = static_cast<std::uint64_t>(key.n),
               k = static_cast<std::uint64_t>(key.k);
    EPMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, k, m, static_cast<std::int64_t>(k)));
    EPMOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_8F_E4M3, k, n, static_cast<std::int64_t>(k)));
    EPMOE_CUBLAS_CHECK(
        cublasLtMatrixLayoutCreate(&p.d, key.out_f32 ? CUDA_R_32F : CUDA_R_16BF, m, n, static_cast<std::int64_t>(m)));
    cublasLtMatmulPreference_t pref = nullptr;
    EPMOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const std::size_t ws = kLtWorkspace;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t status =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulAlgoGetHeuristic(st.handle, p.desc, p.a, p.b, p.d, p.d, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    EPMOE_CUBLAS_CHECK(status);
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
  EPMOE_CUBLAS_CHECK(cublasLtMatmul(st.handle, p.desc, &alpha, w, p.a, x, p.b, &beta, c, p.d, c, p.d, &p.algo,
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

// Weight block scales in cuBLASLt's layout (row stride rounded up to 4 floats, 16-byte aligned).
struct WeightScales {
  std::int64_t kb1, kb1p, kb2, kb2p, nb1, nb2;
};
WeightScales weight_scale_sizes(const CudaProblem& s) {
  WeightScales w{};
  w.nb1 = blocks(s.r1);
  w.kb1 = blocks(s.h);
  w.kb1p = round_up(w.kb1, 4);
  w.nb2 = blocks(s.h);
  w.kb2 = blocks(s.n);
  w.kb2p = round_up(w.kb2, 4);
  return w;
}

// ---- the two layers, both formats ---------------------------------------------------------------------------

/// The GEMM rows of one expert: rows r0 .. r0 + n of the layers' buffers.
struct ExpertRows {
  std::int64_t e, r0, n;
};

// The experts' two layers on `rows` GEMM rows, one GEMM per layer and expert: x fp8 [rows, H] with token-major
// scales -> gemm1 -> g float32 [rows, 2N or N] -> act, semantics §6 quantization -> a fp8 [rows, N] with token-major
// scales -> gemm2 -> y bf16 [y_rows, H]. Inner sizes that cuBLASLt cannot take as a partial 128-block are
// zero-padded (needs_k_padding): x and the weights are copied with the padded row stride.
class Fp8Layers {
 public:
  // Reserves the buffers in `c`, the carve of the caller's workspace; `lanes` streams (lane_count).
  Fp8Layers(const CudaProblem& p, ThreadState& st, std::int64_t rows, std::int64_t y_rows, int lanes, Carve& c)
      : p_(p), st_(st), rows_(rows), lanes_(lanes), ws_(weight_scale_sizes(p)) {
    const std::int64_t E = p.e_local, H = p.h, N = p.n, R = p.r1;
    const auto* w1_user = static_cast<const float*>(p.w1_scales.data);
    const auto* w2_user = static_cast<const float*>(p.w2_scales.data);
    k1_ = needs_k_padding(st, R, H, true, w1_user, w2_user) ? round_up(H, experts_fp8::kBlock) : H;
    k2_ = needs_k_padding(st, H, N, false, w2_user, w1_user) ? round_up(N, experts_fp8::kBlock) : N;
    o_xpad_ = k1_ != H ? c.take(sz(rows * k1_)) : 0;
    o_w1pad_ = k1_ != H ? c.take(sz(E * R * k1_)) : 0;
    o_w2pad_ = k2_ != N ? c.take(sz(E * H * k2_)) : 0;
    o_xst_ = c.take(sizeof(float) * sz(rows * blocks(H)));
    o_w1s_ = c.take(sizeof(float) * sz(E * ws_.nb1 * ws_.kb1p));
    o_w2s_ = c.take(sizeof(float) * sz(E * ws_.nb2 * ws_.kb2p));
    o_g_ = c.take(sizeof(float) * sz(rows * R));
    o_a_ = c.take(sz(rows * k2_));
    o_ast_ = c.take(sizeof(float) * sz(rows * blocks(N)));
    o_y_ = c.take(sizeof(std::uint16_t) * sz(y_rows * H));
    o_lt_ = c.take(kLtWorkspace * static_cast<std::size_t>(lanes));
  }

  // x's token-major scales, float32 [ceil(H/128)][per segment], for the caller to write before run().
  float* x_scales(const Workspace& w) const { return reinterpret_cast<float*>(w.at(o_xst_)); }
  // The output rows, bf16 [y_rows, H].
  char* y(const Workspace& w) const { return w.at(o_y_); }

  // Both layers of `experts` on x (fp8 rows of H bytes); `segs` locates every GEMM row for the activation.
  void run(const Workspace& w, const std::uint8_t* x, const std::vector<ExpertRows>& experts, const Segments& segs,
           cudaStream_t s) const {
    const std::int64_t E = p_.e_local, H = p_.h, N = p_.n, R = p_.r1, GH = blocks(H), GN = blocks(N);
    const std::int64_t K1 = k1_, K2 = k2_, nb1 = ws_.nb1, kb1p = ws_.kb1p, nb2 = ws_.nb2, kb2p = ws_.kb2p;
    const float* xst = x_scales(w);
    auto* w1s = reinterpret_cast<float*>(w.at(o_w1s_));
    auto* w2s = reinterpret_cast<float*>(w.at(o_w2s_));
    auto* g = reinterpret_cast<float*>(w.at(o_g_));
    auto* a = reinterpret_cast<std::uint8_t*>(w.at(o_a_));
    auto* ast = reinterpret_cast<float*>(w.at(o_ast_));
    char* y = w.at(o_y_);
    pad_weight_scales(static_cast<const float*>(p_.w1_scales.data), E * nb1, ws_.kb1, kb1p, w1s, s);
    pad_weight_scales(static_cast<const float*>(p_.w2_scales.data), E * nb2, ws_.kb2, kb2p, w2s, s);
    const auto* w1p = static_cast<const std::uint8_t*>(p_.w1.data);
    const auto* w2p = static_cast<const std::uint8_t*>(p_.w2.data);
    if (K1 != H) {  // whole 128-blocks along H for cuBLASLt (see needs_k_padding)
      copy_padded(x, rows_, H, K1, w.at(o_xpad_), s);
      copy_padded(w1p, E * R, H, K1, w.at(o_w1pad_), s);
      x = reinterpret_cast<const std::uint8_t*>(w.at(o_xpad_));
      w1p = reinterpret_cast<const std::uint8_t*>(w.at(o_w1pad_));
    }
    if (K2 != N) {
      copy_padded(w2p, E * H, N, K2, w.at(o_w2pad_), s);
      w2p = reinterpret_cast<const std::uint8_t*>(w.at(o_w2pad_));
      EPMOE_CUDA_CHECK(cudaMemset2DAsync(a + N, sz(K2), 0, sz(K2 - N), sz(rows_), s));
    }
    const Lanes lanes{st_, s, lanes_, w.at(o_lt_)};
    lanes.fork();
    for (std::size_t i = 0; i < experts.size(); ++i) {
      const auto [e, r0, n] = experts[i];
      gemm(st_, lanes.stream(i), lanes.work(i), w1p + e * R * K1, w1s + e * nb1 * kb1p, x + r0 * K1, xst + r0 * GH,
           g + r0 * R, true, R, n, K1);
    }
    lanes.join();
    activation_quant(p_.act, g, rows_, N, segs, a, K2, ast, s);
    lanes.fork();
    for (std::size_t i = 0; i < experts.size(); ++i) {
      const auto [e, r0, n] = experts[i];
      gemm(st_, lanes.stream(i), lanes.work(i), w2p + e * H * K2, w2s + e * nb2 * kb2p, a + r0 * K2, ast + r0 * GN,
           y + r0 * H * 2, false, H, n, K2);
    }
    lanes.join();
  }

 private:
  const CudaProblem& p_;
  ThreadState& st_;
  std::int64_t rows_;
  int lanes_;
  WeightScales ws_;
  std::int64_t k1_ = 0, k2_ = 0;  // the GEMMs' inner sizes: H and N, or rounded up to whole 128-blocks
  std::size_t o_xpad_, o_w1pad_, o_w2pad_, o_xst_, o_w1s_, o_w2s_, o_g_, o_a_, o_ast_, o_y_, o_lt_;
};

// ---- Standard format ---------------------------------------------------------------------------------------

// The input in fp8 with row-major scales (quantized here from bf16/fp32, else as given), grouped by expert into
// xp [capacity, H] and xps [capacity, ceil(H/128)].
void permute_input(const CudaProblem& p, const StandardRouting& routing, const Workspace& w, std::size_t o_xq,
                   std::size_t o_xs, const TensorView& xp, const TensorView& xps, cudaStream_t s) {
  const std::int64_t M = p.m, H = p.h;
  TensorView xq = p.hidden, xs = p.hidden_scales;
  if (!p.hidden_fp8) {
    quantize_rows(p.hidden.data, p.hidden.dtype == DType::fp32, M, H,
                  p.weight_on_input ? static_cast<const float*>(p.topk_weights.data) : nullptr, p.k, M, M,
                  reinterpret_cast<std::uint8_t*>(w.at(o_xq)), reinterpret_cast<float*>(w.at(o_xs)), false,
                  Segments{}, s);
    xq = TensorView(w.at(o_xq), DType::fp8_e4m3, {M, H}, p.device);
    xs = TensorView(w.at(o_xs), DType::fp32, {M, blocks(H)}, p.device);
  }
  permute_into(xq, routing.layout(), xp, xs, xps, Stream{s});
}

void standard_format(const CudaProblem& p, const TensorView& out, int streams) {
  const cudaStream_t s = cuda_util::to_cuda(current_stream());
  const int dev = p.device.index;
  DeviceGuard guard(dev);
  if (capturing(s))
    raise(ErrorCode::unsupported,
          "fp8 CUDA experts: the standard format synchronises once to read the per-expert row counts and cannot be "
          "captured in a CUDA graph (use the batched_experts format)");
  ThreadState& st = thread_state(dev, s);
  const std::int64_t M = p.m, E = p.e_local, H = p.h, GH = blocks(H);

  // Phase 1 (before the synchronisation): local ids and their layout, the input in fp8 grouped by expert.
  Carve c1;
  StandardRouting routing(p, static_cast<int>(kRowAlign), c1);
  const std::int64_t cap = routing.capacity();
  const std::size_t o_xq = !p.hidden_fp8 ? c1.take(sz(M * H)) : 0;
  const std::size_t o_xs = !p.hidden_fp8 ? c1.take(sizeof(float) * sz(M * GH)) : 0;
  const std::size_t o_xp = c1.take(sz(cap * H));
  const std::size_t o_xps = c1.take(sizeof(float) * sz(cap * GH));
  Workspace w1(dev, c1.size, s);
  routing.enqueue(w1, s);
  const TensorView xp(w1.at(o_xp), DType::fp8_e4m3, {cap, H}, p.device);
  const TensorView xps(w1.at(o_xps), DType::fp32, {cap, GH}, p.device);
  permute_input(p, routing, w1, o_xq, o_xs, xp, xps, s);

  const std::vector<std::int64_t> start = routing.segment_starts(s);
  const std::int64_t rows = start[sz(E)];
  if (rows == 0) {  // no slot has a local expert: the output is zero
    EPMOE_CUDA_CHECK(cudaMemsetAsync(out.data, 0, out.nbytes(), s));
    return;
  }

  // Phase 2: the layers on the non-empty experts' segments, then back to token order.
  std::vector<ExpertRows> experts;
  for (std::int64_t e = 0; e < E; ++e)
    if (start[sz(e + 1)] > start[sz(e)]) experts.push_back({e, start[sz(e)], start[sz(e + 1)] - start[sz(e)]});
  const int lanes = lane_count(streams, static_cast<double>(rows) / static_cast<double>(experts.size()));
  Carve c2;
  const Fp8Layers layers(p, st, rows, cap, lanes, c2);
  Workspace w2(dev, c2.size, s);
  Segments segs;
  segs.seg = routing.seg();
  segs.e_local = static_cast<int>(E);
  transpose_scales(static_cast<const float*>(xps.data), rows, GH, segs, layers.x_scales(w2), s);
  layers.run(w2, static_cast<const std::uint8_t*>(xp.data), experts, segs, s);
  routing.to_token_order(layers.y(w2), out, s);
}

// ---- BatchedExperts format ---------------------------------------------------------------------------------

void batched_format(const CudaProblem& p, const TensorView& out, int streams) {
  const cudaStream_t s = cuda_util::to_cuda(current_stream());
  const int dev = p.device.index;
  DeviceGuard guard(dev);
  ThreadState& st = thread_state(dev, s);
  const std::int64_t E = p.e_local, T = p.max_tokens, H = p.h;
  const std::int64_t Tp = round_up(T, kRowAlign), rows = E * Tp;
  const auto* counts = static_cast<const std::int32_t*>(p.counts.data);
  const bool own_x = !p.hidden_fp8 || Tp != T;

  Carve c;
  const std::size_t o_x = own_x ? c.take(sz(rows * H)) : 0;
  const Fp8Layers layers(p, st, rows, rows, lane_count(streams, static_cast<double>(Tp)), c);
  Workspace w(dev, c.size, s);
  float* xst = layers.x_scales(w);

  Segments segs;
  segs.e_local = static_cast<int>(E);
  segs.slab = Tp;
  segs.valid = T;
  segs.counts = counts;
  // Every row of every slab goes through the GEMMs (the counts stay on the device); the quantization, the
  // activation and the final copy skip the rows past each count. Columns of a GEMM are independent, so the
  // stale rows never touch a counted one.
  const std::uint8_t* x = static_cast<const std::uint8_t*>(p.hidden.data);
  if (!p.hidden_fp8) {
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
    transpose_scales(static_cast<const float*>(p.hidden_scales.data), rows, blocks(H), all, xst, s);
  }
  std::vector<ExpertRows> experts;
  for (std::int64_t e = 0; e < E; ++e) experts.push_back({e, e * Tp, Tp});
  layers.run(w, x, experts, segs, s);
  copy_slab_rows(layers.y(w), Tp, out.data, T, static_cast<int>(E), T, H * 2, counts, s);
}

// ---- the Experts object ------------------------------------------------------------------------------------

class CudaFp8Experts final : public CudaExpertsBase {
 public:
  CudaFp8Experts(const ExpertsConfig& config, int streams) : CudaExpertsBase(config), streams_(streams) {}

 protected:
  CudaProblem check(const ExpertsInputs& in) const override {
    EPMOE_CHECK_ARG(in.w2.defined(), "w2", "a float8_e4m3fn [E_local, H, N] tensor (fp8_block)", "None");
    experts_fp8::Fp8Sizes s = experts_fp8::check_fp8_inputs(in, config(), cuda_weights_device(in.w2));
    check_aligned16(in.w1, "w1");
    check_aligned16(in.w2, "w2");
    check_aligned16(in.hidden, "hidden");
    check_experts_routing(in, &kIndexLimits, s);
    CudaProblem p = experts_cuda::cuda_problem(in, s);
    p.hidden_fp8 = s.hidden_fp8;
    return p;
  }
  void run_standard(const CudaProblem& p, const TensorView& out) const override {
    standard_format(p, out, streams_);
  }
  void run_batched(const CudaProblem& p, const TensorView& out) const override { batched_format(p, out, streams_); }

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
