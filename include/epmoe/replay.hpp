// Replaying recorded routing (semantics §14): real router decisions instead of random ones.
//
// The recorded data set (the project's shared/data/olmoe-routing beside this repository; a slice of it is
// in tests/data/olmoe-routing, made by scripts/make_routing_slice.py; see its README) holds, per domain,
// topk_idx int16 [tokens, layers, K] and topk_weights float32 [tokens, layers, K] of OLMoE-1B-7B (64
// experts, top-8, 16 layers).
#pragma once

#include <epmoe/tensor.hpp>

#include <string>

namespace epmoe {

/// One domain of recorded routing, all layers.
struct RoutingTrace {
  std::string domain;
  Tensor topk_idx;      ///< int16 [tokens, layers, K]
  Tensor topk_weights;  ///< float32 [tokens, layers, K]
  int num_experts = 64; ///< experts of the recorded model
  std::int64_t num_tokens() const { return topk_idx.size(0); }
  int num_layers() const { return static_cast<int>(topk_idx.size(1)); }
  int num_topk() const { return static_cast<int>(topk_idx.size(2)); }
};

/// Loads `domain` from a directory holding DOMAIN.topk_idx.npy and DOMAIN.topk_weights.npy, or from
/// a path to a DOMAIN.topk_idx.npy file (the weights file is found beside it; domain is then taken
/// from the file name). Errors: invalid_argument naming 'routing' (the CLI's --routing) for missing files, files
/// that are not readable .npy (format 1.0/2.0, little endian, C order; the reader's reason given), wrong dtypes,
/// empty or disagreeing shapes, and the first id out of [-1, 64), non-finite weight or id repeated within a token's
/// top-k at its [token, layer, k].
RoutingTrace load_routing_trace(const std::string& dir_or_file, const std::string& domain = "general");

/// Routing of one rank, replayed from a trace (semantics §14): rank r gets the consecutive tokens
/// [offset + r*T, offset + (r+1)*T) of `layer` (indices wrap around the trace's end). Weights are
/// used as recorded. For num_experts a multiple of the trace's 64, id e of token t becomes
/// e * (E/64) + (splitmix64(t) mod (E/64)), which keeps the skew and does not follow t's residue (EPLB's replica
/// choice reads that). Returns topk_idx int64 [T, K] and
/// topk_weights float32 [T, K]. Errors: layer out of range, E not a multiple of 64, negative offset.
struct ReplayedRouting {
  Tensor topk_idx;
  Tensor topk_weights;
};
ReplayedRouting replay_routing(const RoutingTrace& trace, int layer, std::int64_t offset, int rank, std::int64_t T,
                               int num_experts);

}  // namespace epmoe
