// ExpertLoadRecorder (semantics §9): windowed tokens per (layer, expert), balancedness, JSON. The state lives on
// the recorder's device; on a GPU every record is one kernel of eplb/cuda.cu (no host read), and the reads copy to
// the host.
#include <epmoe/eplb.hpp>
#include <epmoe/group.hpp>

#include "core/check.hpp"
#include "eplb/eplb.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>

namespace epmoe {

using i64 = std::int64_t;

namespace {

#if !defined(EPMOE_HAVE_CUDA)
[[noreturn]] void no_cuda(const Device& d) {
  raise(ErrorCode::unsupported, "ExpertLoadRecorder on {}: epmoe was built without CUDA", to_string(d));
}
#endif

// Copies `n` int64 of a recorder tensor to the host (CUDA: waits for the current stream).
std::vector<i64> to_host(const Tensor& t, i64 offset, i64 n) {
  std::vector<i64> out(static_cast<size_t>(n));
  const i64* src = t.ptr<i64>() + offset;
  if (t.device().is_cpu()) {
    std::copy(src, src + n, out.begin());
    return out;
  }
#if defined(EPMOE_HAVE_CUDA)
  eplb_cuda::copy_to_host_cuda(t.device().index, out.data(), src, static_cast<size_t>(n) * sizeof(i64),
                                 current_stream());
#else
  no_cuda(t.device());
#endif
  return out;
}

}  // namespace

std::vector<double> load_balancedness(std::span<const i64> loads, i64 num_layers, i64 num_experts, i64 num_ranks) {
  EPMOE_CHECK_ARG(num_layers >= 0, "num_layers", ">= 0", num_layers);
  EPMOE_CHECK_ARG(num_experts >= 1, "num_experts", ">= 1", num_experts);
  EPMOE_CHECK_ARG(num_ranks >= 1 && num_experts % num_ranks == 0, "num_ranks",
                  fmt::format(">= 1 and dividing num_experts ({})", num_experts), num_ranks);
  EPMOE_CHECK_ARG(static_cast<i64>(loads.size()) == num_layers * num_experts, "loads",
                  fmt::format("{} values (num_layers {} x num_experts {})", num_layers * num_experts, num_layers,
                              num_experts),
                  loads.size());
  std::vector<double> out(static_cast<size_t>(num_layers));
  const i64 per_rank = num_experts / num_ranks;
  for (i64 l = 0; l < num_layers; ++l) {
    double total = 0, most = 0;
    for (i64 r = 0; r < num_ranks; ++r) {
      i64 s = 0;
      for (i64 e = r * per_rank; e < (r + 1) * per_rank; ++e) s += loads[l * num_experts + e];
      total += static_cast<double>(s);
      most = std::max(most, static_cast<double>(s));
    }
    out[l] = most > 0 ? total / static_cast<double>(num_ranks) / most : 1.0;
  }
  return out;
}

ExpertLoadRecorder::ExpertLoadRecorder(i64 num_layers, i64 num_experts, i64 num_ranks, i64 window, Device device)
    : L_(num_layers), E_(num_experts), R_(num_ranks), W_(window), device_(device) {
  EPMOE_CHECK_ARG(num_layers >= 1, "num_layers", ">= 1", num_layers);
  EPMOE_CHECK_ARG(num_experts >= 1, "num_experts", ">= 1", num_experts);
  EPMOE_CHECK_ARG(num_ranks >= 1 && num_experts % num_ranks == 0, "num_ranks",
                  fmt::format(">= 1 and dividing num_experts ({})", num_experts), num_ranks);
  EPMOE_CHECK_ARG(window >= 1, "window", ">= 1", window);
#if !defined(EPMOE_HAVE_CUDA)
  if (device.is_cuda()) no_cuda(device);
#endif
  history_ = Tensor::empty(DType::int64, {L_, W_, E_}, device_);
  sums_ = Tensor::empty(DType::int64, {L_, E_}, device_);
  state_ = Tensor::empty(DType::int64, {2, L_}, device_);
  reset();
#if defined(EPMOE_HAVE_CUDA)
  // Stream-ordered memory zeroed on this stream: wait once, so records on any stream find it ready.
  if (device_.is_cuda()) eplb_cuda::synchronize_cuda(device_.index, current_stream());
#endif
}

void ExpertLoadRecorder::reset() {
  for (const Tensor* t : {&history_, &sums_, &state_}) {
    if (device_.is_cpu()) {
      std::fill_n(t->ptr<i64>(), t->numel(), i64{0});
      continue;
    }
#if defined(EPMOE_HAVE_CUDA)
    eplb_cuda::zero_cuda(device_.index, t->data(), t->nbytes(), current_stream());
#endif
  }
}

void ExpertLoadRecorder::record(i64 layer, const TensorView& t) {
  EPMOE_CHECK_ARG(!t.defined() || t.ndim() != 1 || t.size(0) == E_, "num_tokens_per_expert",
                  fmt::format("int32 or int64 [{}] on {}", E_, to_string(device_)), describe(t));
  add(layer, t, 0, "num_tokens_per_expert");
}

void ExpertLoadRecorder::record_local(i64 layer, const TensorView& t, i64 expert_offset) {
  add(layer, t, expert_offset, "num_recv_tokens_per_expert");
}

void ExpertLoadRecorder::add(i64 layer, const TensorView& t, i64 expert_offset, std::string_view name) {
  EPMOE_CHECK_ARG(layer >= 0 && layer < L_, "layer", fmt::format("in [0, {})", L_), layer);
  EPMOE_CHECK_ARG(t.defined() && t.ndim() == 1 && (t.dtype == DType::int32 || t.dtype == DType::int64) &&
                      t.device == device_,
                  name, fmt::format("int32 or int64 [n] on {} (the recorder's device)", to_string(device_)),
                  t.defined() ? describe(t) : std::string("None"));
  const i64 n = t.size(0);
  EPMOE_CHECK_ARG(n <= E_, name, fmt::format("at most num_experts = {} counts", E_), describe(t));
  EPMOE_CHECK_ARG(expert_offset >= 0 && expert_offset + n <= E_, "expert_offset",
                  fmt::format("in [0, {}] (num_experts {} - n {})", E_ - n, E_, n), expert_offset);
  i64* held = state_.ptr<i64>() + layer;
  i64* next = state_.ptr<i64>() + L_ + layer;
  i64* sum = sums_.ptr<i64>() + layer * E_;
  if (device_.is_cuda()) {
#if defined(EPMOE_HAVE_CUDA)
    eplb_cuda::record_loads_cuda(device_.index, t, expert_offset, E_, W_, history_.ptr<i64>() + layer * W_ * E_,
                                   sum, held, next, current_stream());
#endif
    return;
  }
  std::vector<i64> counts(static_cast<size_t>(E_), 0);
  for (i64 i = 0; i < n; ++i) {
    const i64 off = i * t.stride(0);
    const i64 c = t.dtype == DType::int32 ? static_cast<const std::int32_t*>(t.data)[off]
                                          : static_cast<const std::int64_t*>(t.data)[off];
    EPMOE_CHECK_ARG(c >= 0, name, "counts >= 0", fmt::format("{} at [{}]", c, i));
    counts[static_cast<size_t>(expert_offset + i)] = c;
  }
  i64* slot = history_.ptr<i64>() + (layer * W_ + *next) * E_;
  for (i64 e = 0; e < E_; ++e) {
    sum[e] += counts[e] - slot[e];  // the slot holds the dropped record (zeros until the window is full)
    slot[e] = counts[e];
  }
  *next = (*next + 1) % W_;
  *held = std::min(*held + 1, W_);
}

std::vector<i64> ExpertLoadRecorder::loads() const { return to_host(sums_, 0, L_ * E_); }

TensorView ExpertLoadRecorder::loads_view() const { return sums_.view(); }

std::vector<i64> ExpertLoadRecorder::num_records() const { return to_host(state_, 0, L_); }

std::vector<double> ExpertLoadRecorder::balancedness() const { return load_balancedness(loads(), L_, E_, R_); }

std::vector<i64> ExpertLoadRecorder::global_loads(Group& group) const {
  const Setting settings[] = {{"num_layers", L_}, {"num_experts", E_}};
  group.check_agreement(settings, "ExpertLoadRecorder::global_loads settings");
  const std::vector<i64> mine = loads();
  const auto R = static_cast<size_t>(group.size());
  std::vector<i64> all(R * mine.size());
  group.all_gather(mine.data(), all.data(), mine.size() * sizeof(i64), "ExpertLoadRecorder::global_loads");
  std::vector<i64> sum(mine.size(), 0);
  for (size_t r = 0; r < R; ++r)
    for (size_t i = 0; i < mine.size(); ++i) sum[i] += all[r * mine.size() + i];
  return sum;
}

std::string ExpertLoadRecorder::json_of(const std::vector<i64>& loads) const {
  nlohmann::json j;
  j["num_layers"] = L_;
  j["num_experts"] = E_;
  j["num_ranks"] = R_;
  j["window"] = W_;
  j["num_records"] = num_records();
  nlohmann::json rows = nlohmann::json::array();
  for (i64 l = 0; l < L_; ++l) rows.push_back(std::vector<i64>(loads.begin() + l * E_, loads.begin() + (l + 1) * E_));
  j["loads"] = rows;
  j["balancedness"] = load_balancedness(loads, L_, E_, R_);
  return j.dump();
}

std::string ExpertLoadRecorder::to_json() const { return json_of(loads()); }

std::string ExpertLoadRecorder::to_json(Group& group) const { return json_of(global_loads(group)); }

}  // namespace epmoe
