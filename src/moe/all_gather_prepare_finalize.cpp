// The all-gather + reduce-scatter prepare/finalize (moe.hpp, semantics §8): vLLM's naive / allgather_reducescatter
// all2all backend, the baseline expert parallelism needs nothing but a Group for.
//
// dispatch_a: one all-gather of every rank's token count and settings, then all-gathers of the rows (bfloat16, or fp8
// data and scales), topk_idx (as int64) and topk_weights, each rank's part padded to T_max rows. The experts of this
// rank see all R * T_max rows with the ids of other ranks' experts (and the padding's) as -1.
// combine_a: the contiguous weight-and-reduce of every row (bfloat16 [M, H], the same partial a normal-mode rank sends
// back), widened to float32 and reduce-scattered (Group::reduce_scatter_sum, rank order): one bfloat16 rounding of a
// sum normal mode's combine forms in the same order, so the two agree bit for bit.
//
// A reduce-scatter in Group rather than here over all_gather: over all_gather every rank would receive R times the
// bytes it needs (R * R * T_max * H floats), which at R = 8 and T = 4096, H = 7168 is 7.5 GB per rank; a Group
// collective lets each backend move only its block (MPI: one all-to-all; threads: reads in place) while the default
// keeps Python-implemented groups working.
//
// CUDA tensors are the host-staged baseline: with R > 1 the token side goes to the host on the current stream (then
// synchronised), the host steps run there, and the experts' input goes back; the combine stages its reduced rows the
// same way. At R == 1 nothing leaves the device and nothing is copied that need not be.
#include <epmoe/quant.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "core/check.hpp"
#include "core/cuda_util.hpp"
#include "moe/prepare_common.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include "moe/cuda.hpp"
#include "moe/weight_and_reduce.hpp"
#endif

namespace epmoe {
namespace {

constexpr std::string_view kDispatchPhase = "all_gather dispatch";
constexpr std::string_view kCombinePhase = "reduce_scatter combine";

std::int64_t id_at(const TensorView& topk_idx, std::int64_t i) {
  return topk_idx.dtype == DType::int64 ? topk_idx.ptr<std::int64_t>()[i] : topk_idx.ptr<std::int32_t>()[i];
}

/// What every rank tells the others before the bulk gathers: its token count and the settings that must agree.
struct RankInfo {
  std::int64_t T, H, K, E, fp8, round_scale, use_ue8m0, weight_on_input;
};

#if defined(EPMOE_HAVE_CUDA)
void copy_async(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, Stream s) {
  if (bytes) EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, cuda_util::to_cuda(s)));
}
Tensor to_host(const TensorView& v, Stream s) {
  Tensor t = Tensor::empty(v.dtype, v.shape);
  copy_async(t.data(), v.data, t.nbytes(), cudaMemcpyDeviceToHost, s);
  return t;
}
Tensor to_device(const TensorView& v, const Device& d, Stream s) {
  Tensor t = Tensor::empty(v.dtype, v.shape, d);
  copy_async(t.data(), v.data, t.nbytes(), cudaMemcpyHostToDevice, s);
  return t;
}
#endif

class AllGatherPrepareFinalize final : public PrepareFinalize {
 public:
  AllGatherPrepareFinalize(std::shared_ptr<Group> group, PrepareFinalizeOptions o)
      : group_(std::move(group)), options_(o), workspaces_(std::make_shared<WorkspaceCache>()) {}
  std::string_view name() const override { return "all_gather"; }
  ActivationFormat activation_format() const override { return ActivationFormat::standard; }
  WeightAndReduce delegate_weight_and_reduce() const override { return WeightAndReduce::contiguous; }
  int num_local_experts(int global_num_experts) const override { return global_num_experts / group_->size(); }
  int ep_rank() const override { return group_->rank(); }

 protected:
  void do_dispatch_a(const PrepareInputs& in) override {
    out_ = {};
    host_out_ = {};
    output_ = {};
    device_ = in.hidden.device;
    on_gpu_ = device_.is_cuda();
    TokenSide side;
    if (on_gpu_)
      check_cuda_prepare_inputs(in);
    else
      side = prepare_token_side(in);
    const int R = group_->size();
    T_ = in.hidden.size(0);
    H_ = in.hidden.size(1);
    K_ = in.topk_idx.size(1);
    E_ = in.global_num_experts;
    weight_on_input_ = in.apply_router_weight_on_input;
    EPMOE_CHECK_ARG(E_ % R == 0, "global_num_experts", fmt::format("a multiple of the number of ranks ({})", R), E_);
    EPMOE_CHECK_ARG(options_.dispatch_dtype != DispatchDtype::fp8 || H_ % 16 == 0, "hidden",
                    "[T, H] with H % 16 == 0 for an fp8 dispatch", describe(in.hidden));
    if (on_gpu_) {
      gpu_dispatch(in);
      return;
    }
    out_ = host_dispatch(side);
  }

