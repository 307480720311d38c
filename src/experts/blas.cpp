// The fast CPU experts on OpenBLAS (float32 GEMMs over bf16 data).
//
// OpenBLAS (as packaged) has no bf16 GEMM, so per local expert: gather the expert's tokens into a
// float32 tile, then for each layer widen the bf16 weights (exact) one cache-sized tile of rows at a
// time, each tile followed by the cblas_sgemm that consumes it, and finally scatter. The first GEMM's
// output and the activation output are rounded to bf16 on the way, as vLLM's fused kernels round
// their bf16 intermediate caches; this keeps the CPU fast path numerically close to the GPU paths.
#include <epmoe/experts.hpp>

#include "core/check.hpp"
#include "experts/problem.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace epmoe {

namespace {

// Rows per GEMM call: bounds the float32 scratch when one expert receives many tokens (prefill),
// while still large enough for the GEMM to run at full speed.
constexpr std::int64_t kRowBlock = 512;

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

void widen(const bf16_t* src, float* dst, std::int64_t count) {
  // bf16 is the top half of a float: a shift, which the compiler vectorizes.
  const std::uint16_t* s = reinterpret_cast<const std::uint16_t*>(src);
  std::uint32_t* d = reinterpret_cast<std::uint32_t*>(dst);
  for (std::int64_t i = 0; i < count; ++i) d[i] = static_cast<std::uint32_t>(s[i]) << 16;
}

// One hidden row into float32 (exact for both bf16 and fp32 inputs).
void load_row(const ExpertsProblem& p, std::int64_t row, float* dst) {
  if (p.hidden_dtype == DType::bf16) {
    widen(static_cast<const bf16_t*>(p.hidden) + row * p.h, dst, p.h);
  } else {
    std::memcpy(dst, static_cast<const float*>(p.hidden) + row * p.h, static_cast<std::size_t>(p.h) * sizeof(float));
  }
}

// Weight rows widened per GEMM call: a tile of about kTileBytes stays in cache between its widening
// and the GEMM that reads it, so the float32 copy of the weights never travels to memory and back.
// Measured at the OLMoE shape on Zen 4 (1 MiB L2): 256 KiB .. 2 MiB tiles cost the same at 256 tokens,
// 1-2 MiB is best for decode-sized batches (5x faster than widening a whole expert first).
constexpr std::int64_t kTileBytes = std::int64_t{1} << 20;

std::int64_t tile_rows(std::int64_t row_len, std::int64_t rows) {
  return std::clamp<std::int64_t>(kTileBytes / (row_len * static_cast<std::int64_t>(sizeof(float))), 1, rows);
}

struct Scratch {
  std::vector<float> tile;        // widened weight rows
  std::vector<float> x, g, a, y;  // per row block: [rows, h], [rows, w1_rows], [rows, n], [rows, h]

  Scratch(const ExpertsProblem& p, std::int64_t max_rows) {
    const auto rows = static_cast<std::size_t>(std::min(max_rows, kRowBlock));
    const auto h = static_cast<std::size_t>(p.h), n = static_cast<std::size_t>(p.n);
    const auto r1 = static_cast<std::size_t>(p.w1_rows());
    tile.resize(std::max(static_cast<std::size_t>(tile_rows(p.h, p.w1_rows())) * h,
                         static_cast<std::size_t>(tile_rows(p.n, p.h)) * n));
    x.resize(rows * h);
    g.resize(rows * r1);
    a.resize(rows * n);
    y.resize(rows * h);
  }
};

template <class F>
void activate_gated(const ExpertsProblem& p, std::int64_t rows, const float* g, float* a, F f) {
  const std::int64_t r1 = p.w1_rows(), n = p.n;
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < n; ++j)
      a[i * n + j] = round_bf16(f(round_bf16(g[i * r1 + p.gate_row(j)]), round_bf16(g[i * r1 + p.up_row(j)])));
}

template <class F>
void activate_plain(const ExpertsProblem& p, std::int64_t rows, const float* g, float* a, F f) {
  for (std::int64_t i = 0; i < rows * p.n; ++i) a[i] = round_bf16(f(round_bf16(g[i])));
}

