// ExpertLoadRecorder (semantics §9): windowed tokens per (layer, expert), balancedness, JSON.
#include <epmoe/eplb.hpp>

#include "core/check.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>

namespace epmoe {

using i64 = std::int64_t;

ExpertLoadRecorder::ExpertLoadRecorder(i64 num_layers, i64 num_experts, i64 num_ranks, i64 window)
    : L_(num_layers), E_(num_experts), R_(num_ranks), W_(window) {
  EPMOE_CHECK_ARG(num_layers >= 1, "num_layers", ">= 1", num_layers);
  EPMOE_CHECK_ARG(num_experts >= 1, "num_experts", ">= 1", num_experts);
  EPMOE_CHECK_ARG(num_ranks >= 1 && num_experts % num_ranks == 0, "num_ranks",
                  fmt::format(">= 1 and dividing num_experts ({})", num_experts), num_ranks);
  EPMOE_CHECK_ARG(window >= 1, "window", ">= 1", window);
  reset();
}

void ExpertLoadRecorder::reset() {
  history_.assign(static_cast<size_t>(L_ * W_ * E_), 0);
  sums_.assign(static_cast<size_t>(L_ * E_), 0);
  count_.assign(static_cast<size_t>(L_), 0);
  next_.assign(static_cast<size_t>(L_), 0);
}

void ExpertLoadRecorder::record(i64 layer, const TensorView& t) {
  EPMOE_CHECK_ARG(layer >= 0 && layer < L_, "layer", fmt::format("in [0, {})", L_), layer);
  EPMOE_CHECK_ARG(t.ndim() == 1 && t.size(0) == E_ && (t.dtype == DType::int32 || t.dtype == DType::int64) &&
                      t.device.is_cpu(),
                  "num_tokens_per_expert", fmt::format("int32 or int64 [{}] on the CPU", E_), describe(t));
  std::vector<i64> counts(static_cast<size_t>(E_));
  for (i64 e = 0; e < E_; ++e) {
    const i64 off = e * t.stride(0);
    counts[e] = t.dtype == DType::int32 ? static_cast<const std::int32_t*>(t.data)[off]
                                        : static_cast<const std::int64_t*>(t.data)[off];
    EPMOE_CHECK_ARG(counts[e] >= 0, "num_tokens_per_expert", "counts >= 0", fmt::format("{} at [{}]", counts[e], e));
  }
  i64* slot = history_.data() + (layer * W_ + next_[layer]) * E_;
  i64* sum = sums_.data() + layer * E_;
  for (i64 e = 0; e < E_; ++e) {
    sum[e] += counts[e] - slot[e];  // the slot holds the dropped record (zeros until the window is full)
    slot[e] = counts[e];
  }
  next_[layer] = (next_[layer] + 1) % W_;
  count_[layer] = std::min(count_[layer] + 1, W_);
}

std::vector<i64> ExpertLoadRecorder::loads() const { return sums_; }

std::vector<i64> ExpertLoadRecorder::num_records() const { return count_; }

std::vector<double> ExpertLoadRecorder::balancedness() const {
  std::vector<double> out(static_cast<size_t>(L_));
  const i64 per_rank = E_ / R_;
  for (i64 l = 0; l < L_; ++l) {
    double total = 0, most = 0;
    for (i64 r = 0; r < R_; ++r) {
      i64 s = 0;
      for (i64 e = r * per_rank; e < (r + 1) * per_rank; ++e) s += sums_[l * E_ + e];
      total += static_cast<double>(s);
      most = std::max(most, static_cast<double>(s));
    }
    out[l] = most > 0 ? total / static_cast<double>(R_) / most : 1.0;
  }
  return out;
}

std::string ExpertLoadRecorder::to_json() const {
  nlohmann::json j;
  j["num_layers"] = L_;
  j["num_experts"] = E_;
  j["num_ranks"] = R_;
  j["window"] = W_;
  j["num_records"] = count_;
  nlohmann::json rows = nlohmann::json::array();
  for (i64 l = 0; l < L_; ++l) rows.push_back(std::vector<i64>(sums_.begin() + l * E_, sums_.begin() + (l + 1) * E_));
  j["loads"] = rows;
  j["balancedness"] = balancedness();
  return j.dump();
}

}  // namespace epmoe
