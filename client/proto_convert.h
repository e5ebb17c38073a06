// The public client API's vocabulary (client.h) in the wire contract's terms,
// one conversion each, so that the two cannot drift apart silently.
#pragma once

#include <string>

#include "absl/types/span.h"
#include "shardopt/client.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

// The CreateJob request for `job` on a server holding `shards` (its part of
// the placement), asked by trainer `rank`.
v1::CreateJobRequest ToCreateJobRequest(const JobOptions& job, absl::Span<const ShardPlacement> shards, uint32_t rank);

// The dtype a tensor's gradients are pushed in: fp32 for fp32 params, else
// the job's gradient type.
v1::DType GradDType(const JobOptions& job, const TensorOptions& tensor);
// The dtype a group's state is held in when it is held as asked.
v1::DType StateDType(StatePrecision precision);
v1::StateKind ToProto(StateToRead what);
// A push's intent: how the step will be committed if it applies (GradChunk.intent).
v1::StepIntent ToProto(const StepOptions& options);

ServerState FromProto(const std::string& address, const v1::DescribeResponse& response);

}  // namespace shardopt
