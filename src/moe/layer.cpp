// MoELayer: the composition of a prepare/finalize with experts, chunking and workspaces.
#include <epmoe/moe.hpp>

#include <future>

#include "core/check.hpp"

#if defined(EPMOE_HAVE_CUDA)
#include "moe/cuda_moe.hpp"
#endif

namespace epmoe {

TensorView WorkspaceCache::get(int micro_batch, std::string_view name, DType dtype, Shape shape) {
  Tensor& t = buffers_[{micro_batch, std::string(name)}];
  const std::size_t need = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  if (!t.defined() || t.nbytes() < need) t = Tensor::empty(DType::int8, {static_cast<std::int64_t>(need)});
  return TensorView(t.data(), dtype, shape);
}

TensorView WorkspaceCache::get(int micro_batch, std::string_view name, DType dtype, Shape shape, Device device) {
  if (device.is_cpu()) return get(micro_batch, name, dtype, shape);
  Tensor& t = buffers_[{micro_batch, fmt::format("{}@{}", name, to_string(device))}];
  const std::size_t need = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  if (!t.defined() || t.nbytes() < need) {
#if defined(EPMOE_HAVE_CUDA)
    if (moe_cuda::capturing(current_stream()))
      raise(ErrorCode::unsupported, "workspace '{}' of micro-batch {} on {} must grow to {} bytes (has {}) while the "
            "stream is being captured in a CUDA graph: run the same shapes once before capturing",
            name, micro_batch, to_string(device), need, t.defined() ? t.nbytes() : 0);
#endif
    // At least 16 bytes, so views of empty shapes still get an aligned, non-null pointer.
    t = Tensor::empty(DType::int8, {static_cast<std::int64_t>(std::max<std::size_t>(need, 16))}, device);
  }
  return TensorView(t.data(), dtype, shape, device);
}

std::size_t WorkspaceCache::bytes() const {
  std::size_t n = 0;
  for (const auto& [key, t] : buffers_) n += t.nbytes();
  return n;
}

MoELayer::MoELayer(std::shared_ptr<PrepareFinalize> prepare_finalize, std::shared_ptr<Experts> experts,
                   SharedExperts shared_experts, MoELayerOptions options)
    : prepare_finalize_(std::move(prepare_finalize)), experts_(std::move(experts)),
      shared_experts_(std::move(shared_experts)), options_(std::move(options)) {
  EPMOE_CHECK_ARG(prepare_finalize_ != nullptr, "prepare_finalize", "a PrepareFinalize", "null");
  EPMOE_CHECK_ARG(experts_ != nullptr, "experts", "an Experts", "null");
  EPMOE_CHECK_ARG(prepare_finalize_->activation_format() == experts_->activation_format(), "experts",
                  fmt::format("experts reading the '{}' format that prepare/finalize '{}' produces",
                              activation_format_name(prepare_finalize_->activation_format()), prepare_finalize_->name()),
                  fmt::format("experts '{}' reading the '{}' format", experts_->name(),
                              activation_format_name(experts_->activation_format())));
  EPMOE_CHECK_ARG(options_.chunk_size >= 0, "chunk_size", ">= 0", options_.chunk_size);
  if (!options_.workspaces) options_.workspaces = std::make_shared<WorkspaceCache>();
}

Tensor MoELayer::run_experts(const PrepareOutput& p, const MoEForwardArgs& args) {
  ExpertsInputs in;
  in.w1 = args.w1;
  in.w2 = args.w2;
  in.activation = args.activation;
  last_chunk_rows_.clear();
  const Device device = p.hidden.device();
  if (p.format == ActivationFormat::batched_experts) {
    in.hidden = p.hidden;
    in.expert_num_tokens = p.expert_num_tokens;
    if (device.is_cuda()) {
      // Rows past each count stay as they are: NaiveBatched never reads them.
      const TensorView ws = options_.workspaces->get(options_.micro_batch, "experts_out", DType::bf16,
                                                     p.hidden.shape(), device);
      experts_->apply(in, ws);
      last_chunk_rows_.push_back(p.hidden.size(0) * p.hidden.size(1));
      return Tensor::wrap(ws, nullptr);
    }
    Tensor out = Tensor::zeros(DType::bf16, p.hidden.shape());
    experts_->apply(in, out);
    last_chunk_rows_.push_back(p.hidden.size(0) * p.hidden.size(1));
    return out;
  }
  // Standard format, chunked over rows: each chunk writes its slice of one output; the chunk's
  // experts see only its rows (so its expert counts and workspace are its own).
  const std::int64_t M = p.hidden.size(0);
  in.hidden = p.hidden;
  in.topk_idx = p.topk_idx;
  in.topk_weights = p.topk_weights;
  const Shape full = experts_->output_shape(in);
  Tensor out = Tensor::empty(DType::bf16, full, device);
  const std::int64_t chunk = options_.chunk_size > 0 ? options_.chunk_size : std::max<std::int64_t>(M, 1);
  for (std::int64_t begin = 0; begin < M; begin += chunk) {
    const std::int64_t end = std::min(M, begin + chunk);
    ExpertsInputs c = in;
    c.hidden = p.hidden.view().slice_rows(begin, end);
    c.topk_idx = p.topk_idx.view().slice_rows(begin, end);
    c.topk_weights = p.topk_weights.view().slice_rows(begin, end);
    if (device.is_cuda()) {  // straight into the chunk's rows (no copy on the GPU)
      experts_->apply(c, out.view().slice_rows(begin, end));
      last_chunk_rows_.push_back(end - begin);
      continue;
    }
    // The chunk computes into a per-micro-batch workspace, then lands in its slice of the output.
    Shape ws_shape = experts_->output_shape(c);
    TensorView ws = options_.workspaces->get(options_.micro_batch, "experts_out", DType::bf16, ws_shape);
    experts_->apply(c, ws);
    std::memcpy(out.view().slice_rows(begin, end).data, ws.data, ws.nbytes());
    last_chunk_rows_.push_back(end - begin);
  }
  return out;
}

MoEForwardResult MoELayer::forward(const MoEForwardArgs& args) {
  EPMOE_CHECK_ARG(!args.expert_map.defined(), "expert_map",
                  "none (with expert parallelism the owner of each expert follows from the rank)", "a tensor");
  MoEForwardResult result;
  // Shared experts overlap dispatch, experts and combine on a side thread (the CPU's side stream).
  std::future<Tensor> shared;
  if (shared_experts_) shared = std::async(std::launch::async, shared_experts_, args.hidden);

  PrepareInputs in{args.hidden, args.topk_idx, args.topk_weights, args.global_num_experts,
                   args.apply_router_weight_on_input, args.output};
  try {
    prepare_finalize_->dispatch_a(in);
    const PrepareOutput prepared = prepare_finalize_->dispatch_b();
    const Tensor fused = run_experts(prepared, args);
    prepare_finalize_->combine_a(fused, experts_->weight_and_reduce());
    result.output = prepare_finalize_->combine_b();
    if (args.output.defined() && result.output.data() != args.output.data) {
      // Prepare/finalize that did not write into the caller's buffer (the CPU ones): copy the result there.
      EPMOE_CHECK_ARG(args.output.device.is_cpu() && args.output.is_contiguous() && args.output.dtype == DType::bf16 &&
                          args.output.shape == result.output.shape(),
                      "output", fmt::format("contiguous bfloat16 {} on cpu", to_string(result.output.shape())),
                      describe(args.output));
      if (result.output.nbytes()) std::memcpy(args.output.data, result.output.data(), result.output.nbytes());
      result.output = Tensor::wrap(args.output, nullptr);
    }
  } catch (...) {
    if (shared.valid()) shared.wait();
    throw;
  }
  if (shared.valid()) result.shared_output = shared.get();
  return result;
}

}  // namespace epmoe
