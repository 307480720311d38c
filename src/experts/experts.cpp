// Names, scalar activation definitions and the argument checks shared by every Experts implementation.
#include <epmoe/experts.hpp>

#include "core/check.hpp"
#include "core/cuda_util.hpp"
#include "experts/problem.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

namespace epmoe {

namespace {

constexpr std::array<Activation, 6> kActivations = {Activation::silu,        Activation::gelu,
                                                    Activation::swigluoai,   Activation::silu_no_mul,
                                                    Activation::gelu_no_mul, Activation::relu2_no_mul};

double silu(double x) { return x / (1.0 + std::exp(-x)); }
double gelu(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }

void check_dtype(const TensorView& t, std::string_view name, DType a) {
  if (t.dtype != a) throw_wrong_dtype(name, dtype_name(a), describe(t));
}

template <class T>
std::int64_t load_index(const void* p, std::int64_t i) {
  return static_cast<std::int64_t>(static_cast<const T*>(p)[i]);
}

}  // namespace

std::string_view activation_name(Activation a) {
  switch (a) {
    case Activation::silu: return "silu";
    case Activation::gelu: return "gelu";
    case Activation::swigluoai: return "swigluoai";
    case Activation::silu_no_mul: return "silu_no_mul";
    case Activation::gelu_no_mul: return "gelu_no_mul";
    case Activation::relu2_no_mul: return "relu2_no_mul";
  }
  return "?";
}

Activation parse_activation(std::string_view name) {
  for (Activation a : kActivations)
    if (activation_name(a) == name) return a;
  throw_invalid_argument("activation", "one of silu, gelu, swigluoai, silu_no_mul, gelu_no_mul, relu2_no_mul",
                         fmt::format("'{}'", name));
}

bool is_gated(Activation a) {
  return a == Activation::silu || a == Activation::gelu || a == Activation::swigluoai;
}

double activation_value(Activation a, double g, double u) {
  switch (a) {
    case Activation::silu: return silu(g) * u;
    case Activation::gelu: return gelu(g) * u;
    case Activation::swigluoai: {
      // gpt-oss constants (vLLM's swigluoai_and_mul: alpha 1.702, limit 7).
      const double gc = std::min(g, 7.0), uc = std::clamp(u, -7.0, 7.0);
      return (uc + 1.0) * gc / (1.0 + std::exp(-1.702 * gc));
    }
    case Activation::silu_no_mul: return silu(g);
    case Activation::gelu_no_mul: return gelu(g);
    case Activation::relu2_no_mul: return g > 0.0 ? g * g : 0.0;
  }
  return 0.0;
}

std::string_view activation_format_name(ActivationFormat f) {
  return f == ActivationFormat::standard ? "standard" : "batched_experts";
}

std::string_view weight_and_reduce_name(WeightAndReduce w) {
  switch (w) {
    case WeightAndReduce::none: return "none";
    case WeightAndReduce::contiguous: return "contiguous";
    case WeightAndReduce::naive_batched: return "naive_batched";
    case WeightAndReduce::delegate: return "delegate";
  }
  return "?";
}

WeightAndReduce Experts::weight_and_reduce() const {
  if (config_.format == ActivationFormat::batched_experts) return WeightAndReduce::delegate;
  return config_.reduce ? WeightAndReduce::none : WeightAndReduce::contiguous;
}

bool check_activation(Activation a) {
  EPMOE_CHECK_ARG(std::find(kActivations.begin(), kActivations.end(), a) != kActivations.end(), "activation",
                  "a valid Activation", static_cast<int>(a));
  return is_gated(a);
}

void check_experts_tensor(const TensorView& t, std::string_view name, const Device& device) {
  if (device.is_cpu()) {
    EPMOE_CHECK_ARG(t.device.is_cpu(), name, "a CPU tensor", describe(t));
  } else {
    EPMOE_CHECK_ARG(t.device.is_cuda(), name, "a CUDA tensor (make_cuda_experts)", describe(t));
    EPMOE_CHECK_ARG(t.device == device, name, fmt::format("a tensor on the weights' device {}", to_string(device)),
                    describe(t));
  }
  EPMOE_CHECK_ARG(t.is_contiguous(), name, "a contiguous tensor", fmt::format("strides {}", t.strides));
  EPMOE_CHECK_ARG(t.numel() == 0 || t.data != nullptr, name, "non-null data", "nullptr");
}

Device cuda_weights_device(const TensorView& w2) {
  EPMOE_CHECK_ARG(w2.device.is_cuda(), "w2", "a CUDA tensor (make_cuda_experts)", describe(w2));
  return w2.device;
}

void check_aligned16(const TensorView& t, std::string_view name) {
  EPMOE_CHECK_ARG(t.numel() == 0 || cuda_util::aligned16(t.data), name, "a 16-byte-aligned data pointer on CUDA",
                  fmt::format("{} at {}", describe(t), t.data));
}

ExpertsSizes check_bf16_weights(const ExpertsInputs& in, const ExpertsConfig& config, bool cuda) {
  ExpertsSizes s;
  s.batched = config.format == ActivationFormat::batched_experts;
  s.reduce = config.reduce;
  s.gated = check_activation(in.activation);

  // Weights first: they fix E_local, N and H.
  EPMOE_CHECK_ARG(in.w1.defined(), "w1", "a bfloat16 [E_local, 2N or N, H] tensor", "None");
  EPMOE_CHECK_ARG(in.w2.defined(), "w2", "a bfloat16 [E_local, H, N] tensor", "None");
  s.device = cuda ? cuda_weights_device(in.w2) : Device::cpu();
  check_experts_tensor(in.w2, "w2", s.device);
  check_experts_tensor(in.w1, "w1", s.device);
  check_dtype(in.w1, "w1", DType::bf16);
  check_dtype(in.w2, "w2", DType::bf16);
  EPMOE_CHECK_ARG(in.w2.ndim() == 3, "w2", "3 dimensions [E_local, H, N]", describe(in.w2));
  EPMOE_CHECK_ARG(in.w1.ndim() == 3, "w1", "3 dimensions [E_local, 2N or N, H]", describe(in.w1));
  s.e_local = in.w2.size(0);
  s.h = in.w2.size(1);
  s.n = in.w2.size(2);
  EPMOE_CHECK_ARG(s.e_local >= 1 && s.h >= 1 && s.n >= 1, "w2", "[E_local, H, N] with all sizes >= 1",
                  describe(in.w2));
  if (cuda) {
    EPMOE_CHECK_ARG(s.h % 8 == 0 && s.n % 8 == 0, "w2",
                    "H % 8 == 0 and N % 8 == 0 on CUDA (rows of a multiple of 16 bytes)", describe(in.w2));
    EPMOE_CHECK_ARG(s.e_local <= 1024, "w2", "E_local <= 1024 (semantics §1)", describe(in.w2));
  }
  s.r1 = s.gated ? 2 * s.n : s.n;
  const Shape w1_shape{s.e_local, s.r1, s.h};
  EPMOE_CHECK_ARG(in.w1.shape == w1_shape, "w1",
                  fmt::format("shape {} ({} activation '{}', from w2 {})", w1_shape, s.gated ? "gated" : "non-gated",
                              activation_name(in.activation), describe(in.w2)),
                  describe(in.w1));
  if (cuda) {
    check_aligned16(in.w1, "w1");
    check_aligned16(in.w2, "w2");
  }

  EPMOE_CHECK_ARG(in.hidden.defined(), "hidden", s.batched ? "a [E_local, max_tokens, H] tensor" : "an [M, H] tensor",
                  "None");
  check_experts_tensor(in.hidden, "hidden", s.device);
  if (in.hidden.dtype != DType::bf16 && in.hidden.dtype != DType::fp32)
    throw_wrong_dtype("hidden", "bfloat16 or float32", describe(in.hidden));
  if (cuda) check_aligned16(in.hidden, "hidden");
  return s;
}

namespace {

// ExpertsInputs::combine_signal (batched only; max_tokens known).
void check_combine_signal(const ExpertsCombineSignal& c, ExpertsSizes& s) {
  const TensorView& t = c.signal;
  if (!t.defined()) {
    EPMOE_CHECK_ARG(c.block_m == 0 && c.block_n == 0, "block_m", "0 (with block_n) without a combine_signal",
                    fmt::format("block_m = {}, block_n = {}", c.block_m, c.block_n));
    return;
  }
  EPMOE_CHECK_ARG(s.batched, "combine_signal", "None in standard format (it follows the batched slabs' rows)",
                  describe(t));
  check_experts_tensor(t, "combine_signal", s.device);
  if (t.dtype == DType::uint32) {
    EPMOE_CHECK_ARG(t.ndim() == 1 && t.size(0) == s.e_local, "combine_signal",
                    fmt::format("uint32 [{}] (one counter per local expert)", s.e_local), describe(t));
    EPMOE_CHECK_ARG(c.block_m == 0 && c.block_n == 0, "block_m",
                    "0 (with block_n) with a uint32 combine_signal (one add per expert)",
                    fmt::format("block_m = {}, block_n = {}", c.block_m, c.block_n));
    s.signal_per_expert = true;
  } else {
    EPMOE_CHECK_ARG(c.block_m >= 1, "block_m", ">= 1 (rows per signal block)", c.block_m);
    EPMOE_CHECK_ARG(c.block_n >= 1, "block_n", ">= 1 (columns per N-tile)", c.block_n);
    s.signal_blocks = (s.max_tokens + c.block_m - 1) / c.block_m;
    const std::string want =
        fmt::format("int32 [>= {}] (E_local = {} times ceil(max_tokens = {} / block_m = {})) or uint32 [{}]",
                    s.e_local * s.signal_blocks, s.e_local, s.max_tokens, c.block_m, s.e_local);
    EPMOE_CHECK_ARG(t.dtype == DType::int32 && t.ndim() == 1 && t.size(0) >= s.e_local * s.signal_blocks,
                    "combine_signal", want, describe(t));
  }
  s.signal = t.data;
  s.signal_block_m = c.block_m;
  s.signal_block_n = c.block_n;
}

}  // namespace

void check_experts_routing(const ExpertsInputs& in, const CudaIndexLimits* cuda, ExpertsSizes& s) {
  if (!s.batched)
    EPMOE_CHECK_ARG(!in.combine_signal.signal.defined(), "combine_signal",
                    "None in standard format (it follows the batched slabs' rows)", describe(in.combine_signal.signal));
  if (s.batched) {
    const Shape hidden_shape{s.e_local, in.hidden.ndim() == 3 ? in.hidden.size(1) : 0, s.h};
    EPMOE_CHECK_ARG(in.hidden.ndim() == 3 && in.hidden.shape == hidden_shape, "hidden",
                    fmt::format("[E_local={}, max_tokens, H={}] (from w2)", s.e_local, s.h), describe(in.hidden));
    s.max_tokens = in.hidden.size(1);
    if (cuda) {
      const std::int64_t slab = (s.max_tokens + cuda->slab_align - 1) / cuda->slab_align * cuda->slab_align;
      EPMOE_CHECK_ARG(s.e_local * slab <= std::numeric_limits<int>::max(), "hidden",
                      "E_local * max_tokens < 2^31 rows on CUDA", describe(in.hidden));
    }
    EPMOE_CHECK_ARG(!in.expert_map.defined(), "expert_map", "None in batched_experts format (slabs are local)",
                    describe(in.expert_map));
    EPMOE_CHECK_ARG(!in.apply_router_weight_on_input, "apply_router_weight_on_input",
                    "false in batched_experts format (no router weights; the producer applies them)", "true");
    EPMOE_CHECK_ARG(in.expert_num_tokens.defined(), "expert_num_tokens", fmt::format("int32 [{}]", s.e_local),
                    "None");
    check_experts_tensor(in.expert_num_tokens, "expert_num_tokens", s.device);
    check_dtype(in.expert_num_tokens, "expert_num_tokens", DType::int32);
    EPMOE_CHECK_ARG(in.expert_num_tokens.ndim() == 1 && in.expert_num_tokens.size(0) == s.e_local,
                    "expert_num_tokens", fmt::format("int32 [{}] (E_local)", s.e_local),
                    describe(in.expert_num_tokens));
    s.out_shape = Shape{s.e_local, s.max_tokens, s.h};
    check_combine_signal(in.combine_signal, s);
    return;
  }

  EPMOE_CHECK_ARG(in.hidden.ndim() == 2 && in.hidden.size(1) == s.h, "hidden",
                  fmt::format("[M, H={}] (H from w2)", s.h), describe(in.hidden));
  s.m = in.hidden.size(0);
  EPMOE_CHECK_ARG(in.topk_idx.defined(), "topk_idx", fmt::format("an int64 or int32 [{}, K] tensor", s.m), "None");
  check_experts_tensor(in.topk_idx, "topk_idx", s.device);
  check_topk_idx_dtype(in.topk_idx);
  EPMOE_CHECK_ARG(in.topk_idx.ndim() == 2 && in.topk_idx.size(0) == s.m && in.topk_idx.size(1) >= 1, "topk_idx",
                  fmt::format("[M={}, K >= 1] (M from hidden)", s.m), describe(in.topk_idx));
  s.k = in.topk_idx.size(1);
  if (cuda)
    EPMOE_CHECK_ARG(s.k <= 512 && s.m * s.k <= cuda->max_slots, "topk_idx", cuda->slots, describe(in.topk_idx));
  EPMOE_CHECK_ARG(in.topk_weights.defined(), "topk_weights", fmt::format("float32 [{}, {}]", s.m, s.k), "None");
  check_experts_tensor(in.topk_weights, "topk_weights", s.device);
  check_dtype(in.topk_weights, "topk_weights", DType::fp32);
  EPMOE_CHECK_ARG(in.topk_weights.shape == (Shape{s.m, s.k}), "topk_weights",
                  fmt::format("[{}, {}] (as topk_idx)", s.m, s.k), describe(in.topk_weights));
  EPMOE_CHECK_ARG(!in.apply_router_weight_on_input || s.k == 1, "apply_router_weight_on_input",
                  "K == 1 (one router weight per token to fold into the input)", fmt::format("true with K = {}", s.k));
  s.weight_on_input = in.apply_router_weight_on_input;

  // Map: global -> local. Without one, ids are already local.
  s.id_limit = s.e_local;
  if (in.expert_map.defined()) {
    check_experts_tensor(in.expert_map, "expert_map", s.device);
    check_dtype(in.expert_map, "expert_map", DType::int32);
    EPMOE_CHECK_ARG(in.expert_map.ndim() == 1 && in.expert_map.size(0) >= 1, "expert_map", "int32 [E], E >= 1",
                    describe(in.expert_map));
    s.id_limit = in.expert_map.size(0);
    EPMOE_CHECK_ARG(in.global_num_experts == -1 || in.global_num_experts == s.id_limit, "global_num_experts",
                    fmt::format("-1 or {} (the size of expert_map)", s.id_limit), in.global_num_experts);
  }
  s.out_shape = s.reduce ? Shape{s.m, s.h} : Shape{s.m, s.k, s.h};
}

// Checks everything (shapes, dtypes, layouts and index values) before any work, and resolves the
// routing to local ids once so the implementations never see a global id.
ExpertsProblem check_experts_inputs(const ExpertsInputs& in, const ExpertsConfig& config) {
  ExpertsProblem p;
  static_cast<ExpertsSizes&>(p) = check_bf16_weights(in, config, false);
  check_experts_routing(in, nullptr, p);
  p.format = config.format;
  p.activation = in.activation;
  p.w1 = static_cast<const bf16_t*>(in.w1.data);
  p.w2 = static_cast<const bf16_t*>(in.w2.data);
  p.hidden = in.hidden.data;
  p.hidden_dtype = in.hidden.dtype;

  // The values, on the host.
  if (p.batched) {
    p.counts = static_cast<const std::int32_t*>(in.expert_num_tokens.data);
    for (std::int64_t e = 0; e < p.e_local; ++e)
      EPMOE_CHECK_ARG(p.counts[e] >= 0 && p.counts[e] <= p.max_tokens, "expert_num_tokens",
                      fmt::format("counts in [0, {}] (max_tokens)", p.max_tokens),
                      fmt::format("{} at expert {}", p.counts[e], e));
    return p;
  }
  p.topk_weights = static_cast<const float*>(in.topk_weights.data);
  const std::int32_t* map = nullptr;
  if (in.expert_map.defined()) {
    map = static_cast<const std::int32_t*>(in.expert_map.data);
    for (std::int64_t g = 0; g < p.id_limit; ++g)
      EPMOE_CHECK_ARG(map[g] >= -1 && map[g] < p.e_local, "expert_map",
                      fmt::format("entries in [-1, {}) (E_local)", p.e_local), fmt::format("{} at {}", map[g], g));
  }
  p.local_ids.resize(static_cast<std::size_t>(p.m * p.k));
  const bool idx64 = in.topk_idx.dtype == DType::int64;
  for (std::int64_t i = 0; i < p.m * p.k; ++i) {
    const std::int64_t id = idx64 ? load_index<std::int64_t>(in.topk_idx.data, i)
                                  : load_index<std::int32_t>(in.topk_idx.data, i);
    EPMOE_CHECK_ARG(id >= -1 && id < p.id_limit, "topk_idx",
                    fmt::format("ids in [-1, {}) ({})", p.id_limit, map ? "E, the size of expert_map" : "E_local"),
                    fmt::format("{} at [{}, {}]", id, i / p.k, i % p.k));
    p.local_ids[static_cast<std::size_t>(i)] =
        id < 0 ? -1 : (map ? map[id] : static_cast<std::int32_t>(id));
  }
  return p;
}

Shape Experts::output_shape(const ExpertsInputs& in) const {
  const ExpertsProblem p = check_experts_inputs(in, config_);
  if (p.format == ActivationFormat::batched_experts) return Shape{p.e_local, p.max_tokens, p.h};
  return p.reduce ? Shape{p.m, p.h} : Shape{p.m, p.k, p.h};
}

namespace {

Shape problem_output_shape(const ExpertsProblem& p) {
  if (p.format == ActivationFormat::batched_experts) return Shape{p.e_local, p.max_tokens, p.h};
  return p.reduce ? Shape{p.m, p.h} : Shape{p.m, p.k, p.h};
}

bool has_work(const ExpertsProblem& p) {
  if (p.format == ActivationFormat::standard) return p.m > 0;
  for (std::int64_t e = 0; e < p.e_local; ++e)
    if (p.counts[e] > 0) return true;
  return false;
}

}  // namespace

void Experts::apply(const ExpertsInputs& in, const TensorView& out) const {
  const ExpertsProblem p = check_experts_inputs(in, config_);
  const Shape want = problem_output_shape(p);
  EPMOE_CHECK_ARG(out.defined(), "out", fmt::format("bfloat16{}", want), "None");
  check_experts_tensor(out, "out", Device::cpu());
  EPMOE_CHECK_ARG(out.dtype == DType::bf16 && out.shape == want, "out", fmt::format("bfloat16{}", want),
                  describe(out));
  if (p.signal && !writes_combine_signal())
    raise(ErrorCode::unsupported, "the {} experts do not write a combine_signal (the reference and CUDA bf16 ones do)",
          name());
  if (!has_work(p)) {  // a rank without tokens: nothing to compute or write
    if (p.signal_per_expert)  // every expert is done at once
      for (std::int64_t e = 0; e < p.e_local; ++e) add_host_signal(p, e);
    return;
  }
  run(p, out);
}

Tensor Experts::apply(const ExpertsInputs& in) const {
  const Shape shape = output_shape(in);
  // Batched rows past the counts must read as zero; standard outputs are fully written by run().
  Tensor out = config_.format == ActivationFormat::batched_experts ? Tensor::zeros(DType::bf16, shape)
                                                                   : Tensor::empty(DType::bf16, shape);
  apply(in, out.view());
  return out;
}

}  // namespace epmoe