  PrepareOutput do_dispatch_b() override { return out_; }

  void do_combine_a(const TensorView& fused, WeightAndReduce w) override {
    if (w == WeightAndReduce::delegate) w = delegate_weight_and_reduce();
    const std::int64_t M = out_.topk_idx.size(0);
    EPMOE_CHECK_ARG(w == WeightAndReduce::none || w == WeightAndReduce::contiguous, "weight_and_reduce",
                    "none or contiguous for the standard format", weight_and_reduce_name(w));
    const Shape want = w == WeightAndReduce::none ? Shape{M, H_} : Shape{M, K_, H_};
    EPMOE_CHECK_ARG(fused.dtype == DType::bf16 && fused.shape == want && fused.is_contiguous() &&
                        fused.device == device_ && (!on_gpu_ || fused.numel() == 0 || cuda_util::aligned16(fused.data)),
                    "fused_expert_output",
                    fmt::format("contiguous bfloat16 {} on {} (weight_and_reduce {}{})", to_string(want),
                                to_string(device_), weight_and_reduce_name(w), on_gpu_ ? ", 16-byte aligned" : ""),
                    describe(fused));
    if (on_gpu_) {
      result_ = gpu_combine(fused, w);
      return;
    }
    if (group_->size() == 1) {
      result_ = reduce_standard(fused, w, out_.topk_weights, out_.topk_idx);
      return;
    }
    // Reduced rows are widened straight from the experts' output: no bf16 copy of it first.
    Tensor reduced;
    if (w == WeightAndReduce::contiguous) reduced = reduce_standard(fused, w, out_.topk_weights, out_.topk_idx);
    result_ = reduce_scatter_rows(reduced.defined() ? reduced.view() : fused);
  }

  Tensor do_combine_b() override {
    out_ = {};
    host_out_ = {};
    output_ = {};
    return std::move(result_);
  }

 private:
  // The host steps of a dispatch: `side` on the CPU; returns the experts' input on the CPU.
  PrepareOutput host_dispatch(const TokenSide& side) {
    const int R = group_->size(), me = group_->rank();
    const std::int64_t E_local = E_ / R, first = me * E_local;
    const bool fp8 = options_.dispatch_dtype == DispatchDtype::fp8;
    // Every id is checked before the first collective, so a bad one leaves the other ranks nothing half done.
    for (std::int64_t i = 0; i < T_ * K_; ++i) {
      const std::int64_t e = id_at(side.topk_idx, i);
      EPMOE_CHECK_ARG(e >= -1 && e < E_, "topk_idx", fmt::format("ids in [-1, {})", E_),
                      fmt::format("{} at [{}, {}]", e, i / K_, i % K_));
    }
    PrepareOutput out;
    out.format = ActivationFormat::standard;
    out.expert_num_tokens = Tensor::zeros(DType::int32, {E_local});
    auto* counts = out.expert_num_tokens.ptr<std::int32_t>();
    if (R == 1) {  // nothing to gather: the token side as it is (global ids are the local ones)
      out.hidden = fp8 ? fp8_round_trip(side.hidden, options_) : side.hidden;
      out.topk_idx = side.topk_idx;
      out.topk_weights = side.topk_weights;
      for (std::int64_t i = 0; i < T_ * K_; ++i)
        if (const std::int64_t e = id_at(side.topk_idx, i); e >= 0) ++counts[e];
      T_max_ = T_;
      return out;
    }
    agree_on_counts();
    const std::int64_t Tm = T_max_, M = R * Tm;
    // Rows past a rank's T are padding: zero rows, ids -1, weights 0.
    const auto padded = [&](const TensorView& v, DType dtype, std::int64_t cols) -> Tensor {
      if (T_ == Tm && v.dtype == dtype) return Tensor::wrap(v, nullptr);
      Tensor t = Tensor::zeros(dtype, {Tm, cols});
      if (v.nbytes()) std::memcpy(t.data(), v.data, v.nbytes());
      return t;
    };
    const auto gather = [&](const Tensor& mine, DType dtype, std::int64_t cols) {
      Tensor all = Tensor::empty(dtype, {M, cols});
      group_->all_gather(mine.data(), all.data(), mine.nbytes(), kDispatchPhase);
      return all;
    };
    if (!fp8) {
      out.hidden = gather(padded(side.hidden, DType::bf16, H_), DType::bf16, H_);
    } else {
      const Fp8Tensor q = quantize_fp8(side.hidden, {options_.round_scale, options_.use_ue8m0});
      const std::int64_t S = q.scales.size(1);
      const Tensor data = gather(padded(q.data, DType::fp8_e4m3, H_), DType::fp8_e4m3, H_);
      const Tensor scales = gather(padded(q.scales, q.scales.dtype(), S), q.scales.dtype(), S);
      out.hidden = dequantize_fp8(data, scales, DType::bf16);
    }
    Tensor ids = Tensor::empty(DType::int64, {Tm, K_});
    for (std::int64_t i = 0; i < Tm * K_; ++i) ids.ptr<std::int64_t>()[i] = i < T_ * K_ ? id_at(side.topk_idx, i) : -1;
    out.topk_idx = gather(ids, DType::int64, K_);
    out.topk_weights = gather(padded(side.topk_weights, DType::fp32, K_), DType::fp32, K_);
    auto* local = out.topk_idx.ptr<std::int64_t>();
    for (std::int64_t i = 0; i < M * K_; ++i) {
      const std::int64_t e = local[i] - first;
      local[i] = e >= 0 && e < E_local ? e : -1;
      if (local[i] >= 0) ++counts[local[i]];
    }
    return out;
  }

