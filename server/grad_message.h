// A received GradChunk read without copying its gradient bytes: every field
// but `data` parsed by protobuf (so a message protobuf refuses is refused
// here too), and `data` left where gRPC received it, as pieces over the
// message's slices, which the pieces keep alive. The push folds them
// straight into the running sum (docs/design.md, section 10.2).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "grpcpp/support/byte_buffer.h"
#include "base/pieces.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

// INVALID_ARGUMENT if the message does not parse, or if it names more than
// `max_no_grad` no_grad tensors (found before anything is parsed: for such a
// message the parse would be most of the cost). `head` gets every field but
// `data`. Takes the message's slices: `message` is left empty.
absl::Status ReadGradChunk(grpc::ByteBuffer* message, uint64_t max_no_grad, v1::GradChunk* head, Pieces* data);

}  // namespace shardopt
