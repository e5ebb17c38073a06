// Which element ranges of a shard have arrived. A chunk that arrives twice
// covers the same range twice, which is how a retried chunk counts once.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <utility>

namespace shardopt {

class IntervalSet {
 public:
  // Adds [begin, end).
  void Add(uint64_t begin, uint64_t end);
  // The first sub-range of [begin, end) not covered, if any.
  std::optional<std::pair<uint64_t, uint64_t>> FirstGap(uint64_t begin, uint64_t end) const;
  bool Covers(uint64_t begin, uint64_t end) const { return !FirstGap(begin, end).has_value(); }
  void Clear() { ranges_.clear(); }
  // Disjoint ranges held: what the set's memory grows with.
  size_t size() const { return ranges_.size(); }

 private:
  std::map<uint64_t, uint64_t> ranges_;  // begin -> end, disjoint, not touching
};

}  // namespace shardopt
