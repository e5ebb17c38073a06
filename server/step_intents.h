// What each rank's latest push of a step says it will commit the step with
// (GradChunk.intent), so that a commit applying a step the ranks disagree
// on is refused on every server alike, instead of each server applying
// whichever commit reached it first and the step tearing across servers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

class StepIntents {
 public:
  StepIntents() = default;
  explicit StepIntents(uint32_t world_size) : latest_(world_size) {}

  // The intent of `rank`'s push of `step`, replacing what it said before;
  // null: the push said none, and the rank is not compared.
  void Note(uint32_t rank, uint64_t step, const v1::StepIntent* intent);
  // Empty when the ranks that said how they will commit `step` agree, bit
  // for bit; else the first difference, naming both ranks ("rank 0 pushed
  // it with lr 0.01, rank 1 with lr 0.02").
  std::string Disagreement(uint64_t step) const;

 private:
  struct Said {
    uint64_t step = 0;  // 0: nothing said
    v1::StepIntent intent;
  };
  std::vector<Said> latest_;  // [rank]
};

}  // namespace shardopt
