// One barrier round's gradient on this server: every rank's chunks folded
// into one running fp32 sum as they arrive, in rank order per block of
// elements, so that the result is bitwise the sum of the ranks' gradients
// added in rank order (what keeping every rank apart gave) while staging
// stays 4 B/param whatever the number of ranks.
//
// A block's sum takes rank r once ranks 0..r-1 are in it (or have declared
// the tensor without a gradient). A chunk of a rank that is not yet next
// waits in a window capped in bytes; when it is full the offer stops, and
// the push waits (gRPC's flow control then holds the sender back). The rank
// that is next in a block never needs the window, so the lowest unfinished
// rank always progresses. If every rank sends its ranges in the same order,
// the ranks stream at once as a wavefront.
//
// Not thread-safe: used under its job's lock.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "base/pieces.h"
#include "server/interval_set.h"

namespace shardopt {

class RunningSum {
 public:
  // Elements per block: the unit of rank order.
  static constexpr uint64_t kBlock = kApplyAlignment;
  // The least window a job is given: two blocks of fp32 with their entries,
  // so that a rank that is not next can always take a block ahead. (One
  // block's bytes alone never fit it: the entry counts too.)
  static constexpr uint64_t MinWindowBytes() { return 2 * (kBlock * 4 + sizeof(Waiting)); }

  RunningSum(std::vector<uint64_t> shard_lengths, uint32_t world_size, uint64_t window_cap_bytes);

  struct Offered {
    uint64_t taken = 0;        // elements from the start dealt with
    bool window_full = false;  // the rest must wait for the window to drain
  };
  // Offers rank `rank`'s elements of shard `shard` from `offset` on (shard
  // coordinates; `data` holds whole elements of `dtype`): folds into `state`
  // what is next in rank order, straight from `data`'s pieces, copies into
  // the window what must wait, and skips what was offered before (a retried
  // chunk counts once).
  absl::StatusOr<Offered> Offer(JobState& state, uint32_t rank, uint32_t shard, uint64_t offset, DType dtype,
                                const Pieces& data);
  // Rank `rank`'s push ended; `no_grad[s]` for the shards it has no gradient
  // for. Folds whatever that lets through.
  absl::Status Finish(JobState& state, uint32_t rank, std::vector<bool> no_grad);

  // Takes back an unfinished rank's offers. Exact (and true) only while none
  // of them was folded into the sum; otherwise nothing changes and false.
  bool Withdraw(uint32_t rank);

  bool finished(uint32_t rank) const { return ranks_[rank].finished; }
  // The lowest rank that has not finished: it is next in every block it has
  // not covered, so its chunks always fold at once and never need the window.
  uint32_t lowest_unfinished() const { return lowest_unfinished_; }
  bool folded(uint32_t rank) const { return ranks_[rank].folded; }
  bool no_grad(uint32_t rank, uint32_t shard) const;
  // The first range of the shard the rank has not offered, if any.
  std::optional<std::pair<uint64_t, uint64_t>> FirstGap(uint32_t rank, uint32_t shard) const;
  // Every block folded past every rank: the sum is whole.
  bool Complete() const;
  // Whether any rank has a gradient for the shard (once every rank finished).
  bool Contributed(uint32_t shard) const;
  uint64_t window_bytes() const { return window_bytes_; }
  // Bumped by every fold and every change of the window: what a push that
  // waits for room waits on.
  uint64_t progress() const { return progress_; }
  // Calls `fn` once for each rank that became some block's next rank since
  // the last call: a chunk of theirs that waited for room in the window can
  // now fold without it. Called after every fold, so it allocates nothing.
  void DrainNewlyNext(const std::function<void(uint32_t rank)>& fn);
  // The bookkeeping's memory, for the server's budget (memory_budget.h).
  // Fixed at creation: per rank and per block, whatever is pushed.
  static uint64_t FixedBytes(const std::vector<uint64_t>& shard_lengths, uint32_t world_size);
  // Grows as ranks push, by at most MaxGrowth() per Offer or Finish: each
  // rank's offered ranges (of the shards it touched only, so a rank that
  // pushes one element costs one entry whatever the number of tensors) and
  // its no_grad flags once it finished.
  uint64_t growing_bytes() const { return growing_bytes_; }
  uint64_t MaxGrowth() const;

 private:
  struct Block {
    uint32_t next = 0;  // the rank the block's sum takes next
    bool any = false;   // some rank before `next` is in the sum
  };
  struct RankState {
    bool finished = false;
    bool folded = false;                // some of its elements are in the sum
    bool newly_next = false;            // listed in newly_next_
    absl::flat_hash_map<uint32_t, IntervalSet> offered;  // by shard, those it offered anything of
    std::vector<bool> no_grad;          // [shard], once it finished
  };
  struct Waiting {
    uint32_t rank;
    uint64_t offset;  // in the shard
    DType dtype;
    std::string bytes;
  };

  static uint64_t Key(uint32_t shard, uint64_t block) { return uint64_t{shard} << 32 | block; }
  uint64_t BlockEnd(uint32_t shard, uint64_t block) const;
  // Folds [offset, offset + elements in `runs`) of the shard into the sum.
  absl::Status Fold(JobState& state, uint32_t shard, Block& block, uint64_t offset, DType dtype,
                    absl::Span<const absl::string_view> runs, RankState& rank);
  // Moves the block's sum past every rank that is done with it.
  absl::Status Advance(JobState& state, uint32_t shard, uint64_t block);
  // Of a rank's shard, what it offered: null if nothing.
  static const IntervalSet* OfferedOf(const RankState& rank, uint32_t shard);

  const std::vector<uint64_t> lengths_;
  const uint32_t world_size_;
  const uint64_t window_cap_;
  std::vector<std::vector<Block>> blocks_;  // [shard][block]
  std::vector<RankState> ranks_;
  absl::flat_hash_map<uint64_t, std::vector<Waiting>> window_;  // by Key(shard, block)
  uint64_t window_bytes_ = 0;
  uint32_t lowest_unfinished_ = 0;
  uint64_t progress_ = 0;
  uint64_t growing_bytes_ = 0;
  std::vector<uint32_t> newly_next_;  // at most world_size_, reserved
  // Reused by every fold: a chunk's runs of whole elements, and the elements
  // split between two of its pieces.
  std::vector<absl::string_view> runs_;
  std::string split_;
};

}  // namespace shardopt