  // One all-gather of every rank's T and settings; T_max_ is the largest T. A differing setting raises
  // rank_mismatch on every rank alike (every rank scans the same gathered table).
  void agree_on_counts() {
    const int R = group_->size();
    const RankInfo mine{T_,
                        H_,
                        K_,
                        E_,
                        options_.dispatch_dtype == DispatchDtype::fp8,
                        options_.round_scale,
                        options_.use_ue8m0,
                        weight_on_input_};
    std::vector<RankInfo> all(static_cast<std::size_t>(R));
    group_->all_gather(&mine, all.data(), sizeof(RankInfo), kDispatchPhase);
    T_max_ = 0;
    constexpr std::array<const char*, 7> names = {"hidden", "topk K", "global_num_experts", "dispatch_dtype fp8",
                                                  "round_scale", "use_ue8m0", "apply_router_weight_on_input"};
    for (int r = 0; r < R; ++r) {
      const RankInfo& a = all[0];
      const RankInfo& b = all[static_cast<std::size_t>(r)];
      const std::array<std::int64_t, 7> va = {a.H, a.K, a.E, a.fp8, a.round_scale, a.use_ue8m0, a.weight_on_input};
      const std::array<std::int64_t, 7> vb = {b.H, b.K, b.E, b.fp8, b.round_scale, b.use_ue8m0, b.weight_on_input};
      for (std::size_t i = 0; i < names.size(); ++i)
        if (va[i] != vb[i])
          raise(ErrorCode::rank_mismatch,
                "rank {}: setting '{}' must be equal on all ranks (phase '{}'): rank 0 has {}, rank {} has {}",
                group_->rank(), names[i], kDispatchPhase, va[i], r, vb[i]);
      T_max_ = std::max(T_max_, b.T);
    }
  }

  // bfloat16 [R * T_max, H] partials on the host -> this rank's bfloat16 [T, H]: widened to float32, summed over the
  // ranks in rank order by the Group, rounded once.
  Tensor reduce_scatter_rows(const TensorView& reduced) {
    const int R = group_->size();
    const std::size_t block = static_cast<std::size_t>(T_max_ * H_);
    std::vector<float> send(static_cast<std::size_t>(R) * block), recv(block);
    const auto* src = reduced.ptr<bf16_t>();
    for (std::size_t i = 0; i < send.size(); ++i) send[i] = bf16_to_float(src[i]);
    group_->reduce_scatter_sum(send.data(), recv.data(), block, kCombinePhase);
    Tensor out = Tensor::empty(DType::bf16, {T_, H_});
    auto* o = out.ptr<bf16_t>();
    for (std::int64_t i = 0; i < T_ * H_; ++i) o[i] = float_to_bf16(recv[static_cast<std::size_t>(i)]);
    return out;
  }

