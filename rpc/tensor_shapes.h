// TensorSpec.shape in a job's identity: compared only where both specs give
// one, so that a job made, or a checkpoint written, by a client that gave
// no shapes (or before the field) is the same job as one that gives them.
#pragma once

#include <cstdint>

#include "rpc/job_limits.h"
#include "shardopt/v1/optimizer.pb.h"

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

// Clears the shapes of each tensor that one of `a` and `b` gives none for;
// copies, ready for a comparison of the rest.
inline void KeepShapesBothGive(v1::CreateJobRequest* a, v1::CreateJobRequest* b) {
  if (a->tensors_size() != b->tensors_size()) return;  // they differ anyway
  for (int i = 0; i < a->tensors_size(); ++i) {
    if (a->tensors(i).shape_size() == 0 || b->tensors(i).shape_size() == 0) {
      a->mutable_tensors(i)->clear_shape();
      b->mutable_tensors(i)->clear_shape();
    }
  }
}

}  // namespace shardopt
