// Expert load statistics and expert-parallel load balancing (semantics §9).
//
// The planner follows DeepSeek's EPLB (github.com/deepseek-ai/EPLB, eplb.py): replicate the hottest
// experts into spare physical slots, then pack physical experts onto GPUs with balanced greedy packing;
// hierarchical (groups -> nodes, replicate within a node, pack to the node's GPUs) when the number of
// nodes divides the number of expert groups. epmoe computes in float64 (DeepSeek: float32) and fixes
// every tie (see rebalance_experts). All of it runs on the host.
#pragma once

#include <epmoe/tensor.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace epmoe {

/// A placement of L layers' E logical experts onto P physical expert slots (row-major arrays).
struct EplbPlan {
  std::int64_t num_layers = 0;            ///< L
  std::int64_t num_logical_experts = 0;   ///< E
  std::int64_t num_physical_experts = 0;  ///< P (slot p lives on GPU p / (P / M))
  std::int64_t max_replicas = 0;          ///< X: most replicas of one expert over all layers (1 when L = 0)
  std::vector<std::int64_t> physical_to_logical;    ///< int64 [L, P]: logical expert held by each slot
  std::vector<std::int64_t> logical_to_physical;    ///< int64 [L, E, X]: slots of each expert, padded with -1
  std::vector<std::int64_t> logical_replica_count;  ///< int64 [L, E]: replicas per expert, >= 1, sums to P
};

/// DeepSeek's EPLB (deepseek-ai/EPLB eplb.py `rebalance_experts`, same arguments and order).
///
/// weight: float64 [L, E] row-major, load of each logical expert (e.g. tokens routed to it), finite, >= 0.
/// num_replicas P: physical expert slots in total, P >= E, P % num_gpus == 0.
/// num_groups G: expert groups (E % G == 0; experts g*E/G .. (g+1)*E/G-1 form group g).
/// num_nodes N: server nodes (num_gpus % N == 0). num_gpus M: GPUs in total (GPU m of node m / (M/N)).
///
/// When G % N == 0 (hierarchical): groups are packed onto nodes (G/N each) by balanced packing of their
/// summed loads; each node's E/N experts get P/N slots, giving one more replica at a time to the expert with
/// the largest load per replica (weight / count); the node's slots are packed onto its M/N GPUs (P/M each)
/// by balanced packing of load per replica. Otherwise the same with one group and one node (global).
/// Balanced packing: items in descending load order go to the lightest pack that still has room.
/// Ties (deterministic): the lower item index comes first among equal loads; the lower pack index among
/// equally light packs; the lower expert index among equal loads per replica. When every pack takes one
/// item, item i goes to pack i (as DeepSeek). A logical expert's replicas are numbered in creation order;
/// logical_to_physical[l, e, r] is the slot of replica r.
///
/// Errors: invalid_argument naming 'weight' (size != L*E, a negative or non-finite load), 'num_layers'
/// (< 0), 'num_logical_experts' (< 1), 'num_replicas' (< E, or not a multiple of num_gpus), 'num_groups'
/// (< 1 or not dividing E), 'num_nodes' (< 1), 'num_gpus' (< 1, or not a multiple of num_nodes).
EplbPlan rebalance_experts(std::span<const double> weight, std::int64_t num_layers, std::int64_t num_logical_experts,
                           std::int64_t num_replicas, std::int64_t num_groups, std::int64_t num_nodes,
                           std::int64_t num_gpus);

/// Maps logical expert ids to physical slots for one layer (the routing step after EPLB).
///
/// topk_idx: int32 or int64 [T, K] on the CPU, logical ids in [0, E) or -1 (kept as -1).
/// logical_to_physical: int64 [L, E, X]; logical_replica_count: int64 [L, E] (as in EplbPlan).
/// Token t's choice e goes to replica (t mod count[layer, e]): deterministic, and it spreads an expert's
/// tokens evenly over its replicas.
/// Returns: a new tensor of topk_idx's dtype and shape [T, K] holding physical slot ids (or -1).
/// Errors: invalid_argument naming 'topk_idx' (not 2-d int32/int64 on the CPU, an id outside [-1, E)),
/// 'layer' (outside [0, L)), 'logical_to_physical' / 'logical_replica_count' (sizes, a count outside
/// [1, X], a needed slot < 0).
Tensor map_to_physical(const TensorView& topk_idx, std::span<const std::int64_t> logical_to_physical,
                       std::span<const std::int64_t> logical_replica_count, std::int64_t num_layers,
                       std::int64_t num_logical_experts, std::int64_t max_replicas, std::int64_t layer);
/// map_to_physical with a plan's arrays.
Tensor map_to_physical(const TensorView& topk_idx, const EplbPlan& plan, std::int64_t layer);

/// Counts tokens per (layer, expert) over the last `window` records of each layer (semantics §9).
///
/// Feed it the num_tokens_per_expert of get_dispatch_layout (host tensors, so recording never waits on a
/// device). Not thread-safe: one recorder per rank, or lock around it.
class ExpertLoadRecorder {
 public:
  /// Errors: invalid_argument naming 'num_layers' (< 1), 'num_experts' (< 1), 'num_ranks' (< 1 or not
  /// dividing num_experts: expert e belongs to rank e / (E/R)), 'window' (< 1).
  ExpertLoadRecorder(std::int64_t num_layers, std::int64_t num_experts, std::int64_t num_ranks, std::int64_t window);

  /// Adds one step's counts for `layer`; the layer's oldest record drops out once it holds `window`.
  /// num_tokens_per_expert: int32 (or int64) [E] on the CPU, tokens, each >= 0.
  /// Errors: invalid_argument naming 'layer' (outside [0, L)) or 'num_tokens_per_expert' (dtype, shape,
  /// device, a negative count).
  void record(std::int64_t layer, const TensorView& num_tokens_per_expert);

  /// int64 [L, E] row-major: tokens per expert summed over each layer's window.
  std::vector<std::int64_t> loads() const;
  /// float64 [L]: mean over ranks of the rank's load / max over ranks (1 = balanced; 1 too for a layer
  /// with no tokens).
  std::vector<double> balancedness() const;
  /// Records in each layer's window (<= window), [L].
  std::vector<std::int64_t> num_records() const;
  /// {"num_layers", "num_experts", "num_ranks", "window", "num_records": [L], "loads": [[E] x L],
  ///  "balancedness": [L]}.
  std::string to_json() const;
  /// Forgets every record.
  void reset();

  std::int64_t num_layers() const { return L_; }
  std::int64_t num_experts() const { return E_; }
  std::int64_t num_ranks() const { return R_; }
  std::int64_t window() const { return W_; }

 private:
  std::int64_t L_, E_, R_, W_;
  std::vector<std::int64_t> history_;  // [L, W, E] ring of records
  std::vector<std::int64_t> sums_;     // [L, E] sum over the ring
  std::vector<std::int64_t> count_;    // [L] records held
  std::vector<std::int64_t> next_;     // [L] ring slot the next record overwrites
};

}  // namespace epmoe
