#include <epmoe/version.hpp>

#include <unistd.h>

namespace epmoe {

std::string_view version() { return "0.1.0"; }

bool built_with_cuda() {
#if defined(EPMOE_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

double host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

#if !defined(EPMOE_HAVE_CUDA)
int cuda_device_count() { return 0; }
#endif

}  // namespace epmoe
