// Writes small NumPy .npy files (format 1.0, little endian, C order) for tests that need hand-made routing
// traces. Format: https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html (written from
// that page, independently of src/core/npy.cpp's reader).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace epmoe::test {

/// int16 array of `shape` ("<i2"); data.size() must equal the product of shape.
void write_npy_i16(const std::string& path, const std::vector<std::int64_t>& shape,
                   const std::vector<std::int16_t>& data);
/// float32 array of `shape` ("<f4").
void write_npy_f32(const std::string& path, const std::vector<std::int64_t>& shape, const std::vector<float>& data);

/// A routing trace DIR/DOMAIN.topk_idx.npy (int16 [T, L, K]) and DOMAIN.topk_weights.npy (float32, same shape),
/// as include/epmoe/replay.hpp reads it. Creates DIR.
void write_routing_trace(const std::string& dir, const std::string& domain, std::int64_t T, std::int64_t L,
                         std::int64_t K, const std::vector<std::int16_t>& ids, const std::vector<float>& weights);

}  // namespace epmoe::test