  void gpu_dispatch(const PrepareInputs& in) {
#if defined(EPMOE_HAVE_CUDA)
    cuda_util::DeviceGuard guard(device_);
    const Stream s = current_stream();
    const TokenSide side = cuda_token_side(in, *workspaces_, "all_gather");
    output_ = in.output;
    if (group_->size() == 1) {  // on the device, asynchronous, nothing copied
      PrepareOutput out;
      out.format = ActivationFormat::standard;
      out.hidden = side.hidden;
      if (options_.dispatch_dtype == DispatchDtype::fp8 && T_ > 0) {
        const Fp8Tensor q = quantize_fp8(side.hidden, {options_.round_scale, options_.use_ue8m0});
        out.hidden = dequantize_fp8(q.data, q.scales, DType::bf16);
      }
      out.topk_idx = side.topk_idx;
      out.topk_weights = side.topk_weights;
      out.expert_num_tokens = Tensor::empty(DType::int32, {E_}, device_);
      moe_cuda::count_ids(side.topk_idx, static_cast<int>(E_), out.expert_num_tokens.ptr<std::int32_t>(), s);
      T_max_ = T_;
      out_ = out;
      return;
    }
    // Host-staged: the token side to the host, the host steps, the experts' input back to the device.
    TokenSide host{to_host(side.hidden, s), to_host(side.topk_idx, s), to_host(side.topk_weights, s)};
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(cuda_util::to_cuda(s)));
    host_out_ = host_dispatch(host);
    out_.format = ActivationFormat::standard;
    out_.hidden = to_device(host_out_.hidden, device_, s);
    out_.topk_idx = to_device(host_out_.topk_idx, device_, s);
    out_.topk_weights = to_device(host_out_.topk_weights, device_, s);
    out_.expert_num_tokens = to_device(host_out_.expert_num_tokens, device_, s);
#else
    raise(ErrorCode::unsupported, "argument 'hidden' is on {} but epmoe was built without CUDA",
          to_string(in.hidden.device));
#endif
  }

  Tensor gpu_combine(const TensorView& fused, WeightAndReduce w) {
#if defined(EPMOE_HAVE_CUDA)
    cuda_util::DeviceGuard guard(device_);
    const Stream s = current_stream();
    const std::int64_t M = out_.topk_idx.size(0);
    const bool direct = group_->size() == 1 && output_.defined();  // R == 1: reduce straight into the output
    Tensor reduced = direct ? Tensor::wrap(output_, nullptr) : Tensor::empty(DType::bf16, {M, H_}, device_);
    if (w == WeightAndReduce::contiguous)
      weight_and_reduce_contiguous_cuda(fused, out_.topk_weights, out_.topk_idx, reduced, s);
    else
      moe_cuda::copy(reduced.data(), fused.data, reduced.nbytes(), s);
    if (group_->size() == 1) return reduced;
    const Tensor host = to_host(reduced, s);
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(cuda_util::to_cuda(s)));
    const Tensor result = reduce_scatter_rows(host);
    Tensor out = output_.defined() ? Tensor::wrap(output_, nullptr) : Tensor::empty(DType::bf16, {T_, H_}, device_);
    copy_async(out.data(), result.data(), result.nbytes(), cudaMemcpyHostToDevice, s);
    // `result` is freed on return: wait for the copy rather than rely on how CUDA stages a pageable source.
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(cuda_util::to_cuda(s)));
    return out;
#else
    raise(ErrorCode::unsupported, "all_gather combine on {}: epmoe was built without CUDA", to_string(device_));
#endif
  }

  std::shared_ptr<Group> group_;
  PrepareFinalizeOptions options_;
  std::shared_ptr<WorkspaceCache> workspaces_;  // GPU: the scaled tokens (router weight on the input)
  bool on_gpu_ = false;
  Device device_;
  std::int64_t T_ = 0, H_ = 0, K_ = 0, E_ = 0, T_max_ = 0;
  std::int64_t weight_on_input_ = 0;
  TensorView output_;      // GPU calls: the caller's output, if any
  PrepareOutput out_;      // the experts' input (on hidden's device)
  PrepareOutput host_out_; // GPU calls with R > 1: its host copy, kept until the combine
  Tensor result_;
};

}  // namespace

std::shared_ptr<PrepareFinalize> make_all_gather_prepare_finalize(std::shared_ptr<Group> group,
                                                                  const PrepareFinalizeOptions& options) {
  EPMOE_CHECK_ARG(group != nullptr, "group", "a Group", "null");
  refuse_nvfp4(options, "all_gather");
  EPMOE_CHECK_ARG(!options.use_ue8m0 || options.round_scale, "use_ue8m0", "only with round_scale", "without it");
  return std::make_shared<AllGatherPrepareFinalize>(std::move(group), options);
}

}  // namespace epmoe
