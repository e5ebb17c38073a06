#include "kernels/cpu/param_regions.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardopt::cpu {

absl::StatusOr<std::shared_ptr<uint16_t>> ParamRegions::NewRegion() {
  void* p = std::aligned_alloc(64, kRegion * 2);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", kRegion * 2, " bytes of host memory"));
  }
  return std::shared_ptr<uint16_t>(static_cast<uint16_t*>(p), [](uint16_t* q) { std::free(q); });
}

absl::StatusOr<ParamRegions> ParamRegions::Make(uint64_t numel) {
  ParamRegions out;
  out.numel_ = numel;
  for (uint64_t r = 0; r * kRegion < numel; ++r) {
    SHARDOPT_ASSIGN_OR_RETURN(auto region, NewRegion());
    std::memset(region.get(), 0, kRegion * 2);
    out.regions_.push_back(std::move(region));
  }
  return out;
}

absl::Status ParamRegions::PrepareWrite(uint64_t offset, uint64_t count) {
  if (count == 0) return absl::OkStatus();
  for (uint64_t r = offset / kRegion; r <= (offset + count - 1) / kRegion; ++r) {
    // Only this object creates holds, under the same lock as this call, so
    // a count of 1 cannot grow meanwhile; a count above 1 may be a hold
    // being released, and then the copy is merely not needed.
    if (regions_[r].use_count() == 1) continue;
    SHARDOPT_ASSIGN_OR_RETURN(auto fresh, NewRegion());
    std::memcpy(fresh.get(), regions_[r].get(), RegionLength(r) * 2);
    regions_[r] = std::move(fresh);
  }
  return absl::OkStatus();
}

void ParamRegions::Read(uint64_t offset, uint64_t count, uint16_t* out) const {
  for (uint64_t at = offset; at < offset + count;) {
    const uint64_t n = std::min(offset + count, (at / kRegion + 1) * kRegion) - at;
    std::memcpy(out, At(at), n * 2);
    out += n;
    at += n;
  }
}

Pieces ParamRegions::Hold(uint64_t offset, uint64_t count) const {
  auto held = std::make_shared<std::vector<std::shared_ptr<uint16_t>>>();
  std::vector<absl::string_view> pieces;
  for (uint64_t at = offset; at < offset + count;) {
    const uint64_t n = std::min(offset + count, (at / kRegion + 1) * kRegion) - at;
    held->push_back(regions_[at / kRegion]);
    pieces.emplace_back(reinterpret_cast<const char*>(At(at)), n * 2);
    at += n;
  }
  return Pieces(std::move(pieces), std::move(held));
}

}  // namespace shardopt::cpu