inline float silu_f(float x) { return x / (1.0f + std::exp(-x)); }
inline float gelu_f(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f)); }

// a [rows, n] = act(g [rows, w1_rows]), both roundings to bf16 included.
void activate(const ExpertsProblem& p, std::int64_t rows, const float* g, float* a) {
  switch (p.activation) {
    case Activation::silu:
      return activate_gated(p, rows, g, a, [](float gt, float u) { return silu_f(gt) * u; });
    case Activation::gelu:
      return activate_gated(p, rows, g, a, [](float gt, float u) { return gelu_f(gt) * u; });
    case Activation::swigluoai:
      return activate_gated(p, rows, g, a, [](float gt, float u) {
        gt = std::min(gt, 7.0f);
        u = std::clamp(u, -7.0f, 7.0f);
        return (u + 1.0f) * gt / (1.0f + std::exp(-1.702f * gt));
      });
    case Activation::silu_no_mul: return activate_plain(p, rows, g, a, silu_f);
    case Activation::gelu_no_mul: return activate_plain(p, rows, g, a, gelu_f);
    case Activation::relu2_no_mul:
      return activate_plain(p, rows, g, a, [](float x) { return x > 0.0f ? x * x : 0.0f; });
  }
}

// c[rows, w_rows] (leading dimension ldc) = a[rows, len] @ w[w_rows, len]^T, w in bf16: widened one
// cache-sized tile of rows at a time, each tile followed by its GEMM.
void gemm_bf16_weights(std::int64_t rows, const float* a, const bf16_t* w, std::int64_t w_rows, std::int64_t len,
                       float* c, std::int64_t ldc, std::vector<float>& tile) {
  const std::int64_t step = tile_rows(len, w_rows);
  for (std::int64_t r0 = 0; r0 < w_rows; r0 += step) {
    const std::int64_t nr = std::min(step, w_rows - r0);
    widen(w + r0 * len, tile.data(), nr * len);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(rows), static_cast<blasint>(nr),
                static_cast<blasint>(len), 1.0f, a, static_cast<blasint>(len), tile.data(), static_cast<blasint>(len),
                0.0f, c + r0, static_cast<blasint>(ldc));
  }
}

// s.y[rows, h] = w2[e] @ act(w1[e] @ s.x[rows, h]).
void expert_block(const ExpertsProblem& p, std::int64_t e, std::int64_t rows, Scratch& s) {
  const std::int64_t r1 = p.w1_rows();
  gemm_bf16_weights(rows, s.x.data(), p.w1 + e * r1 * p.h, r1, p.h, s.g.data(), r1, s.tile);
  activate(p, rows, s.g.data(), s.a.data());
  gemm_bf16_weights(rows, s.a.data(), p.w2 + e * p.h * p.n, p.h, p.n, s.y.data(), p.h, s.tile);
}

