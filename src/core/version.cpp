#include <epmoe/version.hpp>

namespace epmoe {

std::string_view version() { return "0.1.0"; }

bool built_with_cuda() {
#if defined(EPMOE_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

#if !defined(EPMOE_HAVE_CUDA)
int cuda_device_count() { return 0; }
#endif

}  // namespace epmoe
