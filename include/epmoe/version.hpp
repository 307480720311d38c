// Library version, build facts, and what this machine has.
#pragma once

#include <string_view>

namespace epmoe {

/// "MAJOR.MINOR.PATCH" of the library.
std::string_view version();
/// Whether this build holds the CUDA implementations.
bool built_with_cuda();
/// Visible CUDA devices (0 in CPU-only builds or without a GPU).
int cuda_device_count();
/// This machine's physical memory in bytes (sysconf pages x page size), 0 when the system does not say: the bound no
/// host allocation can pass, so a setting that would need more is named before anything is allocated (an allocator
/// asked for petabytes fails with no word of which setting).
double host_memory_bytes();

}  // namespace epmoe