void run_standard(const ExpertsProblem& p, bf16_t* out) {
  // Counting sort of the (token, k) slots by local expert; token order is kept inside an expert.
  const auto slots = static_cast<std::size_t>(p.m * p.k);
  std::vector<std::int64_t> start(static_cast<std::size_t>(p.e_local) + 1, 0);
  for (std::int32_t e : p.local_ids)
    if (e >= 0) ++start[static_cast<std::size_t>(e) + 1];
  for (std::size_t e = 0; e < static_cast<std::size_t>(p.e_local); ++e) start[e + 1] += start[e];
  std::vector<std::int64_t> order(static_cast<std::size_t>(start.back()));
  {
    std::vector<std::int64_t> fill(start.begin(), start.end() - 1);
    for (std::size_t i = 0; i < slots; ++i)
      if (const std::int32_t e = p.local_ids[i]; e >= 0)
        order[static_cast<std::size_t>(fill[static_cast<std::size_t>(e)]++)] = static_cast<std::int64_t>(i);
  }
  std::int64_t max_rows = 0;
  for (std::size_t e = 0; e < static_cast<std::size_t>(p.e_local); ++e)
    max_rows = std::max(max_rows, start[e + 1] - start[e]);

  std::vector<float> acc;  // reduce: [m, h] float32 accumulator
  if (p.reduce) acc.assign(static_cast<std::size_t>(p.m * p.h), 0.0f);
  else std::fill(out, out + p.m * p.k * p.h, bf16_t{0});  // slots without a local expert are zero
  if (max_rows == 0) {
    if (p.reduce) std::fill(out, out + p.m * p.h, bf16_t{0});
    return;
  }

  Scratch s(p, max_rows);
  for (std::int64_t e = 0; e < p.e_local; ++e) {
    const std::int64_t begin = start[static_cast<std::size_t>(e)], end = start[static_cast<std::size_t>(e) + 1];
    if (begin == end) continue;
    for (std::int64_t b = begin; b < end; b += kRowBlock) {
      const std::int64_t rows = std::min(kRowBlock, end - b);
      for (std::int64_t i = 0; i < rows; ++i) {  // gather
        const std::int64_t slot = order[static_cast<std::size_t>(b + i)], t = slot / p.k;
        float* x = s.x.data() + i * p.h;
        load_row(p, t, x);
        if (p.weight_on_input) {
          // As vLLM's prepare step: the scaled activations are stored in the input dtype.
          const float w = p.topk_weights[slot];
          for (std::int64_t c = 0; c < p.h; ++c)
            x[c] = p.hidden_dtype == DType::bf16 ? round_bf16(x[c] * w) : x[c] * w;
        }
      }
      expert_block(p, e, rows, s);
      for (std::int64_t i = 0; i < rows; ++i) {  // scatter
        const std::int64_t slot = order[static_cast<std::size_t>(b + i)], t = slot / p.k;
        const float* y = s.y.data() + i * p.h;
        if (p.reduce) {
          const float w = p.weight_on_input ? 1.0f : p.topk_weights[slot];
          float* o = acc.data() + t * p.h;
          for (std::int64_t c = 0; c < p.h; ++c) o[c] += w * y[c];
        } else {
          bf16_t* o = out + slot * p.h;
          for (std::int64_t c = 0; c < p.h; ++c) o[c] = float_to_bf16(y[c]);
        }
      }
    }
  }
  if (p.reduce)
    for (std::int64_t i = 0; i < p.m * p.h; ++i) out[i] = float_to_bf16(acc[static_cast<std::size_t>(i)]);
}

void run_batched(const ExpertsProblem& p, bf16_t* out) {
  std::int64_t max_rows = 0;
  for (std::int64_t e = 0; e < p.e_local; ++e) max_rows = std::max<std::int64_t>(max_rows, p.counts[e]);
  Scratch s(p, max_rows);
  for (std::int64_t e = 0; e < p.e_local; ++e) {
    if (p.counts[e] == 0) continue;
    for (std::int64_t b = 0; b < p.counts[e]; b += kRowBlock) {
      const std::int64_t rows = std::min<std::int64_t>(kRowBlock, p.counts[e] - b);
      const std::int64_t row0 = e * p.max_tokens + b;
      for (std::int64_t i = 0; i < rows; ++i) load_row(p, row0 + i, s.x.data() + i * p.h);
      expert_block(p, e, rows, s);
      bf16_t* o = out + row0 * p.h;
      for (std::int64_t i = 0; i < rows * p.h; ++i) o[i] = float_to_bf16(s.y[static_cast<std::size_t>(i)]);
    }
  }
}

class BlasExperts final : public Experts {
 public:
  using Experts::Experts;
  std::string_view name() const override { return "blas"; }

 protected:
  void run(const ExpertsProblem& p, const TensorView& out) const override {
    if (p.format == ActivationFormat::batched_experts) run_batched(p, static_cast<bf16_t*>(out.data));
    else run_standard(p, static_cast<bf16_t*>(out.data));
  }
};

}  // namespace

std::unique_ptr<Experts> make_blas_experts(const ExpertsConfig& config) {
  return std::make_unique<BlasExperts>(config);
}

int blas_experts_max_concurrent_threads() {
  const char* config = openblas_get_config();
  const char* at = config ? std::strstr(config, "MAX_THREADS=") : nullptr;
  if (!at) return 32;
  const long m = std::strtol(at + std::strlen("MAX_THREADS="), nullptr, 10);
  if (m < 1) return 32;
  return static_cast<int>(std::max<long>(50, 2 * m) - (m - 1));
}

}  // namespace epmoe
