// Expert load statistics and expert-parallel load balancing (semantics §9).
//
// The planner follows DeepSeek's EPLB (github.com/deepseek-ai/EPLB, eplb.py): replicate the hottest
// experts into spare physical slots, then pack physical experts onto GPUs with balanced greedy packing;
// hierarchical (groups -> nodes, replicate within a node, pack to the node's GPUs) when the number of
// nodes divides the number of expert groups. epmoe computes in float64 (DeepSeek: float32) and fixes
// every tie (see rebalance_experts). The planner runs on the host; the load recorder and map_to_physical also run
// on a GPU (a device-side window; a CUDA kernel for the mapping the layer applies).
#pragma once

#include <epmoe/tensor.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
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

/// Folds loads counted per physical slot (int64 [L, P] row-major, e.g. an ExpertLoadRecorder's loads under a plan:
/// the dispatch routed physical slots) back to the logical experts: int64 [L, E], entry [l, e] the sum over e's
/// replicas (plan.physical_to_logical). The weight rebalance_experts plans the next placement from (SGLang's
/// recorder does the same fold with its physical_to_logical map). Errors: invalid_argument naming
/// 'physical_loads' (size != L * P, a negative count) or 'plan' (a slot's logical expert outside [0, E)).
std::vector<std::int64_t> logical_loads(const EplbPlan& plan, std::span<const std::int64_t> physical_loads);

class Group;  // group.hpp

/// Counts tokens per (layer, expert) over the last `window` records of each layer (semantics §9).
///
/// What a record holds: one [E] row of tokens per expert for one step of one layer. MoELayer::set_load_recorder
/// feeds it the counts of the experts this rank RECEIVED tokens for (the dispatch's expert_num_tokens: the normal
/// mode's num_recv_tokens_per_expert, the low-latency mode's masked_m / packed_recv_count, the no-EP counts),
/// placed at this rank's experts [rank * E_local, (rank + 1) * E_local) with zeros elsewhere, as SGLang's
/// expert distribution recorder does. So each rank's record holds its own experts' loads only, and
/// global_loads(group) (the sum of every rank's loads()) holds the loads of all E experts over all ranks: the
/// weight rebalance_experts plans from. Counting the received tokens needs nothing beyond what the dispatch
/// already produced (no extra kernel over topk_idx, no synchronisation). The ids counted are those the dispatch
/// routed: physical slots when the caller maps logical ids to replicas first.
///
/// Where the counts live: a recorder made on a CUDA device keeps its whole state (a ring of [L, W, E] int64
/// records, the [L, E] sums and each layer's record count and next ring slot) on that GPU; record() is then one
/// small kernel on the calling thread's current stream that reads the slot from device memory and advances it,
/// so recording never synchronises, and a forward captured in a CUDA graph records into the next slot on every
/// replay. Record, reset and read on one stream (or streams ordered with it). Reading (loads, num_records,
/// balancedness, to_json, global_loads) copies to the host and waits for the current stream; loads_view()
/// gives the device sums without waiting.
///
/// Not thread-safe: one recorder per rank (shared by that rank's layers), or lock around it.
class ExpertLoadRecorder {
 public:
  /// device: where the state lives and where recorded counts must be (the CPU, or the GPU of a CUDA layer).
  /// On a GPU the state is allocated and zeroed on the current stream, which is then synchronised once.
  /// Errors: invalid_argument naming 'num_layers' (< 1), 'num_experts' (< 1), 'num_ranks' (< 1 or not
  /// dividing num_experts: expert e belongs to rank e / (E/R)), 'window' (< 1); unsupported for a CUDA device in
  /// a build without CUDA.
  ExpertLoadRecorder(std::int64_t num_layers, std::int64_t num_experts, std::int64_t num_ranks, std::int64_t window,
                     Device device = Device::cpu());

  /// Adds one step's counts for `layer`; the layer's oldest record drops out once it holds `window`.
  /// num_tokens_per_expert: int32 or int64 [E] on device() (e.g. get_dispatch_layout's), tokens, each >= 0 (a CPU
  /// record checks it; a GPU record is not read by the host).
  /// Errors: invalid_argument naming 'layer' (outside [0, L)) or 'num_tokens_per_expert' (dtype, shape, device,
  /// a negative count); a rejected record changes nothing.
  void record(std::int64_t layer, const TensorView& num_tokens_per_expert);
  /// The same for a record known for experts [expert_offset, expert_offset + n) only (one rank's local experts,
  /// what MoELayer records): counts int32 or int64 [n] on device(); the record's other experts get 0.
  /// Errors: as record, and 'expert_offset' (< 0, or expert_offset + n > E).
  void record_local(std::int64_t layer, const TensorView& num_recv_tokens_per_expert, std::int64_t expert_offset);

  /// int64 [L, E] row-major: tokens per expert summed over each layer's window (this rank's records).
  /// CUDA: a copy to the host that waits for the current stream.
  std::vector<std::int64_t> loads() const;
  /// The [L, E] int64 sums where they live (device()), contiguous, valid as long as the recorder; on a GPU they
  /// are complete once the current stream reaches the point where this is called.
  TensorView loads_view() const;
  /// Collective over `group` (every rank calls it, each with its own recorder of the same L and E): int64
  /// [L, E], the sum over ranks of loads() (one Group::all_gather). With the recorders a MoELayer feeds, these
  /// are the loads of every expert over all ranks. Errors: rank_mismatch when the ranks' L or E differ.
  std::vector<std::int64_t> global_loads(Group& group) const;
  /// float64 [L]: mean over ranks of the rank's load / max over ranks (1 = balanced; 1 too for a layer
  /// with no tokens), of loads(). For the recorders a MoELayer feeds, use load_balancedness(global_loads(g), ..).
  std::vector<double> balancedness() const;
  /// Records in each layer's window (<= window), [L].
  std::vector<std::int64_t> num_records() const;
  /// {"num_layers", "num_experts", "num_ranks", "window", "num_records": [L], "loads": [[E] x L],
  ///  "balancedness": [L]}, of this rank's records.
  std::string to_json() const;
  /// The same with the global loads (collective, as global_loads) and their balancedness; num_records is this
  /// rank's (every rank records each forward once, so they agree).
  std::string to_json(Group& group) const;
  /// Forgets every record (CUDA: a memset on the current stream).
  void reset();

  std::int64_t num_layers() const { return L_; }
  std::int64_t num_experts() const { return E_; }
  std::int64_t num_ranks() const { return R_; }
  std::int64_t window() const { return W_; }
  Device device() const { return device_; }

 private:
  std::int64_t L_, E_, R_, W_;
  Device device_;
  // On device_: [L, W, E] ring of records; [L, E] sums over the ring; [2, L]: records held, ring slot the next
  // record overwrites.
  Tensor history_, sums_, state_;
  std::string json_of(const std::vector<std::int64_t>& loads) const;
  void add(std::int64_t layer, const TensorView& counts, std::int64_t expert_offset, std::string_view name);
};

/// float64 [L]: balancedness of int64 [L, E] loads over `num_ranks` ranks (expert e on rank e / (E/R)): mean
/// over ranks of a rank's load / max (1 when a layer has no tokens). Errors: invalid_argument naming 'loads'
/// (size != L * E), 'num_layers', 'num_experts', 'num_ranks' (as ExpertLoadRecorder).
std::vector<double> load_balancedness(std::span<const std::int64_t> loads, std::int64_t num_layers,
                                      std::int64_t num_experts, std::int64_t num_ranks);

}  // namespace epmoe
