// The no-EP prepare/finalize on one GPU (no_ep_cuda.hpp) and semantics §11's MoE fault checks (moe.hpp, cuda::).
//
// Prepare, all on the current stream: optionally scale by the router weight (K == 1), optionally the fp8
// round trip of the wire (quantize, dequantize: the values the experts would see after an fp8 dispatch),
// then either Standard (the tokens as they are, per-expert counts) or BatchedExperts (a stable counting
// sort of the choices by expert -- make_permute_layout's kernels -- and one scatter into [E, max_tokens, H]
// slabs, counts on the device). Finalize is the CUDA TopKWeightAndReduce. No step reads device memory on
// the host or allocates once the workspaces exist, so the batched sequence can be captured in a CUDA graph.
#include "moe/no_ep_cuda.hpp"

#include "core/check.hpp"
#include "moe/prepare_common.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include <epmoe/permute.hpp>
#include <epmoe/quant.hpp>

#include <limits>

#include "core/cuda_util.hpp"
#include "layout/layout.hpp"
#include "moe/cuda.hpp"
#include "moe/weight_and_reduce.hpp"
#include "quant/quant.hpp"
#endif

namespace epmoe {

namespace moe_cuda {

#if defined(EPMOE_HAVE_CUDA)

namespace {

void check_on(const TensorView& t, std::string_view name, const Device& device, std::string_view what) {
  EPMOE_CHECK_ARG(t.device == device && t.is_contiguous(), name,
                  fmt::format("contiguous {} on {} (hidden's device)", what, to_string(device)), describe(t));
}

}  // namespace

NoEpCuda::NoEpCuda(const PrepareFinalizeOptions& options, const NoEpOptions& no_ep) : options_(options), no_ep_(no_ep) {
  if (!no_ep_.workspaces) no_ep_.workspaces = std::make_shared<WorkspaceCache>();
}

TensorView NoEpCuda::ws(std::string_view name, DType dtype, Shape shape) {
  return no_ep_.workspaces->get(no_ep_.micro_batch, fmt::format("no_ep.{}", name), dtype, shape, device_);
}

PrepareOutput NoEpCuda::dispatch(const PrepareInputs& in) {
  const TensorView& x = in.hidden;
  device_ = x.device;
  EPMOE_CHECK_ARG(x.dtype == DType::bf16 && x.ndim() == 2 && x.is_contiguous() && x.size(1) >= 8 &&
                      x.size(1) % 8 == 0 && (x.numel() == 0 || cuda_util::aligned16(x.data)),
                  "hidden", "contiguous bfloat16 [T, H] with H % 8 == 0 and 16-byte-aligned data on CUDA", describe(x));
  T_ = x.size(0);
  H_ = x.size(1);
  check_topk_idx_dtype(in.topk_idx);
  EPMOE_CHECK_ARG(in.topk_idx.ndim() == 2 && in.topk_idx.size(0) == T_ && in.topk_idx.size(1) >= 1 &&
                      in.topk_idx.size(1) <= 512,
                  "topk_idx", fmt::format("[{}, K] with 1 <= K <= 512 on CUDA", T_), describe(in.topk_idx));
  check_on(in.topk_idx, "topk_idx", device_, "int64/int32");
  K_ = in.topk_idx.size(1);
  EPMOE_CHECK_ARG(in.topk_weights.dtype == DType::fp32 && in.topk_weights.shape == in.topk_idx.shape, "topk_weights",
                  fmt::format("float32 {}", to_string(in.topk_idx.shape)), describe(in.topk_weights));
  check_on(in.topk_weights, "topk_weights", device_, "float32");
  const bool batched = no_ep_.format == ActivationFormat::batched_experts;
  EPMOE_CHECK_ARG(in.global_num_experts > 0 && (!batched || in.global_num_experts <= 1024), "global_num_experts",
                  batched ? "1..1024 (semantics §1) for the batched_experts format" : "> 0", in.global_num_experts);
  E_ = in.global_num_experts;
  EPMOE_CHECK_ARG(!in.apply_router_weight_on_input || K_ == 1, "apply_router_weight_on_input", "only with K == 1",
                  fmt::format("K = {}", K_));
  if (in.output.defined()) {
    check_on(in.output, "output", device_, "bfloat16 [T, H]");
    EPMOE_CHECK_ARG(in.output.dtype == DType::bf16 && in.output.shape == (Shape{T_, H_}) &&
                        (in.output.numel() == 0 || cuda_util::aligned16(in.output.data)),
                    "output", fmt::format("bfloat16 [{}, {}], 16-byte aligned", T_, H_), describe(in.output));
  }
  EPMOE_CHECK_ARG(T_ * K_ <= std::numeric_limits<std::int32_t>::max(), "topk_idx", "T * K < 2^31 on CUDA",
                  describe(in.topk_idx));
  max_tokens_ = no_ep_.max_tokens_per_expert > 0 ? no_ep_.max_tokens_per_expert : T_;
  EPMOE_CHECK_ARG(!batched || E_ * max_tokens_ <= std::numeric_limits<std::int32_t>::max(), "max_tokens_per_expert",
                  fmt::format("E * max_tokens < 2^31 (E = {})", E_), max_tokens_);

  cuda_util::DeviceGuard guard(device_);
  const Stream s = current_stream();
  topk_idx_ = in.topk_idx;
  topk_weights_ = in.topk_weights;
  output_ = in.output;
  TensorView hidden = x;
  if (in.apply_router_weight_on_input) {
    // As on the CPU: x * w rounded to bf16, and weights of 1 so nothing weights the token again.
    const TensorView scaled = ws("scaled", DType::bf16, {T_, H_});
    const TensorView ones = ws("ones", DType::fp32, {T_, 1});
    weight_on_input_cuda(x, in.topk_weights, scaled, ones, s);
    hidden = scaled;
    topk_weights_ = ones;
  }
  if (options_.dispatch_dtype == DispatchDtype::fp8) {
    const Fp8Options fo{options_.round_scale, options_.use_ue8m0};
    const TensorView q = ws("fp8", DType::fp8_e4m3, {T_, H_});
    const TensorView scales = fo.use_ue8m0 ? ws("fp8_scales", DType::int32, {T_, num_ue8m0_words(H_)})
                                           : ws("fp8_scales", DType::fp32, {T_, num_scale_groups(H_)});
    const TensorView deq = ws("dequantized", DType::bf16, {T_, H_});
    if (T_ > 0) {
      quantize_fp8_into(hidden, q, scales, fo, s);
      quant_detail::dequantize_fp8_cuda(q, scales, deq, s);
    }
    hidden = deq;
  }

  PrepareOutput out;
  out.format = no_ep_.format;
  const TensorView counts = ws("counts", DType::int32, {E_});
  out.expert_num_tokens = Tensor::wrap(counts, nullptr);
  if (!batched) {
    count_ids(topk_idx_, E_, counts.ptr<std::int32_t>(), s);
    out.hidden = Tensor::wrap(hidden, nullptr);
    out.topk_idx = Tensor::wrap(topk_idx_, nullptr);
    out.topk_weights = Tensor::wrap(topk_weights_, nullptr);
    return out;
  }
  // BatchedExperts: slot i of expert e = the i-th choice of e in (token, k) order, the order of
  // weight_and_reduce_naive_batched and of the permute layout's stable sort.
  const std::int64_t n = T_ * K_;
  layout_detail::PermuteLayoutBuffers b{};
  b.seg_indptr = ws("seg_indptr", DType::int64, {E_ + 1}).ptr<std::int64_t>();
  b.num_tokens_per_expert = ws("per_expert", DType::int32, {E_}).ptr<std::int32_t>();
  b.src2dst = ws("src2dst", DType::int32, {n}).ptr<std::int32_t>();
  b.dst2src = ws("dst2src", DType::int32, {n}).ptr<std::int32_t>();
  b.reorder_topk_ids = ws("reorder", DType::int32, {n}).ptr<std::int32_t>();
  const auto layout_bytes = static_cast<std::int64_t>(layout_detail::permute_layout_workspace_bytes(n, E_));
  b.workspace = ws("layout_ws", DType::int32, {(layout_bytes + 3) / 4}).data;
  layout_detail::make_permute_layout_cuda(topk_idx_, E_, 1, n, b, s);
  const TensorView slabs = ws("slabs", DType::bf16, {E_, max_tokens_, H_});
  slot_of_ = ws("slot_of", DType::int32, {T_, K_});
  scatter_to_slabs(hidden, topk_idx_, b.src2dst, b.seg_indptr, b.reorder_topk_ids, b.num_tokens_per_expert, E_,
                   max_tokens_, slabs.data, slot_of_.ptr<std::int32_t>(), counts.ptr<std::int32_t>(), s);
  out.hidden = Tensor::wrap(slabs, nullptr);
  return out;
}

Tensor NoEpCuda::combine(const TensorView& fused, WeightAndReduce w) {
  const bool batched = no_ep_.format == ActivationFormat::batched_experts;
  EPMOE_CHECK_ARG(fused.dtype == DType::bf16 && fused.device == device_ && fused.is_contiguous() &&
                      (fused.numel() == 0 || cuda_util::aligned16(fused.data)),
                  "fused_expert_output", fmt::format("contiguous bfloat16 on {}, 16-byte aligned", to_string(device_)),
                  describe(fused));
  cuda_util::DeviceGuard guard(device_);
  const Stream s = current_stream();
  Tensor out;
  if (output_.defined()) {
    out = Tensor::wrap(output_, nullptr);
  } else {
    if (cuda_util::capturing(cuda_util::to_cuda(s)))
      raise(ErrorCode::unsupported, "no_ep combine on {}: the stream is being captured in a CUDA graph and no output "
            "buffer was given (PrepareInputs::output / MoEForwardArgs::output): allocating one would not be replayable",
            to_string(device_));
    out = Tensor::empty(DType::bf16, {T_, H_}, device_);
  }
  switch (w) {
    case WeightAndReduce::none:
      EPMOE_CHECK_ARG(!batched, "weight_and_reduce", "naive_batched for the batched_experts format", "none");
      EPMOE_CHECK_ARG(fused.shape == (Shape{T_, H_}), "fused_expert_output", fmt::format("bfloat16 [{}, {}]", T_, H_),
                      describe(fused));
      if (fused.data != out.data()) copy(out.data(), fused.data, out.nbytes(), s);
      return out;
    case WeightAndReduce::contiguous:
      EPMOE_CHECK_ARG(!batched, "weight_and_reduce", "naive_batched for the batched_experts format", "contiguous");
      EPMOE_CHECK_ARG(fused.shape == (Shape{T_, K_, H_}), "fused_expert_output",
                      fmt::format("bfloat16 [{}, {}, {}]", T_, K_, H_), describe(fused));
      weight_and_reduce_contiguous_cuda(fused, topk_weights_, topk_idx_, out, s);
      return out;
    case WeightAndReduce::naive_batched:
      EPMOE_CHECK_ARG(batched, "weight_and_reduce", "none or contiguous for the standard format", "naive_batched");
      EPMOE_CHECK_ARG(fused.shape == (Shape{E_, max_tokens_, H_}), "fused_expert_output",
                      fmt::format("bfloat16 [{}, {}, {}]", E_, max_tokens_, H_), describe(fused));
      weight_and_reduce_naive_batched_cuda(fused, topk_weights_, slot_of_, out, s);
      return out;
    case WeightAndReduce::delegate: break;
  }
  raise(ErrorCode::internal, "no_ep combine: weight_and_reduce '{}' was not resolved", weight_and_reduce_name(w));
}

#else  // !EPMOE_HAVE_CUDA

NoEpCuda::NoEpCuda(const PrepareFinalizeOptions& options, const NoEpOptions& no_ep)
    : options_(options), no_ep_(no_ep) {}
PrepareOutput NoEpCuda::dispatch(const PrepareInputs& in) {
  raise(ErrorCode::unsupported, "argument 'hidden' is on {} but epmoe was built without CUDA",
        to_string(in.hidden.device));
}
Tensor NoEpCuda::combine(const TensorView&, WeightAndReduce) {
  raise(ErrorCode::unsupported, "no_ep combine on CUDA: epmoe was built without CUDA");
}
TensorView NoEpCuda::ws(std::string_view, DType, Shape) { return {}; }

#endif

}  // namespace moe_cuda

namespace cuda {

#if defined(EPMOE_HAVE_CUDA)

MoEFaults peek_moe_faults() {
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  MoEFaults f;
  volatile moe_cuda::FaultRecord* r = moe_cuda::fault_record_host(device);
  if (r == nullptr) return f;
  f.overflow = r->overflow != 0u;
  if (f.overflow) {
    f.overflow_expert = r->overflow_expert;
    f.overflow_count = r->overflow_count;
    f.overflow_limit = r->overflow_limit;
  }
  f.invalid_id = r->invalid_id != 0u;
  return f;
}

void check_moe_faults(Stream stream) {
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  volatile moe_cuda::FaultRecord* r = moe_cuda::fault_record_host(device);
  if (r == nullptr) return;
  const MoEFaults f = peek_moe_faults();
  if (!f.invalid_id && !f.overflow) return;  // nothing flagged: no synchronisation
  if (f.invalid_id) {
    r->invalid_id = 0u;  // an overflow, if any, stays for the next check
    // The detail (first [t, k] and value) is in the device word of the id checks.
    check_invalid_ids(stream);
    raise(ErrorCode::invalid_argument, "invalid argument 'topk_idx': an expert id outside [-1, E) was skipped on {} "
          "(its position was already reported by cuda::check_invalid_ids)", to_string(Device::cuda(device)));
  }
  r->overflow = 0u;
  raise(ErrorCode::out_of_memory, "no_ep batched_experts prepare on {}: expert {} received {} choices but its slab "
        "has max_tokens_per_expert = {} rows; the choices past it were dropped: make max_tokens_per_expert >= {}",
        to_string(Device::cuda(device)), f.overflow_expert, f.overflow_count, f.overflow_limit, f.overflow_count);
}

#else

MoEFaults peek_moe_faults() { return {}; }
void check_moe_faults(Stream) {}

#endif

}  // namespace cuda

}  // namespace epmoe
