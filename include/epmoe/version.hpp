// Library version and build facts.
#pragma once

#include <string_view>

namespace epmoe {

/// "MAJOR.MINOR.PATCH" of the library.
std::string_view version();
/// Whether this build holds the CUDA implementations.
bool built_with_cuda();
/// Visible CUDA devices (0 in CPU-only builds or without a GPU).
int cuda_device_count();

}  // namespace epmoe
