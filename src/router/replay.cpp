// Replaying recorded routing (semantics §14).
#include <epmoe/replay.hpp>

#include <cmath>
#include <filesystem>

#include "core/check.hpp"
#include "core/npy.hpp"

namespace epmoe {

namespace {

// A file load_npy refuses (not .npy, truncated, an unsupported dtype or order) is named as the routing argument
// (the CLI's --routing), with the reader's reason, as the checks of the arrays' contents below are.
Tensor load_trace_file(const std::string& path, const char* array) {
  try {
    return load_npy(path);
  } catch (const Error& e) {
    std::string reason = e.what();
    if (reason.starts_with("epmoe: ")) reason.erase(0, 7);
    throw_invalid_argument(fmt::format("routing {}", array),
                           "a .npy file (format 1.0/2.0, little endian, C order) that NumPy can read", reason);
  }
}

/// Which of the `spread` experts trace token `t`'s ids go to: SplitMix64's finalizer of t (Steele, Lea and Flood,
/// "Fast splittable pseudorandom number generators", OOPSLA 2014) modulo spread. `t mod spread` tied the expert to
/// t's residue, which EPLB's replica choice (t mod replicas, semantics §9) also reads: with spread 2 and 2 replicas
/// every token of an expert went to one replica, and a plan with spares balanced worse than none.
std::int64_t spread_slot(std::int64_t t, int spread) {
  std::uint64_t z = static_cast<std::uint64_t>(t) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<std::int64_t>(z % static_cast<std::uint64_t>(spread));
}

}  // namespace

RoutingTrace load_routing_trace(const std::string& dir_or_file, const std::string& domain) {
  namespace fs = std::filesystem;
  RoutingTrace trace;
  std::string idx_path, w_path;
  const std::string suffix = ".topk_idx.npy";
  if (fs::is_directory(dir_or_file)) {
    // A directory named as the file is (a failed download or unpack): said so, not a missing file inside it.
    EPMOE_CHECK_ARG(!fs::path(dir_or_file).filename().string().ends_with(suffix), "routing",
                    "a DOMAIN.topk_idx.npy file", fmt::format("{} (a directory)", dir_or_file));
    trace.domain = domain;
    idx_path = (fs::path(dir_or_file) / (domain + suffix)).string();
  } else {
    const std::string name = fs::path(dir_or_file).filename().string();
    EPMOE_CHECK_ARG(name.size() > suffix.size() && name.ends_with(suffix), "routing",
                    "a directory or a DOMAIN.topk_idx.npy file", dir_or_file);
    trace.domain = name.substr(0, name.size() - suffix.size());
    idx_path = dir_or_file;
  }
  w_path = idx_path.substr(0, idx_path.size() - suffix.size()) + ".topk_weights.npy";
  // A directory's file is named by the domain asked for, which the caller may not have typed (a default): said.
  const std::string of_domain =
      fs::is_directory(dir_or_file) ? fmt::format(" (domain '{}' of that directory)", domain) : std::string();
  for (const std::string* path : {&idx_path, &w_path}) {
    EPMOE_CHECK_ARG(fs::exists(*path), "routing", fmt::format("an existing file {}{}", *path, of_domain),
                    "no such file");
    EPMOE_CHECK_ARG(!fs::is_directory(*path), "routing", fmt::format("a file {}{}", *path, of_domain), "a directory");
  }
  trace.topk_idx = load_trace_file(idx_path, "topk_idx");
  trace.topk_weights = load_trace_file(w_path, "topk_weights");
  EPMOE_CHECK_ARG(trace.topk_idx.dtype() == DType::int16 && trace.topk_idx.shape().ndim() == 3, "routing topk_idx",
                  "int16 [tokens, layers, K]", describe(trace.topk_idx));
  EPMOE_CHECK_ARG(trace.topk_weights.dtype() == DType::fp32 && trace.topk_weights.shape() == trace.topk_idx.shape(),
                  "routing topk_weights", fmt::format("float32 {}", to_string(trace.topk_idx.shape())),
                  describe(trace.topk_weights));
  const std::int64_t T = trace.num_tokens(), L = trace.num_layers(), K = trace.num_topk();
  EPMOE_CHECK_ARG(T >= 1 && L >= 1 && K >= 1, "routing topk_idx", "[tokens, layers, K], each >= 1",
                  describe(trace.topk_idx));
  // Replaying takes tokens modulo the count and uses ids and weights as recorded: a bad value is named
  // here, at its [token, layer, k], rather than surfacing as a wrong layer output or a wrong error metric.
  const auto where = [&](std::int64_t i) { return fmt::format("[{}, {}, {}]", i / (L * K), i / K % L, i % K); };
  const auto* ids = trace.topk_idx.ptr<std::int16_t>();
  const auto* w = trace.topk_weights.ptr<float>();
  for (std::int64_t i = 0; i < trace.topk_idx.numel(); ++i) {
    EPMOE_CHECK_ARG(ids[i] >= -1 && ids[i] < trace.num_experts, "routing topk_idx",
                    fmt::format("ids in [-1, {}) (the recorded model's experts)", trace.num_experts),
                    fmt::format("{} at {}", ids[i], where(i)));
    EPMOE_CHECK_ARG(std::isfinite(w[i]), "routing topk_weights", "finite weights",
                    fmt::format("{} at {}", w[i], where(i)));
    // A top-k choice names distinct experts: a repeat would pass normal mode and be refused by the low-latency
    // dispatch's own check only at run time (semantics §11), not here naming the trace.
    for (std::int64_t j = i - i % K; j < i; ++j)
      EPMOE_CHECK_ARG(ids[i] < 0 || ids[j] != ids[i], "routing topk_idx",
                      "distinct ids within a token's top-k (-1 aside)",
                      fmt::format("{} at {} and at {}", ids[i], where(j), where(i)));
  }
  return trace;
}

ReplayedRouting replay_routing(const RoutingTrace& trace, int layer, std::int64_t offset, int rank, std::int64_t T,
                               int num_experts) {
  EPMOE_CHECK_ARG(layer >= 0 && layer < trace.num_layers(), "layer", fmt::format("in [0, {})", trace.num_layers()), layer);
  EPMOE_CHECK_ARG(offset >= 0, "offset", ">= 0", offset);
  EPMOE_CHECK_ARG(T >= 0, "num_tokens", ">= 0", T);
  EPMOE_CHECK_ARG(num_experts > 0 && num_experts % trace.num_experts == 0, "num_experts",
                  fmt::format("a multiple of the trace's {} experts", trace.num_experts), num_experts);
  const int K = trace.num_topk(), L = trace.num_layers();
  const std::int64_t n = trace.num_tokens();
  const int spread = num_experts / trace.num_experts;
  ReplayedRouting out{Tensor::empty(DType::int64, {T, K}), Tensor::empty(DType::fp32, {T, K})};
  const auto* src_idx = trace.topk_idx.ptr<std::int16_t>();
  const auto* src_w = trace.topk_weights.ptr<float>();
  EPMOE_CHECK_ARG(n >= 1, "trace", "at least one recorded token", n);
  EPMOE_CHECK_ARG(rank >= 0, "rank", ">= 0", rank);
  // Reduced modulo n term by term: offset + rank * T + i may not fit in 64 bits.
  const auto rank_start = static_cast<std::int64_t>((static_cast<unsigned __int128>(rank) * T) % n);
  const std::int64_t first = (offset % n + rank_start) % n;
  for (std::int64_t i = 0; i < T; ++i) {
    const std::int64_t t = (first + i % n) % n;
    for (int k = 0; k < K; ++k) {
      const std::int64_t at = (t * L + layer) * K + k;
      const std::int64_t e = src_idx[at];
      out.topk_idx.ptr<std::int64_t>()[i * K + k] = e < 0 ? -1 : e * spread + spread_slot(t, spread);
      out.topk_weights.ptr<float>()[i * K + k] = src_w[at];
    }
  }
  return out;
}

}  // namespace epmoe
