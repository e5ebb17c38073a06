// Which ranks contribute to a shard in a step, for the backend parity tests
// (CUDA on a device, and its host emulation): all, one, the two ends, all
// but the first, in turn, so that every aggregation path runs.
#pragma once

#include <cstdint>
#include <vector>

namespace shardopt::testing {

inline std::vector<uint32_t> RankPattern(uint32_t world, uint64_t turn) {
  std::vector<uint32_t> ranks;
  switch (turn % 4) {
    case 0:
      for (uint32_t r = 0; r < world; ++r) ranks.push_back(r);
      break;
    case 1:
      ranks.push_back(static_cast<uint32_t>(turn / 4 % world));
      break;
    case 2:
      ranks.push_back(0);
      if (world > 1) ranks.push_back(world - 1);
      break;
    default:
      for (uint32_t r = world > 1 ? 1 : 0; r < world; ++r) ranks.push_back(r);
  }
  return ranks;
}

}  // namespace shardopt::testing
