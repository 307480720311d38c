#include "transport/args/normal.hpp"

#include <epmoe/quant.hpp>

#include <climits>

#include "core/check.hpp"
#include "quant/quant.hpp"

namespace epmoe {

namespace {
void check_device(const TensorView& t, const char* name, Device device) {
  EPMOE_CHECK_ARG(t.device == device, name,
                  device.is_cpu() ? std::string("a CPU tensor (this backend moves host memory)")
                                  : fmt::format("a tensor on cuda:{} (this rank's device)", device.index),
                  describe(t));
}
}  // namespace

void check_tensor_on(const TensorView& t, const char* name, Device device) {
  check_device(t, name, device);
  EPMOE_CHECK_ARG(t.is_contiguous(), name, "a contiguous tensor", fmt::format("{} with strides {}", describe(t), t.strides));
  EPMOE_CHECK_ARG(t.numel() == 0 || t.data != nullptr, name, "non-null data", "a null data pointer");
}

void check_tensor(const TensorView& t, const char* name, DType dtype, const Shape& shape, Device device) {
  EPMOE_CHECK_ARG(t.defined(), name, fmt::format("{}{}", dtype_name(dtype), shape), "None");
  EPMOE_CHECK_ARG(t.dtype == dtype && t.shape == shape, name, fmt::format("{}{}", dtype_name(dtype), shape),
                  describe(t));
  check_tensor_on(t, name, device);
}

DispatchSpec check_dispatch_args(const DispatchArgs& a, int R, std::uint64_t buffer_id, Device device) {
  DispatchSpec s;
  const TensorView& x = a.x;
  EPMOE_CHECK_ARG(x.defined(), "x", "a bfloat16 or float8_e4m3fn [T, H] tensor", "None");
  if (x.dtype != DType::bf16 && x.dtype != DType::fp8_e4m3)
    throw_wrong_dtype("x", "bfloat16 or float8_e4m3fn", describe(x));
  EPMOE_CHECK_ARG(x.ndim() == 2, "x", "a 2-d [T, H] tensor", describe(x));
  check_tensor_on(x, "x", device);
  s.fp8 = x.dtype == DType::fp8_e4m3;
  s.T = x.size(0);
  s.H = x.size(1);
  EPMOE_CHECK_ARG(s.T <= INT32_MAX, "x", "at most 2^31 - 1 tokens (int32 token indices)", s.T);
  const int h_align = s.fp8 ? 16 : 8;  // rows of whole 16-byte vectors (semantics §1)
  EPMOE_CHECK_ARG(s.H > 0 && s.H % h_align == 0, "x",
                  fmt::format("hidden size (dimension 1) a positive multiple of {} for {}", h_align, dtype_name(x.dtype)),
                  s.H);

  if (s.fp8) {
    const std::int64_t groups = num_scale_groups(s.H);
    EPMOE_CHECK_ARG(a.x_scales.defined(), "x_scales",
                    fmt::format("float32[{}, {}] or UE8M0 int32[{}, {}] with float8 x", s.T, groups, s.T, (groups + 3) / 4),
                    "None");
    if (a.x_scales.dtype != DType::fp32 && a.x_scales.dtype != DType::int32)
      throw_wrong_dtype("x_scales", "float32 or int32 (UE8M0)", describe(a.x_scales));
    s.scale_format = a.x_scales.dtype == DType::fp32 ? ScaleFormat::float32 : ScaleFormat::ue8m0;
    s.scale_cols = s.scale_format == ScaleFormat::float32 ? groups : (groups + 3) / 4;
    // Row-major (any row stride) or column-major (any column stride: DeepGEMM's TMA-aligned layout), as DeepEP reads
    // x_scales by its two strides; the received scales are row-major either way (semantics §4).
    quant_detail::check_scales(a.x_scales, "x_scales", a.x_scales.dtype, s.T, s.scale_cols, std::nullopt);
    check_device(a.x_scales, "x_scales", device);
  } else {
    EPMOE_CHECK_ARG(!a.x_scales.defined(), "x_scales", "None with bfloat16 x", describe(a.x_scales));
  }

  s.cached = a.handle != nullptr;
  s.has_topk = a.topk_idx.defined();
  s.has_weights = a.topk_weights.defined();
  if (s.cached) {
    const NormalHandle* h = a.handle;
    EPMOE_CHECK_ARG(h->defined(), "handle", "the handle of a dispatch of this buffer", "an empty handle");
    EPMOE_CHECK_ARG(h->buffer_id == buffer_id, "handle", fmt::format("a handle of this buffer (id {})", buffer_id),
                    fmt::format("a handle of buffer {}", h->buffer_id));
    EPMOE_CHECK_ARG(h->num_tokens == s.T, "x", fmt::format("{} rows, as in the handle's dispatch", h->num_tokens), s.T);
  }
  // A fresh dispatch without topk_idx moves rows by the layout tensors alone (DeepEP's layout-only dispatch): no
  // recv_topk_idx / recv_topk_weights, the expert counts from num_tokens_per_expert.
  if (s.has_topk) {
    const TensorView& t = a.topk_idx;
    check_topk_idx_dtype(t);
    EPMOE_CHECK_ARG(t.ndim() == 2 && t.size(0) == s.T, "topk_idx", fmt::format("a [{}, K] tensor", s.T), describe(t));
    EPMOE_CHECK_ARG(t.size(1) >= 1 && t.size(1) <= kNormalMaxTopk, "topk_idx",
                    fmt::format("K (dimension 1) in 1..{} in normal mode", kNormalMaxTopk), t.size(1));
    check_tensor_on(t, "topk_idx", device);
    s.K = static_cast<int>(t.size(1));
  }
  if (s.has_weights) {
    EPMOE_CHECK_ARG(s.has_topk, "topk_weights", "None when topk_idx is not given", describe(a.topk_weights));
    check_tensor(a.topk_weights, "topk_weights", DType::fp32, Shape{s.T, s.K}, device);
  }

  if (s.cached) {
    s.E = a.handle->num_experts;
    s.alignment = a.handle->expert_alignment;
    s.worst = a.handle->num_worst_tokens;
    EPMOE_CHECK_ARG(a.expert_alignment == 1 || a.expert_alignment == s.alignment, "expert_alignment",
                    fmt::format("1 or the handle's {} (a cached dispatch keeps the handle's counts)", s.alignment),
                    a.expert_alignment);
    EPMOE_CHECK_ARG(a.num_worst_tokens == 0 || a.num_worst_tokens == s.worst, "num_worst_tokens",
                    fmt::format("0 or the handle's {} (a cached dispatch keeps the handle's rows)", s.worst),
                    a.num_worst_tokens);
  } else {
    EPMOE_CHECK_ARG(a.num_tokens_per_expert.defined(), "num_tokens_per_expert", "int32[E] from get_dispatch_layout",
                    "None");
    s.E = static_cast<int>(a.num_tokens_per_expert.ndim() == 1 ? a.num_tokens_per_expert.size(0) : 0);
    check_tensor(a.num_tokens_per_expert, "num_tokens_per_expert", DType::int32, Shape{s.E}, device);
    EPMOE_CHECK_ARG(s.E >= R && s.E % R == 0, "num_tokens_per_expert",
                    fmt::format("E (its length) a positive multiple of the {} ranks", R), s.E);
    EPMOE_CHECK_ARG(s.E / R <= kNormalMaxLocalExperts, "num_tokens_per_expert",
                    fmt::format("at most {} experts per rank ({} ranks)", kNormalMaxLocalExperts, R), s.E);
    check_tensor(a.num_tokens_per_rank, "num_tokens_per_rank", DType::int32, Shape{R}, device);
    check_tensor(a.is_token_in_rank, "is_token_in_rank", DType::boolean, Shape{s.T, R}, device);
    EPMOE_CHECK_ARG(a.expert_alignment >= 1, "expert_alignment", ">= 1", a.expert_alignment);
    EPMOE_CHECK_ARG(a.num_worst_tokens >= 0, "num_worst_tokens", ">= 0", a.num_worst_tokens);
    s.alignment = a.expert_alignment;
    s.worst = a.num_worst_tokens;
  }
  return s;
}

void check_normal_handle(const NormalHandle* h, std::uint64_t buffer_id, int R) {
  EPMOE_CHECK_ARG(h != nullptr && h->defined(), "handle", "the handle of a dispatch of this buffer", "an empty handle");
  EPMOE_CHECK_ARG(h->buffer_id == buffer_id, "handle", fmt::format("a handle of this buffer (id {})", buffer_id),
                  fmt::format("a handle of buffer {}", h->buffer_id));
  // A handle is made by dispatch; these only guard against one edited by hand.
  EPMOE_CHECK_ARG(h->rank_prefix_matrix.dtype() == DType::int32 && h->rank_prefix_matrix.shape() == Shape({R, R}),
                  "handle.rank_prefix_matrix", fmt::format("int32[{}, {}]", R, R), describe(h->rank_prefix_matrix));
  EPMOE_CHECK_ARG(h->send_pos.dtype() == DType::int32 && h->send_pos.shape() == Shape({h->num_tokens, R}),
                  "handle.send_pos", fmt::format("int32[{}, {}]", h->num_tokens, R), describe(h->send_pos));
  EPMOE_CHECK_ARG(h->is_token_in_rank.dtype() == DType::boolean &&
                      h->is_token_in_rank.shape() == Shape({h->num_tokens, R}),
                  "handle.is_token_in_rank", fmt::format("bool[{}, {}]", h->num_tokens, R),
                  describe(h->is_token_in_rank));
}

CombineSpec check_combine_args(const CombineArgs& a, int num_ranks, std::uint64_t buffer_id, Device device) {
  check_normal_handle(a.handle, buffer_id, num_ranks);
  const NormalHandle& h = *a.handle;
  const TensorView& x = a.x;
  EPMOE_CHECK_ARG(x.defined(), "x", fmt::format("a bfloat16 [{}, H] tensor", h.num_recv_rows), "None");
  if (x.dtype != DType::bf16) throw_wrong_dtype("x", "bfloat16", describe(x));
  EPMOE_CHECK_ARG(x.ndim() == 2 && x.size(0) == h.num_recv_rows, "x",
                  fmt::format("[{}, H]: one row per row of the dispatch's recv_x", h.num_recv_rows), describe(x));
  CombineSpec s;
  s.T = h.num_tokens;
  s.H = x.size(1);
  EPMOE_CHECK_ARG(s.H > 0 && s.H % 8 == 0, "x", "hidden size (dimension 1) a positive multiple of 8", s.H);
  check_tensor_on(x, "x", device);
  if (a.topk_weights.defined()) {
    const TensorView& w = a.topk_weights;
    EPMOE_CHECK_ARG(w.dtype == DType::fp32 && w.ndim() == 2 && w.size(0) == h.num_recv_rows, "topk_weights",
                    fmt::format("float32[{}, K]", h.num_recv_rows), describe(w));
    EPMOE_CHECK_ARG(w.size(1) >= 1 && w.size(1) <= kNormalMaxTopk, "topk_weights",
                    fmt::format("K (dimension 1) in 1..{}", kNormalMaxTopk), w.size(1));
    check_tensor_on(w, "topk_weights", device);
    s.K = static_cast<int>(w.size(1));
  }
  if (a.bias_0.defined()) check_tensor(a.bias_0, "bias_0", DType::bf16, Shape{s.T, s.H}, device);
  if (a.bias_1.defined()) check_tensor(a.bias_1, "bias_1", DType::bf16, Shape{s.T, s.H}, device);
  return s;
}

}  // namespace epmoe
