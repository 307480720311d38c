// Minimal reader of NumPy .npy files (format 1.0/2.0, little endian, C order), for replaying
// recorded routing. Format: https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
#pragma once

#include <epmoe/tensor.hpp>

#include <string>

namespace epmoe {

/// Loads a .npy file into a CPU tensor (1 to 4 dimensions; dtypes <i2, <i4, <i8, <f4, |b1, |i1).
/// Errors: unreadable file, bad magic, big-endian or Fortran order, unsupported dtype, a negative or oversized
/// shape, fewer data bytes than the shape needs (checked before allocating).
Tensor load_npy(const std::string& path);

}  // namespace epmoe
