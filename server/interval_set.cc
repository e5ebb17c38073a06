#include "server/interval_set.h"

#include <algorithm>

namespace shardopt {

void IntervalSet::Add(uint64_t begin, uint64_t end) {
  if (begin >= end) return;
  auto it = ranges_.upper_bound(begin);
  if (it != ranges_.begin()) {
    auto prev = std::prev(it);
    if (prev->second >= begin) {  // overlaps or touches the one before
      begin = prev->first;
      end = std::max(end, prev->second);
      it = ranges_.erase(prev);
    }
  }
  while (it != ranges_.end() && it->first <= end) {
    end = std::max(end, it->second);
    it = ranges_.erase(it);
  }
  ranges_.emplace(begin, end);
}

std::optional<std::pair<uint64_t, uint64_t>> IntervalSet::FirstGap(uint64_t begin, uint64_t end) const {
  uint64_t pos = begin;
  auto it = ranges_.upper_bound(pos);
  if (it != ranges_.begin()) {
    auto prev = std::prev(it);
    if (prev->second > pos) pos = prev->second;
  }
  if (pos >= end) return std::nullopt;
  const uint64_t gap_end = it == ranges_.end() ? end : std::min(end, it->first);
  return std::make_pair(pos, gap_end);
}

}  // namespace shardopt
