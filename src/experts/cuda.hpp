// The launchers of the bf16 CUDA experts' elementwise kernels (cuda.cu; CUDA builds only: EPMOE_HAVE_CUDA),
// private to src/experts/. The host side (cuda.cpp, with what both CUDA experts share in cuda_common.cpp)
// checks arguments, owns cuBLAS and the workspaces and calls these. No fmt here: nvcc compiles cuda.cu.
#pragma once

#include <epmoe/experts.hpp>

#include <cstdint>

#include <cuda_runtime.h>

namespace epmoe::experts_cuda {

/// Slot flags of map_ids: all ones when clear, else the smallest offending index.
struct IdFlags {
  unsigned long long bad_id;   ///< flat index m*K+k of the first id outside [-1, limit)
  unsigned long long bad_map;  ///< index of the first expert_map entry outside [-1, E_local)
};

/// local[i] = map ? map[idx[i]] : idx[i] for i < n (ids int64 when idx64 else int32; contiguous), -1 for
/// -1 ids and for out-of-range ids, which are recorded in flags->bad_id (atomicMin). With a map, also
/// checks all map_size entries (flags->bad_map). `flags` must be initialised to all ones.
void map_ids(const void* idx, bool idx64, std::int64_t n, const std::int32_t* map, std::int64_t map_size,
             std::int64_t limit, int e_local, std::int32_t* local, IdFlags* flags, cudaStream_t stream);

/// out[r] = bf16(hidden[r] * (weights ? weights[r * weight_stride] : 1)) for r < rows, H columns;
/// hidden bf16 (fp32 when hidden_fp32). H % 8 == 0.
void prepare_hidden(const void* hidden, bool hidden_fp32, std::int64_t rows, std::int64_t h, const float* weights,
                    std::int64_t weight_stride, void* out, cudaStream_t stream);

/// a[r, j] = bf16(act(g[r, gate(j)], g[r, up(j)])) for r < rows, j < n; g is bf16 [rows, 2n or n].
/// With counts (int32 [rows / max_tokens]), row r = e * max_tokens + t is skipped when t >= counts[e]
/// (clamped to [0, max_tokens]). n % 8 == 0.
void activation(Activation act, const void* g, std::int64_t rows, std::int64_t n, void* a, const std::int32_t* counts,
                std::int64_t max_tokens, cudaStream_t stream);

/// out[o] = src2dst[o] >= 0 ? y[src2dst[o]] : 0 for o < rows (bf16 rows of h, h % 8 == 0).
void gather_rows(const void* y, const std::int32_t* src2dst, std::int64_t rows, std::int64_t h, void* out,
                 cudaStream_t stream);

/// out[r] = y[r] for rows r = e * max_tokens + t with t < counts[e] (clamped); other rows untouched.
void masked_copy(const void* y, const std::int32_t* counts, int e_local, std::int64_t max_tokens, std::int64_t h,
                 void* out, cudaStream_t stream);

/// The combine signal of expert `e` once its rows are stored (stream order; ExpertsInputs::combine_signal): the
/// per-expert form (uint32) adds 1 to entry e; the block form (int32) adds `adds` (its N-tiles, ceil(H / block_n),
/// all stored by now) to each entry e * blocks_per_expert + b with b * block_m < count_e (clamped to max_tokens).
void write_combine_signal(void* signal, bool per_expert, const std::int32_t* count_e, int e, std::int64_t max_tokens,
                          std::int64_t block_m, std::int64_t blocks_per_expert, int adds, cudaStream_t stream);

}  // namespace epmoe::experts_cuda
