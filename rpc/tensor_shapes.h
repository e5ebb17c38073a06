// TensorSpec.shape in a job's identity: compared only where both specs give
// one, so that a job made, or a checkpoint written, by a client that gave
// no shapes (or before the field) is the same job as one that gives them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

// What ShapeFits refuses, for the tensor `name`.
template <typename Dims>
std::string ShapeRefusal(const std::string& name, const Dims& shape, uint64_t numel) {
  return absl::StrCat("tensor '", name, "' has shape (", absl::StrJoin(shape, ", "), "), not one of its numel ", numel,
                      " elements in at most ", kMaxShapeDims, " dimensions of at least 1");
}

// Whether a tensor at the same index gives a shape on one side only, which
// KeepShapesBothGive must clear before the rest is compared; most attaches
// (every client gives shapes, or none does) need no copies.
inline bool ShapesOnOneSide(const v1::CreateJobRequest& a, const v1::CreateJobRequest& b) {
  const int n = std::min(a.tensors_size(), b.tensors_size());
  for (int i = 0; i < n; ++i) {
    if ((a.tensors(i).shape_size() == 0) != (b.tensors(i).shape_size() == 0)) return true;
  }
  return false;
}

// Clears the shapes of each tensor, by index, that one of `a` and `b` gives
// none for (as far as both have tensors: where a tensor was added, the
// difference then names that, not shapes); copies, ready for a comparison.
inline void KeepShapesBothGive(v1::CreateJobRequest* a, v1::CreateJobRequest* b) {
  const int n = std::min(a->tensors_size(), b->tensors_size());
  for (int i = 0; i < n; ++i) {
    if (a->tensors(i).shape_size() == 0 || b->tensors(i).shape_size() == 0) {
      a->mutable_tensors(i)->clear_shape();
      b->mutable_tensors(i)->clear_shape();
    }
  }
  for (v1::CreateJobRequest* longer : {a, b}) {
    for (int i = n; i < longer->tensors_size(); ++i) longer->mutable_tensors(i)->clear_shape();
  }
}

}  // namespace shardopt
