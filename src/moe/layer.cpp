// MoELayer: the composition of a prepare/finalize with experts, chunking and workspaces.
#include <epmoe/moe.hpp>
#include <epmoe/eplb.hpp>

#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <future>
#include <mutex>
#include <utility>
#include <vector>

#include "core/check.hpp"

#include "core/cuda_util.hpp"
#include "eplb/eplb.hpp"
#include "moe/layer_extensions.hpp"

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
    if (cuda_util::capturing(cuda_util::to_cuda(current_stream())))
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

std::string_view dispatch_mode_name(DispatchMode mode) {
  switch (mode) {
    case DispatchMode::normal: return "normal";
    case DispatchMode::low_latency: return "low_latency";
    case DispatchMode::automatic: return "auto";
  }
  return "?";
}

DispatchMode resolve_dispatch_mode(DispatchMode mode, bool is_extend_in_batch) {
  if (mode != DispatchMode::automatic) return mode;
  return is_extend_in_batch ? DispatchMode::normal : DispatchMode::low_latency;
}

/// The hooks of one layer, in registration order. Handles point at it weakly, so a handle may outlive the layer.
struct DispatchHookHandle::Registry {
  std::mutex mutex;
  std::uint64_t next_id = 1;
  std::vector<std::pair<std::uint64_t, DispatchHook>> hooks;
};

DispatchHookHandle::DispatchHookHandle(DispatchHookHandle&& other) noexcept
    : registry_(std::move(other.registry_)), id_(std::exchange(other.id_, 0)) {}

