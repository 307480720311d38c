#include "support/normal_reference.hpp"

#include <epmoe/dtype.hpp>

#include <cstring>
#include <stdexcept>

namespace epmoe::test {

namespace {

std::int64_t id_at(const TensorView& topk_idx, std::int64_t t, std::int64_t k) {
  const std::int64_t off = t * topk_idx.strides[0] + k * topk_idx.strides[1];
  if (topk_idx.dtype == DType::int64) return static_cast<const std::int64_t*>(topk_idx.data)[off];
  return static_cast<const std::int32_t*>(topk_idx.data)[off];
}

/// Does token t of this topk_idx have an expert on rank d?
bool goes_to(const TensorView& topk_idx, std::int64_t t, int d, int experts_per_rank) {
  for (std::int64_t k = 0; k < topk_idx.shape[1]; ++k) {
    const std::int64_t e = id_at(topk_idx, t, k);
    if (e >= 0 && e / experts_per_rank == d) return true;
  }
  return false;
}

/// rows[d] = list of (source rank, source token) in d's recv order.
struct Route {
  int s;
  std::int64_t t;
};
std::vector<std::vector<Route>> routes(const std::vector<Tensor>& topk_idx, int E) {
  const int R = static_cast<int>(topk_idx.size());
  std::vector<std::vector<Route>> rows(static_cast<std::size_t>(R));
  for (int d = 0; d < R; ++d)
    for (int s = 0; s < R; ++s)
      for (std::int64_t t = 0; t < topk_idx[static_cast<std::size_t>(s)].size(0); ++t)
        if (goes_to(topk_idx[static_cast<std::size_t>(s)].view(), t, d, E / R)) rows[static_cast<std::size_t>(d)].push_back({s, t});
  return rows;
}

}  // namespace

RefLayout reference_layout(const TensorView& topk_idx, int E, int R) {
  RefLayout out;
  const std::int64_t T = topk_idx.shape[0], K = topk_idx.shape[1];
  out.num_tokens_per_rank.assign(static_cast<std::size_t>(R), 0);
  out.num_tokens_per_expert.assign(static_cast<std::size_t>(E), 0);
  out.is_token_in_rank.assign(static_cast<std::size_t>(T * R), 0);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t e = id_at(topk_idx, t, k);
      if (e >= 0) ++out.num_tokens_per_expert[static_cast<std::size_t>(e)];
    }
    for (int d = 0; d < R; ++d)
      if (goes_to(topk_idx, t, d, E / R)) {
        out.is_token_in_rank[static_cast<std::size_t>(t * R + d)] = 1;
        ++out.num_tokens_per_rank[static_cast<std::size_t>(d)];
      }
  }
  return out;
}

std::vector<RefDispatchOutput> reference_dispatch(const std::vector<RefDispatchInput>& in, int E, int alignment,
                                                  int num_worst_tokens) {
  const int R = static_cast<int>(in.size());
  const int E_local = E / R;
  std::vector<Tensor> idx;
  for (const auto& r : in) idx.push_back(r.topk_idx);
  const auto rows_of = routes(idx, E);
  std::vector<RefDispatchOutput> out(static_cast<std::size_t>(R));

  // rank_prefix_matrix[s][d] = tokens ranks 0..s send to d.
  std::vector<std::int32_t> prefix(static_cast<std::size_t>(R * R), 0);
  for (int d = 0; d < R; ++d)
    for (const Route& rt : rows_of[static_cast<std::size_t>(d)])
      for (int s = rt.s; s < R; ++s) ++prefix[static_cast<std::size_t>(s * R + d)];

  for (int d = 0; d < R; ++d) {
    RefDispatchOutput& o = out[static_cast<std::size_t>(d)];
    const auto& rows = rows_of[static_cast<std::size_t>(d)];
    o.num_recv_tokens = static_cast<std::int64_t>(rows.size());
    o.rows = num_worst_tokens > 0 ? num_worst_tokens : o.num_recv_tokens;
    o.rank_prefix_matrix = prefix;
    const Tensor& x0 = in[0].x;
    const std::int64_t H = x0.size(1);
    const std::size_t x_row = static_cast<std::size_t>(H) * dtype_size(x0.dtype());
    const bool has_scales = in[0].x_scales.defined();
    const std::size_t s_row = has_scales ? static_cast<std::size_t>(in[0].x_scales.size(1)) * 4 : 0;
    const bool has_topk = in[0].topk_idx.defined();
    const bool has_w = in[0].topk_weights.defined();
    const std::int64_t K = has_topk ? in[0].topk_idx.size(1) : 0;
    o.recv_x.assign(static_cast<std::size_t>(o.rows) * x_row, 0);
    o.recv_x_scales.assign(static_cast<std::size_t>(o.rows) * s_row, 0);
    if (has_topk) o.recv_topk_idx.assign(static_cast<std::size_t>(o.rows * K), -1);
    if (has_w) o.recv_topk_weights.assign(static_cast<std::size_t>(o.rows * K), 0.0f);
    std::vector<std::int64_t> counts(static_cast<std::size_t>(E_local), 0);
    for (std::size_t j = 0; j < rows.size(); ++j) {
      const RefDispatchInput& src = in[static_cast<std::size_t>(rows[j].s)];
      const std::int64_t t = rows[j].t;
      std::memcpy(o.recv_x.data() + j * x_row, static_cast<const std::uint8_t*>(src.x.data()) + t * x_row, x_row);
      if (has_scales)
        std::memcpy(o.recv_x_scales.data() + j * s_row, static_cast<const std::uint8_t*>(src.x_scales.data()) + t * s_row,
                    s_row);
      o.recv_src_idx.push_back(static_cast<std::int32_t>(t));
      o.src_rank.push_back(rows[j].s);
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int64_t e = id_at(src.topk_idx, t, k);
        const bool local = e >= 0 && e / E_local == d;
        o.recv_topk_idx[j * K + k] = local ? e - d * E_local : -1;
        if (has_w) o.recv_topk_weights[j * K + k] = local ? src.topk_weights.ptr<float>()[t * K + k] : 0.0f;
        if (local) ++counts[static_cast<std::size_t>(e - d * E_local)];
      }
    }
    for (std::int64_t c : counts)
      o.num_recv_tokens_per_expert.push_back(static_cast<std::int32_t>((c + alignment - 1) / alignment * alignment));
  }
  // send_pos of each sender: row of its token t in d's recv order.
  for (int s = 0; s < R; ++s) {
    const std::int64_t T = in[static_cast<std::size_t>(s)].x.size(0);
    out[static_cast<std::size_t>(s)].send_pos.assign(static_cast<std::size_t>(T * R), -1);
  }
  for (int d = 0; d < R; ++d) {
    const auto& rows = rows_of[static_cast<std::size_t>(d)];
    for (std::size_t j = 0; j < rows.size(); ++j)
      out[static_cast<std::size_t>(rows[j].s)].send_pos[static_cast<std::size_t>(rows[j].t * R + d)] =
          static_cast<std::int32_t>(j);
  }
  return out;
}

