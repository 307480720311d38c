// Layout entry points (include/epmoe/layout.hpp, semantics §3; include/epmoe/permute.hpp): argument checks, then
// the CPU loops (layout/cpu.cpp) or, for tensors on a GPU, the CUDA kernels (layout/cuda.cu).
#include "core/check.hpp"
#include <epmoe/layout.hpp>
#include <epmoe/permute.hpp>

#include <limits>

#include "core/cuda_util.hpp"
#include "layout/layout.hpp"

namespace epmoe {

namespace {

/// semantics §1 limit on experts per rank.
constexpr int kMaxLocalExperts = 1024;

std::string strides_of(const TensorView& t) {
  return fmt::format("{} with strides {}", describe(t), to_string(t.strides));
}

[[noreturn, maybe_unused]] void no_cuda(const TensorView& t, std::string_view name) {
  raise(ErrorCode::unsupported, "argument '{}' is on {} but epmoe was built without CUDA ({})", name,
        to_string(t.device), describe(t));
}

// A [rows, cols] matrix with unit inner stride and a row stride >= cols; on CUDA with 16-byte-aligned rows
// when `vector_rows` (the kernels move whole rows in 16-byte vectors).
void check_rows(const TensorView& t, std::string_view name, std::int64_t cols, bool vector_rows) {
  EPMOE_CHECK_ARG(t.ndim() == 2 && t.size(1) == cols, name, fmt::format("a 2-d tensor with {} columns", cols),
                  describe(t));
  EPMOE_CHECK_ARG(cols <= 1 || t.stride(1) == 1, name, "unit stride in dimension 1", strides_of(t));
  EPMOE_CHECK_ARG(t.size(0) <= 1 || t.stride(0) >= cols, name, fmt::format("a row stride >= {}", cols), strides_of(t));
  EPMOE_CHECK_ARG(t.data != nullptr || t.numel() == 0, name, "a non-null data pointer", "nullptr");
  if (vector_rows && t.device.is_cuda()) {
    const auto elem = static_cast<std::int64_t>(dtype_size(t.dtype));
    EPMOE_CHECK_ARG(cuda_util::aligned16(t.data) && (t.size(0) <= 1 || (t.stride(0) * elem) % 16 == 0), name,
                    "16-byte-aligned rows on CUDA (data pointer and row stride in bytes multiples of 16)",
                    fmt::format("{} at {}", strides_of(t), t.data));
  }
}

void check_same_device(const TensorView& t, std::string_view name, const Device& device, std::string_view what) {
  EPMOE_CHECK_ARG(t.device == device, name, fmt::format("a tensor on {}'s device {}", what, to_string(device)),
                  to_string(t.device));
}

// The parts of a layout the data-moving functions rely on.
void check_layout(const PermuteLayout& l, const Device& device, std::string_view what) {
  const std::int64_t M = l.num_tokens;
  EPMOE_CHECK_ARG(
      l.src2dst.defined() && l.src2dst.dtype() == DType::int32 && l.src2dst.shape() == Shape({M, l.num_topk}), "layout",
      fmt::format("a PermuteLayout from make_permute_layout (src2dst int32[{}, {}])", M, l.num_topk),
      fmt::format("src2dst {}", describe(l.src2dst.view())));
  EPMOE_CHECK_ARG(
      l.seg_indptr.defined() && l.seg_indptr.shape() == Shape({l.num_local_experts + 1}) &&
          l.num_tokens_per_expert.defined() && l.num_tokens_per_expert.shape() == Shape({l.num_local_experts}),
      "layout",
      fmt::format("seg_indptr [{}] and num_tokens_per_expert [{}]", l.num_local_experts + 1, l.num_local_experts),
      fmt::format("{} and {}", describe(l.seg_indptr.view()), describe(l.num_tokens_per_expert.view())));
  EPMOE_CHECK_ARG(l.capacity == permute_capacity(M, l.num_topk, l.num_local_experts, l.expert_alignment), "layout",
                  "capacity = permute_capacity(M, K, E_local, expert_alignment)", l.capacity);
  EPMOE_CHECK_ARG(l.src2dst.device() == device, "layout",
                  fmt::format("a layout on {}'s device {}", what, to_string(device)), to_string(l.src2dst.device()));
}

// ---- argument checks shared by the variants -----------------------------------------------------

void check_permute_args(const TensorView& x, const PermuteLayout& l, const TensorView& out, const TensorView& x_scales,
                        const TensorView& out_scales) {
  EPMOE_CHECK_ARG(x.defined(), "x", "a bfloat16, float32 or float8_e4m3fn tensor [M, H]", "None");
  EPMOE_CHECK_ARG(x.ndim() == 2 && (x.dtype == DType::bf16 || x.dtype == DType::fp32 || x.dtype == DType::fp8_e4m3),
                  "x", "a 2-d bfloat16, float32 or float8_e4m3fn tensor [M, H]", describe(x));
  check_layout(l, x.device, "x");
  const std::int64_t M = l.num_tokens, H = x.size(1);
  EPMOE_CHECK_ARG(x.size(0) == M, "x", fmt::format("{} rows (the layout's M)", M), describe(x));
  EPMOE_CHECK_ARG(H >= 1 && (H * static_cast<std::int64_t>(dtype_size(x.dtype))) % 16 == 0, "x",
                  "rows of a positive multiple of 16 bytes (H % 8 == 0 for bfloat16, % 4 for float32, % 16 for fp8)",
                  describe(x));
  check_rows(x, "x", H, true);
  EPMOE_CHECK_ARG(
      out.defined() && out.dtype == x.dtype && out.ndim() == 2 && out.size(0) >= l.capacity, "out",
      fmt::format("{}[>= {}, {}] (x's dtype, the layout's capacity rows)", dtype_name(x.dtype), l.capacity, H),
      describe(out));
  check_rows(out, "out", H, true);
  check_same_device(out, "out", x.device, "x");
  if (x_scales.defined()) {
    EPMOE_CHECK_ARG(x_scales.ndim() == 2 && (x_scales.dtype == DType::fp32 || x_scales.dtype == DType::int32) &&
                        x_scales.size(0) == M && x_scales.size(1) >= 1,
                    "x_scales", fmt::format("float32 or int32 [{}, S]", M), describe(x_scales));
    const std::int64_t S = x_scales.size(1);
    check_rows(x_scales, "x_scales", S, false);
    check_same_device(x_scales, "x_scales", x.device, "x");
    EPMOE_CHECK_ARG(out_scales.defined() && out_scales.dtype == x_scales.dtype && out_scales.ndim() == 2 &&
                        out_scales.size(0) >= l.capacity,
                    "out_scales", fmt::format("{}[>= {}, {}]", dtype_name(x_scales.dtype), l.capacity, S),
                    describe(out_scales));
    check_rows(out_scales, "out_scales", S, false);
    check_same_device(out_scales, "out_scales", x.device, "x");
  } else {
    EPMOE_CHECK_ARG(!out_scales.defined(), "out_scales", "None when x_scales is None", describe(out_scales));
  }
}

void check_unpermute_args(const TensorView& y, const PermuteLayout& l, const TensorView& w, const TensorView& out) {
  EPMOE_CHECK_ARG(y.defined(), "y", "a bfloat16 or float32 tensor [capacity, H]", "None");
  EPMOE_CHECK_ARG(y.ndim() == 2 && (y.dtype == DType::bf16 || y.dtype == DType::fp32), "y",
                  "a 2-d bfloat16 or float32 tensor", describe(y));
  check_layout(l, y.device, "y");
  const std::int64_t M = l.num_tokens, H = y.size(1);
  EPMOE_CHECK_ARG(y.size(0) >= l.capacity, "y", fmt::format("at least {} rows (the layout's capacity)", l.capacity),
                  describe(y));
  EPMOE_CHECK_ARG(H >= 1 && (H * static_cast<std::int64_t>(dtype_size(y.dtype))) % 16 == 0, "y",
                  "rows of a positive multiple of 16 bytes (H % 8 == 0 for bfloat16, % 4 for float32)", describe(y));
  check_rows(y, "y", H, true);
  EPMOE_CHECK_ARG(w.defined() && w.dtype == DType::fp32 && w.ndim() == 2 && w.size(0) == M && w.size(1) == l.num_topk,
                  "topk_weights", fmt::format("float32[{}, {}]", M, l.num_topk), describe(w));
  check_rows(w, "topk_weights", l.num_topk, false);
  check_same_device(w, "topk_weights", y.device, "y");
  EPMOE_CHECK_ARG(out.defined() && out.dtype == y.dtype && out.ndim() == 2 && out.size(0) == M, "out",
                  fmt::format("{}[{}, {}]", dtype_name(y.dtype), M, H), describe(out));
  check_rows(out, "out", H, true);
  check_same_device(out, "out", y.device, "y");
}

// Views of one device allocation holding all the layout's tensors (one cudaMalloc per layout).
struct Carve {
  std::shared_ptr<void> keep;
  char* base;
  std::size_t offset = 0;
  Device device;
  TensorView take(DType dtype, Shape shape) {
    offset = (offset + 15) / 16 * 16;
    TensorView v(base + offset, dtype, shape, device);
    offset += v.nbytes();
    return v;
  }
};

}  // namespace

DispatchLayout get_dispatch_layout(const TensorView& topk_idx, int num_experts, int num_ranks) {
  EPMOE_CHECK_ARG(topk_idx.defined(), "topk_idx", "an int64 or int32 [T, K] tensor", "None");
  check_topk_idx_dtype(topk_idx);
  EPMOE_CHECK_ARG(topk_idx.ndim() == 2, "topk_idx", "a 2-d [T, K] tensor", describe(topk_idx));
  EPMOE_CHECK_ARG(topk_idx.size(0) == 0 || topk_idx.size(1) == 0 || topk_idx.data != nullptr, "topk_idx",
                  "non-null data", "a null pointer");
#if !defined(EPMOE_HAVE_CUDA)
  if (!topk_idx.device.is_cpu())
    raise(ErrorCode::unsupported, "get_dispatch_layout: topk_idx on {} is not supported by this build (CPU only)",
          to_string(topk_idx.device));
#endif
  EPMOE_CHECK_ARG(num_ranks >= 1, "num_ranks", ">= 1", num_ranks);
  EPMOE_CHECK_ARG(num_experts >= 1, "num_experts", ">= 1", num_experts);
  EPMOE_CHECK_ARG(num_experts % num_ranks == 0, "num_experts",
                  fmt::format("a multiple of num_ranks ({})", num_ranks), num_experts);
  EPMOE_CHECK_ARG(num_experts / num_ranks <= kMaxLocalExperts, "num_experts",
                  fmt::format("at most {} experts per rank ({} ranks)", kMaxLocalExperts, num_ranks), num_experts);

#if defined(EPMOE_HAVE_CUDA)
  // layout/cuda.cu: asynchronous on the current stream; bad ids are flagged, not thrown (semantics §11).
  if (topk_idx.device.is_cuda()) return layout_detail::get_dispatch_layout_cuda(topk_idx, num_experts, num_ranks);
#endif
  const std::int64_t T = topk_idx.size(0);
  DispatchLayout out;
  out.num_tokens_per_rank = Tensor::empty(DType::int32, {num_ranks});
  out.num_tokens_per_expert = Tensor::empty(DType::int32, {num_experts});
  out.is_token_in_rank = Tensor::empty(DType::boolean, {T, num_ranks});
  layout_detail::dispatch_layout_cpu(topk_idx, num_experts, num_ranks, out);
  return out;
}

PermuteLayout make_permute_layout(const TensorView& topk_idx, int num_local_experts, int expert_alignment) {
  return make_permute_layout(topk_idx, num_local_experts, expert_alignment, current_stream());
}

PermuteLayout make_permute_layout(const TensorView& topk_idx, int num_local_experts, int expert_alignment,
                                  Stream stream) {
  EPMOE_CHECK_ARG(topk_idx.defined(), "topk_idx", "an int64 or int32 [M, K] tensor", "None");
  check_topk_idx_dtype(topk_idx);
  EPMOE_CHECK_ARG(topk_idx.ndim() == 2, "topk_idx", "a 2-d [M, K] tensor", describe(topk_idx));
  EPMOE_CHECK_ARG(topk_idx.data != nullptr || topk_idx.numel() == 0, "topk_idx", "non-null data", "a null pointer");
  EPMOE_CHECK_ARG(num_local_experts >= 1 && num_local_experts <= kMaxLocalExperts, "num_local_experts",
                  fmt::format("in [1, {}]", kMaxLocalExperts), num_local_experts);
  EPMOE_CHECK_ARG(expert_alignment >= 1, "expert_alignment", ">= 1", expert_alignment);
  const std::int64_t M = topk_idx.size(0), K = topk_idx.size(1);
  EPMOE_CHECK_ARG(K <= 512, "topk_idx", "at most 512 columns (K)", describe(topk_idx));
  const std::int64_t capacity = permute_capacity(M, static_cast<int>(K), num_local_experts, expert_alignment);
  EPMOE_CHECK_ARG(capacity <= std::numeric_limits<std::int32_t>::max(), "topk_idx",
                  "M * K + padding below 2^31 rows (src2dst is int32)",
                  fmt::format("{} rows ({}, expert_alignment {})", capacity, describe(topk_idx), expert_alignment));

  PermuteLayout l;
  l.num_tokens = M;
  l.num_topk = static_cast<int>(K);
  l.num_local_experts = num_local_experts;
  l.expert_alignment = expert_alignment;
  l.capacity = capacity;
  const Device device = topk_idx.device;
  if (device.is_cpu()) {
    l.seg_indptr = Tensor::empty(DType::int64, {num_local_experts + 1});
    l.num_tokens_per_expert = Tensor::empty(DType::int32, {num_local_experts});
    l.src2dst = Tensor::empty(DType::int32, {M, K});
    l.dst2src = Tensor::empty(DType::int32, {capacity});
    l.reorder_topk_ids = Tensor::empty(DType::int32, {capacity});
    layout_detail::make_permute_layout_cpu(topk_idx, l);
    return l;
  }
#if defined(EPMOE_HAVE_CUDA)
  const std::size_t ws = layout_detail::permute_layout_workspace_bytes(M * K, num_local_experts);
  const std::size_t bytes = 16 * 6 + 8 * static_cast<std::size_t>(num_local_experts + 1) +
                            4 * static_cast<std::size_t>(num_local_experts + M * K + 2 * capacity) + ws;
  Tensor storage = Tensor::empty(DType::int8, {static_cast<std::int64_t>(bytes)}, device);
  Carve c{std::shared_ptr<void>(storage.data(), [storage](void*) {}), static_cast<char*>(storage.data()), 0, device};
  l.seg_indptr = Tensor::wrap(c.take(DType::int64, {num_local_experts + 1}), c.keep);
  l.num_tokens_per_expert = Tensor::wrap(c.take(DType::int32, {num_local_experts}), c.keep);
  l.src2dst = Tensor::wrap(c.take(DType::int32, {M, K}), c.keep);
  l.dst2src = Tensor::wrap(c.take(DType::int32, {capacity}), c.keep);
  l.reorder_topk_ids = Tensor::wrap(c.take(DType::int32, {capacity}), c.keep);
  void* workspace = c.take(DType::int8, {static_cast<std::int64_t>(ws)}).data;
  EPMOE_ASSERT(c.offset <= bytes);
  layout_detail::make_permute_layout_cuda(
      topk_idx, num_local_experts, expert_alignment, capacity,
      {l.seg_indptr.ptr<std::int64_t>(), l.num_tokens_per_expert.ptr<std::int32_t>(), l.src2dst.ptr<std::int32_t>(),
       l.dst2src.ptr<std::int32_t>(), l.reorder_topk_ids.ptr<std::int32_t>(), workspace},
      stream);
  return l;
#else
  no_cuda(topk_idx, "topk_idx");
#endif
}

Permuted permute(const TensorView& x, const PermuteLayout& layout, const TensorView& x_scales) {
  return permute(x, layout, x_scales, current_stream());
}

Permuted permute(const TensorView& x, const PermuteLayout& layout, const TensorView& x_scales, Stream stream) {
  EPMOE_CHECK_ARG(x.defined() && x.ndim() == 2, "x", "a 2-d tensor [M, H]", describe(x));
  Permuted r;
  r.x = Tensor::empty(x.dtype, {layout.capacity, x.size(1)}, x.device);
  if (x_scales.defined()) {
    EPMOE_CHECK_ARG(x_scales.ndim() == 2 && x_scales.size(1) >= 1, "x_scales", "a 2-d tensor [M, S]",
                    describe(x_scales));
    r.scales = Tensor::empty(x_scales.dtype, {layout.capacity, x_scales.size(1)}, x.device);
  }
  permute_into(x, layout, r.x, x_scales, r.scales.defined() ? r.scales.view() : TensorView{}, stream);
  return r;
}

void permute_into(const TensorView& x, const PermuteLayout& layout, const TensorView& out, const TensorView& x_scales,
                  const TensorView& out_scales) {
  permute_into(x, layout, out, x_scales, out_scales, current_stream());
}

void permute_into(const TensorView& x, const PermuteLayout& layout, const TensorView& out, const TensorView& x_scales,
                  const TensorView& out_scales, Stream stream) {
  check_permute_args(x, layout, out, x_scales, out_scales);
  if (x.device.is_cpu()) {
    layout_detail::permute_cpu(x, x_scales, layout, out, out_scales);
    return;
  }
#if defined(EPMOE_HAVE_CUDA)
  layout_detail::permute_cuda(x, x_scales, layout, out, out_scales, stream);
#else
  no_cuda(x, "x");
#endif
}

Tensor unpermute(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights) {
  return unpermute(y, layout, topk_weights, current_stream());
}

Tensor unpermute(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights, Stream stream) {
  EPMOE_CHECK_ARG(y.defined() && y.ndim() == 2, "y", "a 2-d tensor [capacity, H]", describe(y));
  Tensor out = Tensor::empty(y.dtype, {layout.num_tokens, y.size(1)}, y.device);
  unpermute_into(y, layout, topk_weights, out, stream);
  return out;
}

void unpermute_into(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights,
                    const TensorView& out) {
  unpermute_into(y, layout, topk_weights, out, current_stream());
}

void unpermute_into(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights,
                    const TensorView& out, Stream stream) {
  check_unpermute_args(y, layout, topk_weights, out);
  if (y.device.is_cpu()) {
    layout_detail::unpermute_cpu(y, layout, topk_weights, out);
    return;
  }
#if defined(EPMOE_HAVE_CUDA)
  layout_detail::unpermute_cuda(y, layout, topk_weights, out, stream);
#else
  no_cuda(y, "y");
#endif
}

#if !defined(EPMOE_HAVE_CUDA)
namespace cuda {
void check_invalid_ids(Stream) {}
}  // namespace cuda
#endif

}  // namespace epmoe
