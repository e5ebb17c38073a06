// What a job is: CreateJob's request checked and brought to one normal form,
// so that two requests compare equal exactly when they mean the same job.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "rpc/job_limits.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

// Fills in defaults (lr_multiplier 1, whole-tensor shards, BF16 gradients,
// the server's barrier deadline) and checks every field.
absl::StatusOr<v1::CreateJobRequest> NormalizeJobSpec(const v1::CreateJobRequest& request,
                                                      absl::Duration default_barrier_timeout);

// OK when `requested` is the job `existing` is, else ALREADY_EXISTS naming
// the difference. Both are normalized; group names are for messages only,
// and a tensor's shape and trainers_per_rank count only where both give
// them (rpc/tensor_shapes.h).
absl::Status SameJobSpec(const v1::CreateJobRequest& existing, const v1::CreateJobRequest& requested);

absl::StatusOr<DType> FromProto(v1::DType d);
v1::DType ToProto(DType d);
// INVALID_ARGUMENT unless `bytes` is a whole number of `dtype` elements.
absl::Status CheckDataLength(uint64_t bytes, DType dtype, const std::string& what);

}  // namespace shardopt
