#include "support/low_latency_reference.hpp"

#include <epmoe/dtype.hpp>

#include <map>
#include <stdexcept>
#include <tuple>

namespace epmoe::test {

namespace {
std::int64_t id_at(const Tensor& topk_idx, std::int64_t t, std::int64_t k) {
  return topk_idx.ptr<std::int64_t>()[t * topk_idx.size(1) + k];
}
}  // namespace

std::vector<LowLatencyReferenceRank> reference_low_latency_dispatch(const std::vector<LowLatencyRankInput>& inputs,
                                                                    int num_experts) {
  const int R = static_cast<int>(inputs.size());
  const int El = num_experts / R;
  std::vector<LowLatencyReferenceRank> out(static_cast<std::size_t>(R));
  for (int d = 0; d < R; ++d) {
    auto& rk = out[static_cast<std::size_t>(d)];
    rk.rows.resize(static_cast<std::size_t>(El));
    rk.layout_range.assign(static_cast<std::size_t>(El * R), 0);
    for (int e = 0; e < El; ++e) {
      const std::int64_t global = static_cast<std::int64_t>(d) * El + e;
      auto& rows = rk.rows[static_cast<std::size_t>(e)];
      for (int s = 0; s < R; ++s) {
        const Tensor& idx = inputs[static_cast<std::size_t>(s)].topk_idx;
        const std::int64_t begin = static_cast<std::int64_t>(rows.size());
        for (std::int64_t t = 0; t < idx.size(0); ++t)
          for (std::int64_t k = 0; k < idx.size(1); ++k)
            if (id_at(idx, t, k) == global) rows.push_back({s, static_cast<int>(t), static_cast<int>(k)});
        const std::int64_t count = static_cast<std::int64_t>(rows.size()) - begin;
        rk.layout_range[static_cast<std::size_t>(e * R + s)] = begin << 32 | count;
      }
    }
  }
  return out;
}

std::vector<Tensor> reference_low_latency_combine(const std::vector<LowLatencyRankInput>& inputs,
                                                  const std::vector<LowLatencyReferenceRank>& layout,
                                                  const std::vector<Tensor>& expert_out, int num_experts) {
  const int R = static_cast<int>(inputs.size());
  const int El = num_experts / R;
  // (source rank, token, k) -> (expert rank, local expert, row)
  std::map<std::tuple<int, int, int>, std::tuple<int, int, int>> where;
  for (int d = 0; d < R; ++d)
    for (int e = 0; e < El; ++e) {
      const auto& rows = layout[static_cast<std::size_t>(d)].rows[static_cast<std::size_t>(e)];
      for (std::size_t j = 0; j < rows.size(); ++j)
        where[{rows[j].rank, rows[j].token, rows[j].k}] = {d, e, static_cast<int>(j)};
    }
  std::vector<Tensor> out;
  for (int r = 0; r < R; ++r) {
    const auto& in = inputs[static_cast<std::size_t>(r)];
    const std::int64_t T = in.topk_idx.size(0), K = in.topk_idx.size(1);
    const std::int64_t H = expert_out[0].size(2);
    Tensor o = Tensor::empty(DType::bf16, {T, H});
    for (std::int64_t t = 0; t < T; ++t) {
      // The rows this token's slots point at, in ascending k (nullptr for -1).
      std::vector<const bf16_t*> src(static_cast<std::size_t>(K), nullptr);
      for (std::int64_t k = 0; k < K; ++k) {
        if (id_at(in.topk_idx, t, k) < 0) continue;
        const auto it = where.find({r, static_cast<int>(t), static_cast<int>(k)});
        if (it == where.end()) throw std::logic_error("reference: (token, k) missing from the layout");
        const auto [d, e, row] = it->second;
        const Tensor& y = expert_out[static_cast<std::size_t>(d)];
        src[static_cast<std::size_t>(k)] = y.ptr<bf16_t>() + (static_cast<std::int64_t>(e) * y.size(1) + row) * H;
      }
      for (std::int64_t c = 0; c < H; ++c) {
        float acc = 0.0f;
        for (std::int64_t k = 0; k < K; ++k) {
          if (!src[static_cast<std::size_t>(k)]) continue;
          const volatile float prod =
              in.topk_weights.ptr<float>()[t * K + k] * bf16_to_float(src[static_cast<std::size_t>(k)][c]);
          acc = acc + prod;
        }
        o.ptr<bf16_t>()[t * H + c] = float_to_bf16(acc);
      }
    }
    out.push_back(o);
  }
  return out;
}

}  // namespace epmoe::test