std::vector<RefCombineOutput> reference_combine(const std::vector<Tensor>& topk_idx, int E, const std::vector<Tensor>& y,
                                                const std::vector<Tensor>& weights, const std::vector<Tensor>& bias_0,
                                                const std::vector<Tensor>& bias_1) {
  const int R = static_cast<int>(topk_idx.size());
  const auto rows_of = routes(topk_idx, E);
  const std::int64_t H = y[0].size(1);
  const bool has_w = !weights.empty() && weights[0].defined();
  const std::int64_t K = has_w ? weights[0].size(1) : 0;
  std::vector<RefCombineOutput> out(static_cast<std::size_t>(R));
  // acc[s][t*H + h] in float32, filled in ascending destination rank: that loop order *is* the spec's
  // summation order.
  std::vector<std::vector<float>> acc(static_cast<std::size_t>(R)), accw(static_cast<std::size_t>(R));
  for (int s = 0; s < R; ++s) {
    const std::int64_t T = topk_idx[static_cast<std::size_t>(s)].size(0);
    acc[static_cast<std::size_t>(s)].assign(static_cast<std::size_t>(T * H), 0.0f);
    accw[static_cast<std::size_t>(s)].assign(static_cast<std::size_t>(T * K), 0.0f);
  }
  for (int d = 0; d < R; ++d) {
    const auto& rows = rows_of[static_cast<std::size_t>(d)];
    const auto* yd = y[static_cast<std::size_t>(d)].ptr<bf16_t>();
    for (std::size_t j = 0; j < rows.size(); ++j) {
      float* a = acc[static_cast<std::size_t>(rows[j].s)].data() + rows[j].t * H;
      for (std::int64_t h = 0; h < H; ++h) a[h] += bf16_to_float(yd[static_cast<std::int64_t>(j) * H + h]);
      if (has_w) {
        const float* wd = weights[static_cast<std::size_t>(d)].ptr<float>() + static_cast<std::int64_t>(j) * K;
        float* aw = accw[static_cast<std::size_t>(rows[j].s)].data() + rows[j].t * K;
        for (std::int64_t k = 0; k < K; ++k) aw[k] += wd[k];
      }
    }
  }
  for (int s = 0; s < R; ++s) {
    auto& a = acc[static_cast<std::size_t>(s)];
    auto add_bias = [&](const std::vector<Tensor>& b) {
      if (b.size() <= static_cast<std::size_t>(s) || !b[static_cast<std::size_t>(s)].defined()) return;
      const auto* p = b[static_cast<std::size_t>(s)].ptr<bf16_t>();
      for (std::size_t i = 0; i < a.size(); ++i) a[i] += bf16_to_float(p[i]);
    };
    add_bias(bias_0);
    add_bias(bias_1);
    RefCombineOutput& o = out[static_cast<std::size_t>(s)];
    o.combined_x.resize(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) o.combined_x[i] = float_to_bf16(a[i]).bits;
    o.combined_topk_weights = accw[static_cast<std::size_t>(s)];
  }
  return out;
}

}  // namespace epmoe::test
