// TensorSpec.shape in a job's identity: compared only where both specs give
// one, so that a job made, or a checkpoint written, by a client that gave
// no shapes (or before the field) is the same job as one that gives them.
// CreateJobRequest.trainers_per_rank likewise, where both say it (not 0).
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "rpc/job_limits.h"
#include "shardopt/v1/optimizer.pb.h"

namespace google::protobuf::util {
class MessageDifferencer;
}  // namespace google::protobuf::util

namespace shardopt {

// Whether `shape` may be given for a tensor of `numel` elements: none, or
// at most kMaxShapeDims dimensions, each >= 1, whose product is numel. As
// the servers check it, and the client before it sends anything.
template <typename Dims>
bool ShapeFits(const Dims& shape, uint64_t numel) {
  if (shape.size() == 0) return true;
  if (static_cast<size_t>(shape.size()) > kMaxShapeDims) return false;
  uint64_t elements = 1;
  for (uint64_t d : shape) {
    if (d == 0 || __builtin_mul_overflow(elements, d, &elements)) return false;
  }
  return elements == numel;
}

// What ShapeFits refuses, for the tensor `name`.
template <typename Dims>
std::string ShapeRefusal(const std::string& name, const Dims& shape, uint64_t numel) {
  return absl::StrCat("tensor '", name, "' has shape (", absl::StrJoin(shape, ", "), "), not one of its numel ", numel,
                      " elements in at most ", kMaxShapeDims, " dimensions of at least 1");
}

// Makes `differ` compare a tensor's shape only where both specs give one,
// and trainers_per_rank only where both say it: a job made, or a checkpoint
// written, without them is the same job as one asked for with them, and the
// rest of the spec is compared as ever.
void CompareOnlyWhereBothSayIt(google::protobuf::util::MessageDifferencer* differ);

// Whether both specs say trainers_per_rank, and differ: nodes of another
// number of local ranks, which the refusal's message says.
inline bool OtherTrainersPerRank(const v1::CreateJobRequest& a, const v1::CreateJobRequest& b) {
  return a.trainers_per_rank() != 0 && b.trainers_per_rank() != 0 && a.trainers_per_rank() != b.trainers_per_rank();
}

}  // namespace shardopt
