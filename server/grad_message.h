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
#include "grpcpp/support/byte_buffer.h"
#include "rpc/chunk_size.h"
#include "server/grad_part.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

// INVALID_ARGUMENT if the message does not parse, if it names more than
// `max_no_grad` no_grad tensors or packs more than `max_packed` chunks
// (both found before anything is parsed: for such a message the parse
// would be most of the cost), or if a chunk packed in it names no tensor or
// carries a known field beside tensor, offset, dtype and data. A message
// the fast scan cannot read (a group, a varint longer than protobuf's own)
// is left to protobuf's parser only up to kMaxUnscannedBytes, and refused
// past it: that parse would allocate for every field before any could be
// counted (so is a message-typed field in it, the intent). `head` gets
// every field of the message's own chunk but `data` and `more`, and `more`
// the packed chunks, in order, all without their unknown fields: protobuf
// keeps each in an allocation of its own, 30 to 50 times its bytes, and the
// server reads none. Takes the message's slices: `message` is left empty.
absl::Status ReadGradChunk(grpc::ByteBuffer* message, uint64_t max_no_grad, uint64_t max_packed, v1::GradChunk* head,
                           Pieces* data, std::vector<GradPart>* more);
inline constexpr uint64_t kMaxUnscannedBytes = 64 << 10;


}  // namespace shardopt
