// The Commit RPC on gRPC's callback API, with raw messages: each params
// piece is read from the job's state straight into a buffer that goes out
// as a slice, with the ParamChunk's other fields hand-encoded around it
// (rpc/wire_format.h), so the params are copied once on their way out
// instead of into a message and again by its serialization. The next piece
// is applied and read only once the last one is written, which is what
// gRPC's flow control asks of a writer.
#pragma once

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/auth.h"
#include "server/job_store.h"
#include "server/stream_limits.h"

namespace grpc {
class CallbackServerContext;
}

namespace shardopt {

// The reactor for one Commit call; gRPC owns it until its OnDone.
// `caller` must be allowed to commit the request's job; `slot` is held
// until the stream ends.
grpc::ServerWriteReactor<grpc::ByteBuffer>* StartCommitReactor(JobStore* store, const grpc::ByteBuffer* request,
                                                               const Caller& caller,
                                                               std::unique_ptr<StreamLimits::Slot> slot);

}  // namespace shardopt
