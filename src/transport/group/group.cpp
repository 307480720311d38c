// Group::check_agreement and the default Group::reduce_scatter_sum, shared by every Group backend.
#include "core/check.hpp"
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>

#include <array>
#include <cstring>

namespace epmoe {

namespace {
constexpr std::size_t kMaxSettings = 16;
// Names are compared by hash so a rank that checks a different list is caught too.
std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}
struct Packet {
  std::int64_t count;
  std::array<std::uint64_t, kMaxSettings> name_hash;
  std::array<std::int64_t, kMaxSettings> value;
};
}  // namespace

void Group::check_agreement(std::span<const Setting> settings, std::string_view phase) {
  EPMOE_ASSERT(settings.size() <= kMaxSettings);
  Packet mine{};
  mine.count = static_cast<std::int64_t>(settings.size());
  for (std::size_t i = 0; i < settings.size(); ++i) {
    mine.name_hash[i] = fnv1a(settings[i].name);
    mine.value[i] = settings[i].value;
  }
  std::vector<Packet> all(static_cast<std::size_t>(size()));
  all_gather(&mine, all.data(), sizeof(Packet), phase);
  // Every rank scans the same gathered data in the same order, so every rank reports the same error.
  for (int r = 0; r < size(); ++r) {
    const Packet& p = all[static_cast<std::size_t>(r)];
    if (p.count != all[0].count || p.name_hash != all[0].name_hash)
      raise(ErrorCode::rank_mismatch, "rank {}: ranks 0 and {} check different settings in phase '{}'", rank(), r, phase);
    for (std::size_t i = 0; i < settings.size(); ++i) {
      if (p.value[i] != all[0].value[i])
        raise(ErrorCode::rank_mismatch,
              "rank {}: setting '{}' must be equal on all ranks (phase '{}'): rank 0 has {}, rank {} has {}", rank(),
              settings[i].name, phase, all[0].value[i], r, p.value[i]);
    }
  }
}

void Group::reduce_scatter_sum(const float* send, float* recv, std::size_t count, std::string_view phase) {
  EPMOE_CHECK_ARG(count == 0 || (send != nullptr && recv != nullptr), "send/recv", "non-null pointers", "null");
  const std::size_t R = static_cast<std::size_t>(size()), me = static_cast<std::size_t>(rank());
  // Everything to everyone: simple and correct for any backend that only has all_gather.
  std::vector<float> all(R * R * count);
  all_gather(send, all.data(), R * count * sizeof(float), phase);
  for (std::size_t i = 0; i < count; ++i) {
    float acc = all[me * count + i];
    for (std::size_t q = 1; q < R; ++q) acc += all[(q * R + me) * count + i];
    recv[i] = acc;
  }
}

}  // namespace epmoe
