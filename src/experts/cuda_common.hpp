// What the bf16 (cuda.cpp) and fp8 (cuda_fp8.cpp) CUDA experts share on the host (CUDA builds only): the checked
// call, the Experts object around it, the Standard format's id and layout phase with its one synchronisation,
// side streams, cuBLAS errors, and stream-ordered workspaces from a per-device pool that never trims (repeated
// calls reuse memory; the BatchedExperts path stays capturable in a CUDA graph).
#pragma once

#include <epmoe/experts.hpp>
#include <epmoe/permute.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include <cublas_api.h>
#include <cuda_runtime.h>

#include "experts/cuda.hpp"
#include "experts/problem.hpp"

namespace epmoe::experts_cuda {

inline constexpr std::size_t kWorkspaceAlign = 256;  // bytes; every carved buffer starts on this boundary

/// The experts' memory pool of `device` (created once; release threshold: never).
cudaMemPool_t workspace_pool(int device);

/// A stream-ordered allocation of `bytes` from workspace_pool, freed on the same stream when the scope ends.
/// Errors: out_of_memory naming the size and device.
class Workspace {
 public:
  Workspace(int device, std::size_t bytes, cudaStream_t stream);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  char* at(std::size_t offset) const { return static_cast<char*>(data_) + offset; }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

/// Offsets of several buffers inside one allocation (each kWorkspaceAlign-aligned); `size` is the total.
struct Carve {
  std::size_t size = 0;
  std::size_t take(std::size_t bytes) {
    const std::size_t offset = (size + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
    size = offset + bytes;
    return offset;
  }
};

// ---- cuBLAS and streams ------------------------------------------------------------------------------------

/// Throws epmoe::Error naming the call, the status and the location: unsupported for CUBLAS_STATUS_NOT_SUPPORTED,
/// else internal.
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line);

#define EPMOE_CUBLAS_CHECK(expr)                                                       \
  do {                                                                                 \
    const cublasStatus_t epmoe_status_ = (expr);                                       \
    if (epmoe_status_ != CUBLAS_STATUS_SUCCESS)                                        \
      ::epmoe::experts_cuda::throw_cublas_error(epmoe_status_, #expr, __FILE__, __LINE__); \
  } while (0)

/// Raises unsupported when `s` is capturing a CUDA graph: `who` (e.g. "CUDA experts") creates its `library`
/// handle (cuBLAS, cuBLASLt) in a thread's first apply() on `device`, which a capture cannot record.
void refuse_capture_of_first_use(cudaStream_t s, int device, std::string_view who, std::string_view library);

inline constexpr int kSideStreams = 4;

/// Side streams a layer's per-expert GEMMs can be spread over, forked from and joined back into the caller's
/// stream with events (so it also works inside a CUDA graph capture). Per host thread and device; never
/// destroyed (destroying them at thread or process exit may run after the CUDA context is gone).
struct SideStreams {
  std::array<cudaStream_t, kSideStreams> side{};
  cudaEvent_t fork_event = nullptr;
  std::array<cudaEvent_t, kSideStreams> join_event{};

  /// Creates the streams and events once.
  void create();
  /// Side streams 0..n-1 wait for the work enqueued on `main` so far.
  void fork(cudaStream_t main, int n) const;
  /// `main` waits for the work enqueued on side streams 0..n-1.
  void join(cudaStream_t main, int n) const;
};

// ---- the checked call ---------------------------------------------------------------------------------------

/// One checked call of the CUDA experts: the sizes and the caller's tensors, as given.
struct CudaProblem : ExpertsSizes {
  Activation act = Activation::silu;
  TensorView hidden, w1, w2, topk_weights, topk_idx, expert_map, counts;
  TensorView hidden_scales, w1_scales, w2_scales;  ///< fp8_block
  bool hidden_fp8 = false;                          ///< fp8_block: hidden in fp8, with hidden_scales
};

/// The problem of `in`, whose checks established `sizes`.
CudaProblem cuda_problem(const ExpertsInputs& in, const ExpertsSizes& sizes);

/// The Experts object of both CUDA experts: the checks, the output tensor and the dispatch on the format. The
/// batched format runs whenever its slabs have rows (all-zero counts are only known on the device).
class CudaExpertsBase : public Experts {
 public:
  using Experts::Experts;
  std::string_view name() const override { return "cuda"; }
  Shape output_shape(const ExpertsInputs& in) const override;
  void apply(const ExpertsInputs& in, const TensorView& out) const override;
  Tensor apply(const ExpertsInputs& in) const override;

 protected:
  /// Everything ExpertsInputs can get wrong, checked on the host without reading device memory.
  virtual CudaProblem check(const ExpertsInputs& in) const = 0;
  virtual void run_standard(const CudaProblem& p, const TensorView& out) const = 0;
  virtual void run_batched(const CudaProblem& p, const TensorView& out) const = 0;
  void run(const ExpertsProblem&, const TensorView&) const override;

 private:
  void check_out(const CudaProblem& p, const TensorView& out) const;
};

// ---- the Standard format's first phase ----------------------------------------------------------------------

/// The routing of a Standard-format call on the device: local ids (topk_idx through expert_map, ids and map
/// entries checked by map_ids) and their permute layout, segments padded to `alignment` rows. The ids are only
/// known after the one synchronisation, segment_starts().
class StandardRouting {
 public:
  /// Reserves the buffers in `c`, the carve of the caller's first workspace.
  StandardRouting(const CudaProblem& p, int alignment, Carve& c);
  /// Enqueues the id mapping and the layout on `s`, in `w` (the workspace of the carve).
  void enqueue(const Workspace& w, cudaStream_t s);
  /// Rows of the permuted layout (permute_capacity).
  std::int64_t capacity() const { return layout_.capacity; }
  const PermuteLayout& layout() const { return layout_; }
  /// Device int64 [E_local + 1]: expert e's permuted rows start at seg()[e].
  const std::int64_t* seg() const { return seg_; }
  /// The one synchronisation (the GEMMs need each expert's row count on the host): invalid_argument naming the
  /// first id or map entry out of range, else seg() on the host (start[E_local] = the rows in use).
  std::vector<std::int64_t> segment_starts(cudaStream_t s) const;
  /// Back to token order: out = the weighted sum of each token's expert rows of y (bf16 [capacity, H]), or, with
  /// the unreduced format or the weight already on the input (K == 1), each slot's expert row (zero without one).
  void to_token_order(const void* y, const TensorView& out, cudaStream_t s) const;

 private:
  [[noreturn]] void report_bad_ids(const IdFlags& flags) const;

  const CudaProblem& p_;
  std::size_t o_flags_, o_counts_, o_local_, o_src2dst_, o_dst2src_, o_reorder_, o_layout_;
  IdFlags* flags_ = nullptr;
  std::int64_t* seg_ = nullptr;  // right after the flags: one copy brings both to the host
  PermuteLayout layout_;
};

}  // namespace epmoe::experts_cuda
