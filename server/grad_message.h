// A received GradChunk read without copying its gradient bytes: every field
// but `data` parsed by protobuf (so a message protobuf refuses is refused
// here too), and `data` left where gRPC received it, as pieces over the
// message's slices, which the pieces keep alive. The push folds them
// straight into the running sum (docs/design.md, section 10.2). The chunks
// packed after the message's own (GradChunk.more) are read the same way.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "base/pieces.h"
#include "shardopt/v1/optimizer.pb.h"

namespace grpc {
class ByteBuffer;
}

namespace shardopt {

// One chunk of a push message: every field but `data`, and the data.
struct GradPart {
  v1::GradChunk head;
  Pieces data;
};

// INVALID_ARGUMENT if the message does not parse, if it names more than
// `max_no_grad` no_grad tensors (found before anything is parsed: for such a
// message the parse would be most of the cost), or if a chunk packed in it
// carries another field than tensor, offset, dtype and data. `head` gets
// every field of the message's own chunk but `data` and `more`; `more` the
// packed chunks, in order. Takes the message's slices: `message` is left
// empty.
absl::Status ReadGradChunk(grpc::ByteBuffer* message, uint64_t max_no_grad, v1::GradChunk* head, Pieces* data,
                           std::vector<GradPart>* more);

}  // namespace shardopt
