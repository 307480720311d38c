// This machine's physical memory: the bound no host allocation can pass, so settings that would need more are
// named before anything is allocated (an allocator asked for petabytes fails with no word of which setting).
#pragma once

#include <unistd.h>

namespace epmoe {

/// Physical memory in bytes, or 0 when the system does not say.
inline double host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

}  // namespace epmoe
