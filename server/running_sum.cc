#include "server/running_sum.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "base/status_macros.h"

namespace shardopt {

RunningSum::RunningSum(std::vector<uint64_t> shard_lengths, uint32_t world_size, uint64_t window_cap_bytes)
    : lengths_(std::move(shard_lengths)), world_size_(world_size), window_cap_(window_cap_bytes),
      ranks_(world_size) {
  for (uint64_t n : lengths_) blocks_.emplace_back((n + kBlock - 1) / kBlock);
  newly_next_.reserve(world_size);
}

uint64_t RunningSum::BlockEnd(uint32_t shard, uint64_t block) const {
  return std::min(lengths_[shard], (block + 1) * kBlock);
}

bool RunningSum::no_grad(uint32_t rank, uint32_t shard) const {
  return ranks_[rank].finished && ranks_[rank].no_grad[shard];
}

namespace {
// What the bookkeeping's containers cost, allocator overhead included: a
// std::map node of IntervalSet, and a slot of the rank's offered map (at
// most half full, so twice the slot).
constexpr uint64_t kNodeBytes = 64;
constexpr uint64_t kEntryBytes = 2 * (sizeof(uint32_t) + sizeof(IntervalSet) + 8);
}  // namespace

const IntervalSet* RunningSum::OfferedOf(const RankState& rank, uint32_t shard) {
  auto it = rank.offered.find(shard);
  return it == rank.offered.end() ? nullptr : &it->second;
}

std::optional<std::pair<uint64_t, uint64_t>> RunningSum::FirstGap(uint32_t rank, uint32_t shard) const {
  const IntervalSet* offered = OfferedOf(ranks_[rank], shard);
  if (offered == nullptr) return std::make_pair(uint64_t{0}, lengths_[shard]);
  return offered->FirstGap(0, lengths_[shard]);
}

uint64_t RunningSum::FixedBytes(const std::vector<uint64_t>& lengths, uint32_t world_size) {
  uint64_t bytes = uint64_t{world_size} * (sizeof(RankState) + sizeof(uint32_t));
  for (uint64_t n : lengths) bytes += (n + kBlock - 1) / kBlock * sizeof(Block) + sizeof(std::vector<Block>);
  return bytes;
}

uint64_t RunningSum::MaxGrowth() const { return kEntryBytes + kNodeBytes + (lengths_.size() + 7) / 8 + 64; }

absl::Status RunningSum::Fold(JobState& state, uint32_t shard, Block& block, uint64_t offset, DType dtype,
                              absl::Span<const absl::string_view> runs, RankState& rank) {
  // The first rank in the block's sum sets it: adding to a zero would turn a
  // -0 gradient into +0, which keeping the ranks apart never did.
  SHARDOPT_RETURN_IF_ERROR(state.AccumulateGrad(shard, offset, dtype, runs, !block.any));
  rank.folded = true;
  ++progress_;
  return absl::OkStatus();
}

absl::StatusOr<RunningSum::Offered> RunningSum::Offer(JobState& state, uint32_t rank, uint32_t shard,
                                                      uint64_t offset, DType dtype, const Pieces& data) {
  RankState& r = ranks_[rank];
  const auto emplaced = r.offered.try_emplace(shard);
  const bool added = emplaced.second;
  IntervalSet& offered = emplaced.first->second;
  const size_t nodes_before = offered.size();
  // An Offer adds one contiguous range: at most one entry and one node.
  absl::Cleanup account = [&] {
    growing_bytes_ += (added ? kEntryBytes : 0) + kNodeBytes * offered.size();
    growing_bytes_ -= kNodeBytes * nodes_before;
  };
  const uint64_t esize = DTypeSize(dtype);
  const uint64_t count = data.size() / esize;
  const uint64_t end = offset + count;
  for (uint64_t pos = offset; pos < end;) {
    const uint64_t k = pos / kBlock;
    const uint64_t stop = std::min(end, BlockEnd(shard, k));
    Block& b = blocks_[shard][k];
    if (rank >= b.next) {
      // What of [pos, stop) this rank has not offered before.
      std::vector<std::pair<uint64_t, uint64_t>> gaps;
      for (uint64_t at = pos; at < stop;) {
        auto gap = offered.FirstGap(at, stop);
        if (!gap) break;
        gaps.push_back(*gap);
        at = gap->second;
      }
      if (rank == b.next) {
        for (const auto& [g0, g1] : gaps) {
          data.Sub((g0 - offset) * esize, (g1 - g0) * esize).Runs(esize, &runs_, &split_);
          SHARDOPT_RETURN_IF_ERROR(Fold(state, shard, b, g0, dtype, runs_, r));
        }
        offered.Add(pos, stop);
        SHARDOPT_RETURN_IF_ERROR(Advance(state, shard, k));
      } else {
        // What the window holds counts its entries too: many tiny chunks
        // must not hold much more than the cap.
        uint64_t bytes = 0;
        for (const auto& [g0, g1] : gaps) bytes += (g1 - g0) * esize + sizeof(Waiting);
        if (bytes > 0 && window_bytes_ + bytes > window_cap_) return Offered{pos - offset, true};
        // Copied rather than held as the message's slices: a slice pins the
        // whole read buffer of gRPC's it lies in, so holding them would let
        // the window hold more than it counts.
        for (const auto& [g0, g1] : gaps) {
          std::string bytes((g1 - g0) * esize, '\0');
          data.Sub((g0 - offset) * esize, bytes.size()).CopyTo(bytes.data());
          window_[Key(shard, k)].push_back({rank, g0, dtype, std::move(bytes)});
        }
        window_bytes_ += bytes;
        offered.Add(pos, stop);
        ++progress_;
      }
    }
    // rank < b.next: this rank is in the block's sum already; a retry.
    pos = stop;
  }
  return Offered{count, false};
}

absl::Status RunningSum::Advance(JobState& state, uint32_t shard, uint64_t k) {
  Block& b = blocks_[shard][k];
  const uint64_t begin = k * kBlock, end = BlockEnd(shard, k);
  const uint32_t was = b.next;
  while (b.next < world_size_) {
    RankState& r = ranks_[b.next];
    if (r.finished && r.no_grad[shard]) {
      ++b.next;
      continue;
    }
    if (auto it = window_.find(Key(shard, k)); it != window_.end()) {
      std::vector<Waiting>& waiting = it->second;
      // Each rank's windowed ranges are disjoint: fold them in any order.
      auto mine = std::stable_partition(waiting.begin(), waiting.end(),
                                        [&](const Waiting& w) { return w.rank != b.next; });
      for (auto w = mine; w != waiting.end(); ++w) {
        const absl::string_view bytes = w->bytes;
        SHARDOPT_RETURN_IF_ERROR(Fold(state, shard, b, w->offset, w->dtype, {&bytes, 1}, r));
        window_bytes_ -= w->bytes.size() + sizeof(Waiting);
      }
      waiting.erase(mine, waiting.end());
      if (waiting.empty()) window_.erase(it);
    }
    if (const IntervalSet* offered = OfferedOf(r, shard); offered == nullptr || !offered->Covers(begin, end)) break;
    b.any = true;
    ++b.next;
  }
  // The block's sum just became final: the backend may take its sum of
  // squares now, while it is hot, instead of at the barrier.
  if (was < world_size_ && b.next == world_size_ && b.any) state.GradBlockDone(shard, begin, end - begin);
  if (b.next != was && b.next < world_size_ && !ranks_[b.next].newly_next) {
    ranks_[b.next].newly_next = true;
    newly_next_.push_back(b.next);
  }
  return absl::OkStatus();
}

void RunningSum::DrainNewlyNext(const std::function<void(uint32_t rank)>& fn) {
  for (uint32_t r : newly_next_) {
    ranks_[r].newly_next = false;
    fn(r);
  }
  newly_next_.clear();  // keeps its capacity, reserved for every rank
}

absl::Status RunningSum::Finish(JobState& state, uint32_t rank, std::vector<bool> no_grad) {
  RankState& r = ranks_[rank];
  r.finished = true;
  r.no_grad = std::move(no_grad);
  while (lowest_unfinished_ < world_size_ && ranks_[lowest_unfinished_].finished) ++lowest_unfinished_;
  growing_bytes_ += (r.no_grad.size() + 7) / 8 + 64;
  for (uint32_t s = 0; s < blocks_.size(); ++s) {
    for (uint64_t k = 0; k < blocks_[s].size(); ++k) {
      if (blocks_[s][k].next == rank) SHARDOPT_RETURN_IF_ERROR(Advance(state, s, k));
    }
  }
  ++progress_;
  return absl::OkStatus();
}

bool RunningSum::Withdraw(uint32_t rank) {
  RankState& r = ranks_[rank];
  if (r.folded || r.finished) return false;
  for (auto it = window_.begin(); it != window_.end();) {
    std::vector<Waiting>& waiting = it->second;
    auto mine = std::stable_partition(waiting.begin(), waiting.end(), [&](const Waiting& w) { return w.rank != rank; });
    for (auto w = mine; w != waiting.end(); ++w) window_bytes_ -= w->bytes.size() + sizeof(Waiting);
    waiting.erase(mine, waiting.end());
    if (waiting.empty()) {
      window_.erase(it++);
    } else {
      ++it;
    }
  }
  for (const auto& [shard, offered] : r.offered) growing_bytes_ -= kEntryBytes + kNodeBytes * offered.size();
  r.offered.clear();
  ++progress_;
  return true;
}

bool RunningSum::Complete() const {
  for (const auto& shard : blocks_) {
    for (const Block& b : shard) {
      if (b.next < world_size_) return false;
    }
  }
  return true;
}

bool RunningSum::Contributed(uint32_t shard) const {
  for (const RankState& r : ranks_) {
    if (r.finished && !r.no_grad[shard]) return true;
  }
  return false;
}


}  // namespace shardopt