DispatchHookHandle& DispatchHookHandle::operator=(DispatchHookHandle&& other) noexcept {
  if (this != &other) {
    remove();
    registry_ = std::move(other.registry_);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

void DispatchHookHandle::remove() {
  if (id_ == 0) return;
  if (const auto r = registry_.lock()) {
    const std::lock_guard lock(r->mutex);
    std::erase_if(r->hooks, [&](const auto& h) { return h.first == id_; });
  }
  registry_.reset();
  id_ = 0;
}

bool DispatchHookHandle::active() const {
  if (id_ == 0) return false;
  const auto r = registry_.lock();
  if (!r) return false;
  const std::lock_guard lock(r->mutex);
  return std::any_of(r->hooks.begin(), r->hooks.end(), [&](const auto& h) { return h.first == id_; });
}

DispatchHookHandle MoELayer::register_dispatch_hook(DispatchHook hook) {
  EPMOE_CHECK_ARG(static_cast<bool>(hook), "hook", "a callable", "an empty function");
  const std::lock_guard lock(hooks_->mutex);
  const std::uint64_t id = hooks_->next_id++;
  hooks_->hooks.emplace_back(id, std::move(hook));
  return DispatchHookHandle(hooks_, id);
}

std::size_t MoELayer::num_dispatch_hooks() const {
  const std::lock_guard lock(hooks_->mutex);
  return hooks_->hooks.size();
}

MoELayer::MoELayer(std::shared_ptr<Buffer> buffer, DispatchMode mode, int num_max_dispatch_tokens_per_rank,
                   std::shared_ptr<Experts> normal_experts, std::shared_ptr<Experts> low_latency_experts,
                   const PrepareFinalizeOptions& prepare_options, SharedExperts shared_experts,
                   MoELayerOptions options)
    : shared_experts_(std::move(shared_experts)), options_(std::move(options)),
      hooks_(std::make_shared<DispatchHookHandle::Registry>()), mode_(mode), buffer_(std::move(buffer)),
      tmax_(num_max_dispatch_tokens_per_rank) {
  EPMOE_CHECK_ARG(buffer_ != nullptr, "buffer", "a Buffer", "null");
  EPMOE_CHECK_ARG(mode == DispatchMode::normal || mode == DispatchMode::low_latency ||
                      mode == DispatchMode::automatic,
                  "mode", "normal, low_latency or auto", static_cast<int>(mode));
  EPMOE_CHECK_ARG(options_.chunk_size >= 0, "chunk_size", ">= 0", options_.chunk_size);
  EPMOE_CHECK_ARG(options_.micro_batch >= 0, "micro_batch", ">= 0", options_.micro_batch);
  const bool uses_normal = mode != DispatchMode::low_latency, uses_ll = mode != DispatchMode::normal;
  const auto check_experts = [&](const std::shared_ptr<Experts>& e, std::string_view name, ActivationFormat f) {
    EPMOE_CHECK_ARG(e != nullptr, name, fmt::format("an Experts reading the '{}' format (mode {})",
                                                    activation_format_name(f), dispatch_mode_name(mode)), "null");
    EPMOE_CHECK_ARG(e->activation_format() == f, name,
                    fmt::format("experts reading the '{}' format", activation_format_name(f)),
                    fmt::format("experts '{}' reading the '{}' format", e->name(),
                                activation_format_name(e->activation_format())));
  };
  if (uses_normal) check_experts(normal_experts, "normal_experts", ActivationFormat::standard);
  if (uses_ll) {
    check_experts(low_latency_experts, "low_latency_experts", ActivationFormat::batched_experts);
    EPMOE_CHECK_ARG(tmax_ >= 1, "num_max_dispatch_tokens_per_rank", ">= 1", tmax_);
  }
  if (uses_normal) {
    pf_normal_ = make_normal_prepare_finalize(buffer_, prepare_options);
    experts_normal_ = std::move(normal_experts);
  }
  if (uses_ll) {
    pf_low_latency_ = make_low_latency_prepare_finalize(buffer_, tmax_, prepare_options);
    experts_low_latency_ = std::move(low_latency_experts);
  }
  last_mode_ = uses_normal ? DispatchMode::normal : DispatchMode::low_latency;
  prepare_finalize_ = uses_normal ? pf_normal_ : pf_low_latency_;
  experts_ = uses_normal ? experts_normal_ : experts_low_latency_;
  if (!options_.workspaces) options_.workspaces = std::make_shared<WorkspaceCache>();
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
  EPMOE_CHECK_ARG(options_.micro_batch >= 0, "micro_batch", ">= 0", options_.micro_batch);
  if (!options_.workspaces) options_.workspaces = std::make_shared<WorkspaceCache>();
  hooks_ = std::make_shared<DispatchHookHandle::Registry>();
  mode_ = last_mode_ = prepare_finalize_->name() == "low_latency" ? DispatchMode::low_latency : DispatchMode::normal;
}

// ---- Expert load recorder (semantics §9) ----
void MoELayer::set_load_recorder(std::shared_ptr<ExpertLoadRecorder> recorder, std::int64_t layer) {
  if (recorder)
    EPMOE_CHECK_ARG(layer >= 0 && layer < recorder->num_layers(), "layer",
                    fmt::format("in [0, {}) (the recorder's num_layers)", recorder->num_layers()), layer);
  load_recorder_ = std::move(recorder);
  load_recorder_layer_ = load_recorder_ ? layer : 0;
}

Tensor MoELayer::run_experts(const PrepareOutput& p, const MoEForwardArgs& args) {
  ExpertsInputs in;
  in.w1 = args.w1;
  in.w2 = args.w2;
  in.w1_scales = args.w1_scale;  // fp8 block-scaled weights only (check_weight_scales)
  in.w2_scales = args.w2_scale;
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

Tensor MoELayer::run_experts_and_combine_a(const PrepareOutput& p, const MoEForwardArgs& args) {
  Tensor fused;
  if (run_experts_overlapped(p, args, fused)) return fused;  // options.overlap: experts and combine_a together
  fused = run_experts(p, args);
  prepare_finalize_->combine_a(fused, experts_->weight_and_reduce());
  return fused;
}

void MoELayer::check_forward_args(const MoEForwardArgs& args) const {
  const auto known = [](Activation a) {
    switch (a) {
      case Activation::silu: case Activation::gelu: case Activation::swigluoai: case Activation::silu_no_mul:
      case Activation::gelu_no_mul: case Activation::relu2_no_mul: return true;
    }
    return false;
  };
  EPMOE_CHECK_ARG(known(args.activation), "activation",
                  "silu, gelu, swigluoai, silu_no_mul, gelu_no_mul or relu2_no_mul", static_cast<int>(args.activation));
  EPMOE_CHECK_ARG(args.hidden.defined() && args.hidden.ndim() == 2, "hidden", "bfloat16 [T, H]",
                  args.hidden.defined() ? describe(args.hidden) : std::string("None"));
  EPMOE_CHECK_ARG(args.global_num_experts > 0, "global_num_experts", "> 0", args.global_num_experts);
  const std::int64_t T = args.hidden.size(0), H = args.hidden.size(1);
  const std::int64_t e_local = prepare_finalize_->num_local_experts(args.global_num_experts);
  EPMOE_CHECK_ARG(e_local >= 1, "global_num_experts",
                  fmt::format("at least one expert per rank for prepare/finalize '{}'", prepare_finalize_->name()),
                  args.global_num_experts);
  // Message parts, formatted only when a check fails (forward is on the decode path).
  const auto e_local_from = [&] {
    return fmt::format("E_local = {} from global_num_experts = {} ('{}' prepare/finalize)", e_local,
                       args.global_num_experts, prepare_finalize_->name());
  };

  // The weights' device and dtype are what the experts read: the CUDA experts one GPU, the others the CPU.
  const bool cuda_experts = experts_->name() == "cuda";
  const bool bf16_weights = experts_->config().quant == ExpertsQuant::none;
  // hidden where the experts run: prepare would accept either device and run there, and the experts would
  // refuse its output only after the dispatch started (leaving the layer unusable).
  if (cuda_experts)
    EPMOE_CHECK_ARG(args.hidden.device.is_cuda(), "hidden",
                    fmt::format("a CUDA tensor (the '{}' experts run on a GPU)", experts_->name()),
                    describe(args.hidden));
  else
    EPMOE_CHECK_ARG(args.hidden.device.is_cpu(), "hidden",
                    fmt::format("a CPU tensor (the '{}' experts run on the CPU)", experts_->name()),
                    describe(args.hidden));
  const auto check_weight = [&](const TensorView& w, std::string_view name, std::string_view layout) {
    EPMOE_CHECK_ARG(w.defined(), name, fmt::format("a bfloat16 {} tensor", layout), "None");
    if (bf16_weights) EPMOE_CHECK_ARG(w.dtype == DType::bf16, name, fmt::format("bfloat16 {}", layout), describe(w));
    if (cuda_experts) {
      EPMOE_CHECK_ARG(w.device.is_cuda() && (!args.hidden.device.is_cuda() || w.device == args.hidden.device), name,
                      fmt::format("a tensor on the CUDA device of the '{}' experts{}", experts_->name(),
                                  args.hidden.device.is_cuda() ? " (hidden's, " + to_string(args.hidden.device) + ")"
                                                               : std::string()),
                      describe(w));
    } else {
      EPMOE_CHECK_ARG(w.device.is_cpu(), name, fmt::format("a CPU tensor (the '{}' experts run on the CPU)",
                                                           experts_->name()), describe(w));
    }
    EPMOE_CHECK_ARG(w.is_contiguous(), name, "a contiguous tensor", fmt::format("strides {}", w.strides));
    EPMOE_CHECK_ARG(w.ndim() == 3, name, fmt::format("3 dimensions {}", layout), describe(w));
  };
  const bool gated = is_gated(args.activation);
  const auto act = [&] {
    return fmt::format("{} activation '{}'", gated ? "gated" : "non-gated", activation_name(args.activation));
  };
  check_weight(args.w1, "w1", gated ? "[E_local, 2N, H]" : "[E_local, N, H]");
  check_weight(args.w2, "w2", "[E_local, H, N]");
  // w1 fixes N (with E_local from the prepare/finalize and H from hidden); w2 must agree with it.
  const std::int64_t rows = args.w1.size(1);
  EPMOE_CHECK_ARG(args.w1.size(0) == e_local && args.w1.size(2) == H && rows >= 1 && (!gated || rows % 2 == 0), "w1",
                  fmt::format("shape [{}, {}, {}] ({}, H = {} from hidden, {})", e_local, gated ? "2N" : "N", H,
                              act(), H, e_local_from()),
                  describe(args.w1));
  const std::int64_t N = gated ? rows / 2 : rows;
  const Shape w2_shape{e_local, H, N};
  EPMOE_CHECK_ARG(args.w2.shape == w2_shape, "w2",
                  fmt::format("shape {} (N = {} from w1 {} with {}, H = {} from hidden, {})", to_string(w2_shape), N,
                              to_string(args.w1.shape), act(), H, e_local_from()),
                  describe(args.w2));
  layer_detail::check_weight_scales(args, *experts_, e_local, H, N);  // layer_fp8.cpp
  if (args.output.defined()) {
    const Shape out_shape{T, H};
    EPMOE_CHECK_ARG(args.output.dtype == DType::bf16 && args.output.shape == out_shape && args.output.is_contiguous() &&
                        args.output.device == args.hidden.device,
                    "output", fmt::format("contiguous bfloat16 {} on {} (hidden's device)", to_string(out_shape),
                                          to_string(args.hidden.device)),
                    describe(args.output));
  }
  if (load_recorder_) {  // expert load recorder (semantics §9)
    EPMOE_CHECK_ARG(load_recorder_->num_experts() == args.global_num_experts &&
                        load_recorder_->device() == args.hidden.device,
                    "load_recorder",
                    fmt::format("a recorder of num_experts = {} (global_num_experts) on {} (hidden's device)",
                                args.global_num_experts, to_string(args.hidden.device)),
                    fmt::format("num_experts = {} on {}", load_recorder_->num_experts(),
                                to_string(load_recorder_->device())));
  }
}

// ---- expert_map and EPLB mapping (semantics §8, §9) ----

void MoELayer::set_eplb_plan(EplbPlan plan, std::int64_t layer) {
  using i64 = std::int64_t;
  const i64 L = plan.num_layers, E = plan.num_logical_experts, P = plan.num_physical_experts, X = plan.max_replicas;
  EPMOE_CHECK_ARG(L >= 1 && E >= 1 && P >= E && P <= INT32_MAX && X >= 1, "plan",
                  "num_layers >= 1, num_logical_experts >= 1, num_physical_experts in [num_logical_experts, 2^31), "
                  "max_replicas >= 1", fmt::format("L = {}, E = {}, P = {}, X = {}", L, E, P, X));
  EPMOE_CHECK_ARG(layer >= 0 && layer < L, "layer", fmt::format("in [0, {}) (the plan's num_layers)", L), layer);
  EPMOE_CHECK_ARG(static_cast<i64>(plan.physical_to_logical.size()) == L * P &&
                      static_cast<i64>(plan.logical_to_physical.size()) == L * E * X &&
                      static_cast<i64>(plan.logical_replica_count.size()) == L * E,
                  "plan", fmt::format("physical_to_logical [{0}, {1}], logical_to_physical [{0}, {2}, {3}], "
                                      "logical_replica_count [{0}, {2}] entries", L, P, E, X),
                  fmt::format("{}, {} and {} entries", plan.physical_to_logical.size(),
                              plan.logical_to_physical.size(), plan.logical_replica_count.size()));
  for (i64 e = 0; e < E; ++e) {
    const i64 c = plan.logical_replica_count[static_cast<std::size_t>(layer * E + e)];
    EPMOE_CHECK_ARG(c >= 1 && c <= X, "plan", fmt::format("logical_replica_count in [1, {}]", X),
                    fmt::format("{} at [{}, {}]", c, layer, e));
    for (i64 r = 0; r < c; ++r) {
      const i64 slot = plan.logical_to_physical[static_cast<std::size_t>((layer * E + e) * X + r)];
      EPMOE_CHECK_ARG(slot >= 0 && slot < P, "plan", fmt::format("logical_to_physical slots in [0, {})", P),
                      fmt::format("{} at [{}, {}, {}]", slot, layer, e, r));
    }
  }
  auto eplb = std::make_shared<Eplb>();
  eplb->plan = std::move(plan);
  eplb->layer = layer;
  eplb_ = std::move(eplb);
}

void MoELayer::clear_eplb_plan() { eplb_.reset(); }

struct MoELayer::ExpertMapCopy {
  std::vector<std::int32_t> host;  ///< the contents last uploaded
  Device device;                   ///< where `dev` lives
  Tensor dev;                      ///< int32 [E]
};

namespace {

// expert_map read to the host and checked (semantics §8); `rank` < 0 without expert parallelism, else the map must
// be the rank's implied one and nothing is returned (there is nothing to apply).
std::vector<std::int32_t> checked_expert_map(const TensorView& map, std::int64_t E, std::int64_t e_local, std::int64_t rank,
                                             bool eplb, Device device) {
  using i64 = std::int64_t;
  EPMOE_CHECK_ARG(map.dtype == DType::int32 && map.ndim() == 1 && map.size(0) == E && map.is_contiguous(), "expert_map",
                  fmt::format("contiguous int32 [{}] ({})", E, eplb ? "P, the EPLB plan's physical experts"
                                                                     : "global_num_experts"),
                  describe(map));
  EPMOE_CHECK_ARG(map.device.is_cpu() || map.device == device, "expert_map",
                  fmt::format("a tensor on the CPU or on hidden's device ({})", to_string(device)), describe(map));
  std::vector<std::int32_t> host_map(static_cast<std::size_t>(E));
  if (map.device.is_cpu()) {
    std::memcpy(host_map.data(), map.data, host_map.size() * sizeof(std::int32_t));
  } else {
#if defined(EPMOE_HAVE_CUDA)
    // On the current stream: a map the caller wrote there is read after it is written.
    eplb_cuda::copy_to_host_cuda(device.index, host_map.data(), map.data, host_map.size() * sizeof(std::int32_t),
                                 current_stream());
#endif
  }
  std::vector<i64> first_at(static_cast<std::size_t>(std::max<i64>(e_local, 0)), -1);
  for (i64 g = 0; g < E; ++g) {
    const i64 v = host_map[static_cast<std::size_t>(g)];
    EPMOE_CHECK_ARG(v >= -1 && v < e_local, "expert_map", fmt::format("entries in [-1, {}) (E_local)", e_local),
                    fmt::format("{} at [{}]", v, g));
    if (v < 0) continue;
    EPMOE_CHECK_ARG(first_at[static_cast<std::size_t>(v)] < 0, "expert_map", "each local id at most once",
                    fmt::format("local id {} at [{}] and at [{}]", v, first_at[static_cast<std::size_t>(v)], g));
    first_at[static_cast<std::size_t>(v)] = g;
  }
  if (rank < 0) return host_map;
  // With expert parallelism the dispatch sends expert g to rank g / E_local: a map can only restate that.
  for (i64 g = 0; g < E; ++g) {
    const i64 want = g / e_local == rank ? g % e_local : -1, v = host_map[static_cast<std::size_t>(g)];
    EPMOE_CHECK_ARG(v == want, "expert_map",
                    fmt::format("the map rank {} implies with expert parallelism (experts [{}, {}) local): {} at [{}]",
                                rank, rank * e_local, (rank + 1) * e_local, want, g),
                    fmt::format("{} at [{}]", v, g));
  }
  return {};
}

}  // namespace

MoEForwardArgs MoELayer::route_ids(const MoEForwardArgs& args, std::vector<Tensor>& keep) {
  using i64 = std::int64_t;
  MoEForwardArgs a = args;
  a.expert_map = {};
  const bool no_ep = prepare_finalize_->name() == "no_ep";
  if (eplb_) {
    const EplbPlan& plan = eplb_->plan;
    EPMOE_CHECK_ARG(args.global_num_experts == plan.num_logical_experts, "global_num_experts",
                    fmt::format("{} (num_logical_experts of the EPLB plan set on the layer)", plan.num_logical_experts),
                    args.global_num_experts);
    a.global_num_experts = static_cast<int>(plan.num_physical_experts);
  }
  const i64 E = a.global_num_experts;  // the ids the map (if any) is indexed by: global, or physical with EPLB
  const TensorView& map = args.expert_map;
  if (map.defined() && no_ep && a.w1.defined() && a.w1.ndim() == 3) {
    // No-EP with a map: w1/w2 hold E_local experts; the prepare then sees local ids of E_local experts.
    EPMOE_CHECK_ARG(a.w1.size(0) >= 1 && a.w1.size(0) <= E, "w1",
                    fmt::format("[E_local, 2N or N, H] with 1 <= E_local <= {} (the size of expert_map)", E),
                    describe(a.w1));
    a.global_num_experts = static_cast<int>(a.w1.size(0));
  }
  check_forward_args(a);
  const Device device = a.hidden.device;
  const i64 e_local = no_ep ? a.global_num_experts : prepare_finalize_->num_local_experts(static_cast<int>(E));

  // Read and checked on the host; with expert parallelism only checked (the dispatch routes by rank): empty then.
  std::vector<std::int32_t> host_map;
  if (map.defined())
    host_map = checked_expert_map(map, E, e_local, no_ep ? -1 : prepare_finalize_->ep_rank(), eplb_ != nullptr, device);
  if (!eplb_ && host_map.empty()) return a;

  const TensorView& ids = a.topk_idx;
  if (device.is_cpu()) {
    if (eplb_) {
      keep.push_back(map_to_physical(ids, eplb_->plan, eplb_->layer));  // checks topk_idx (names it)
      a.topk_idx = keep.back();
    }
    if (!host_map.empty()) {
      const TensorView& in = a.topk_idx;
      check_topk_idx_dtype(in);
      EPMOE_CHECK_ARG(in.ndim() == 2 && in.device.is_cpu(), "topk_idx",
                      "a 2-d [T, K] tensor on the CPU (hidden's device)", describe(in));
      const i64 T = in.size(0), K = in.size(1);
      Tensor out = Tensor::empty(in.dtype, {T, K});
      for (i64 t = 0; t < T; ++t)
        for (i64 k = 0; k < K; ++k) {
          const i64 off = t * in.stride(0) + k * in.stride(1);
          const i64 g = in.dtype == DType::int64 ? in.ptr<std::int64_t>()[off] : in.ptr<std::int32_t>()[off];
          EPMOE_CHECK_ARG(g >= -1 && g < E, "topk_idx", fmt::format("ids in [-1, {})", E),
                          fmt::format("{} at [{}, {}]", g, t, k));
          const i64 v = g < 0 ? -1 : host_map[static_cast<std::size_t>(g)];
          if (in.dtype == DType::int64)
            out.ptr<std::int64_t>()[t * K + k] = v;
          else
            out.ptr<std::int32_t>()[t * K + k] = static_cast<std::int32_t>(v);
        }
      keep.push_back(out);
      a.topk_idx = keep.back();
    }
    return a;
  }
#if defined(EPMOE_HAVE_CUDA)
  check_topk_idx_dtype(ids);
  EPMOE_CHECK_ARG(ids.ndim() == 2 && ids.size(0) == a.hidden.size(0) && ids.is_contiguous() && ids.device == device,
                  "topk_idx",
                  fmt::format("contiguous [{}, K] on {} (hidden's device)", a.hidden.size(0), to_string(device)),
                  describe(ids));
  cuda_util::DeviceGuard guard(device);
  const Stream stream = current_stream();
  if (eplb_) {
    Eplb& p = *eplb_;
    const i64 El = p.plan.num_logical_experts, X = p.plan.max_replicas;
    if (!p.l2p.defined() || p.device != device) {  // one synchronous copy per device
      p.l2p = Tensor::empty(DType::int64, {El, X}, device);
      p.count = Tensor::empty(DType::int64, {El}, device);
      eplb_cuda::copy_to_device(p.l2p.data(), p.plan.logical_to_physical.data() + p.layer * El * X,
                                static_cast<std::size_t>(El * X) * sizeof(i64));
      eplb_cuda::copy_to_device(p.count.data(), p.plan.logical_replica_count.data() + p.layer * El,
                                static_cast<std::size_t>(El) * sizeof(i64));
      p.device = device;
    }
    const TensorView out = options_.workspaces->get(options_.micro_batch, "eplb.topk_idx", ids.dtype, ids.shape, device);
    eplb_cuda::map_to_physical(ids, p.l2p.ptr<i64>(), p.count.ptr<i64>(), El, X, p.plan.num_physical_experts, out,
                               stream);
    a.topk_idx = out;
  }
  if (!host_map.empty()) {
    const std::int32_t* dev_map = static_cast<const std::int32_t*>(map.data);
    if (map.device.is_cpu()) {
      // Uploaded only when the contents change (engines pass the same map every forward), on the stream, so an
      // earlier forward's kernels still reading the copy run first.
      if (!expert_map_copy_) expert_map_copy_ = std::make_shared<ExpertMapCopy>();
      ExpertMapCopy& c = *expert_map_copy_;
      if (c.host != host_map || c.device != device) {
        if (!c.dev.defined() || c.dev.numel() != E || c.device != device)
          c.dev = Tensor::empty(DType::int32, {E}, device);
        eplb_cuda::copy_to_device_async(c.dev.data(), host_map.data(), host_map.size() * sizeof(std::int32_t),
                                        stream);
        c.host = host_map;
        c.device = device;
      }
      dev_map = c.dev.ptr<std::int32_t>();
    }
    const TensorView in = a.topk_idx;
    const TensorView out =
        options_.workspaces->get(options_.micro_batch, "expert_map.topk_idx", in.dtype, in.shape, device);
    eplb_cuda::apply_expert_map(in, dev_map, E, e_local, out, stream);
    a.topk_idx = out;
  }
  return a;
#else
  raise(ErrorCode::unsupported, "argument 'hidden' is on {} but epmoe was built without CUDA", to_string(device));
#endif
}

DispatchMode MoELayer::select_mode(const MoEForwardArgs& args) {
  if (!buffer_) return last_mode_;
  EPMOE_CHECK_ARG(mode_ != DispatchMode::automatic || args.is_extend_in_batch.has_value(), "is_extend_in_batch",
                  "true (prefill) or false (decode) for a layer in mode auto", "unset");
  const DispatchMode resolved =
      resolve_dispatch_mode(mode_, args.is_extend_in_batch.value_or(mode_ == DispatchMode::normal));
  const bool ll = resolved == DispatchMode::low_latency;
  prepare_finalize_ = ll ? pf_low_latency_ : pf_normal_;
  experts_ = ll ? experts_low_latency_ : experts_normal_;
  return resolved;
}

void MoELayer::enter_mode(DispatchMode resolved, const MoEForwardArgs& args) {
  if (buffer_ && resolved == DispatchMode::low_latency) {
    EPMOE_CHECK_ARG(args.hidden.size(0) <= tmax_, "hidden",
                    fmt::format("at most num_max_dispatch_tokens_per_rank = {} rows for a low_latency batch", tmax_),
                    describe(args.hidden));
    // DeepEP's rule for a buffer both modes use: clean the low-latency buffer on each switch from normal.
    if (ran_ && last_mode_ == DispatchMode::normal) {
      buffer_->clean_low_latency_buffer(tmax_, args.hidden.size(1), args.global_num_experts);
      ++num_cleans_;
    }
  }
  ran_ = true;
  last_mode_ = resolved;
}

std::exception_ptr MoELayer::run_dispatch_hooks() {
  // A copy: a hook may remove itself (or another) while they run.
  std::vector<std::pair<std::uint64_t, DispatchHook>> hooks;
  {
    const std::lock_guard lock(hooks_->mutex);
    hooks = hooks_->hooks;
  }
  try {
    for (auto& [id, hook] : hooks) hook(*prepare_finalize_);
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

MoEForwardResult MoELayer::forward(const MoEForwardArgs& args) {
  if (!failed_.empty())
    raise(ErrorCode::unusable, "MoELayer: an earlier forward failed after its dispatch had started ({}); this rank is "
          "out of step with the other ranks, so the layer cannot run again (make a new Buffer and layer)", failed_);
  // DeepEP mode layers pick this forward's half first, so the checks below are the chosen half's.
  const DispatchMode resolved = select_mode(args);
  // Every argument is checked before any communication, so a bad one fails only this call: the other ranks
  // would otherwise wait in the combine for this rank, and this layer would be left mid-way.
  std::vector<Tensor> keep;  // host-mapped ids live until the combine
  const MoEForwardArgs routed = route_ids(args, keep);  // check_forward_args first, then expert_map and EPLB
  enter_mode(resolved, routed);
  MoEForwardResult result;
  // Shared experts overlap dispatch, experts and combine on a side thread (the CPU's side stream).
  std::future<Tensor> shared;
  // On a GPU they run on the layer's side stream instead (shared_experts.cpp).
  layer_detail::GpuSharedRun gpu_shared;
  if (shared_experts_ && args.hidden.device.is_cuda())
    gpu_shared = layer_detail::start_gpu_shared_experts(shared_stream_, shared_experts_, args.hidden);
  else if (shared_experts_) shared = std::async(std::launch::async, shared_experts_, args.hidden);

  PrepareInputs in{routed.hidden, routed.topk_idx, routed.topk_weights, routed.global_num_experts,
                   routed.apply_router_weight_on_input, routed.output};
  std::exception_ptr hook_error;
  try {
    prepare_finalize_->dispatch_a(in);
    // A hook's error waits until the collective round is complete, so no rank is left mid-way.
    hook_error = run_dispatch_hooks();
    const PrepareOutput prepared = prepare_finalize_->dispatch_b();
    if (load_recorder_) {  // expert load recorder (semantics §9): this rank's received counts, on their device
      const std::int64_t e_local = prepared.expert_num_tokens.numel();
      load_recorder_->record_local(load_recorder_layer_, prepared.expert_num_tokens,
                                   static_cast<std::int64_t>(prepare_finalize_->ep_rank()) * e_local);
    }
    (void)run_experts_and_combine_a(prepared, routed);
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
  } catch (const std::exception& e) {
    if (shared.valid()) shared.wait();
    layer_detail::join_gpu_shared_experts(gpu_shared);
    // Failed after dispatch_a had sent (its own argument errors leave the stage at INITIAL): the ranks are out
    // of step, and the next call says so instead of reporting a stage error.
    if (prepare_finalize_->stage() != Stage::initial)
      failed_ = fmt::format("in stage {}: {}", stage_name(prepare_finalize_->stage()), e.what());
    throw;
  }
  layer_detail::join_gpu_shared_experts(gpu_shared);
  if (hook_error) {
    if (shared.valid()) shared.wait();
    std::rethrow_exception(hook_error);
  }
  if (shared.valid()) result.shared_output = shared.get();
  if (gpu_shared.error) std::rethrow_exception(gpu_shared.error);
  if (gpu_shared.state) result.shared_output = std::move(gpu_shared.output);
  return result;
}

}  // namespace epmoe
