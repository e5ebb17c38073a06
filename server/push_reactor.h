// The Push RPC on gRPC's callback API, with raw messages parsed here (so an
// unparseable one is INVALID_ARGUMENT, never the stream's quiet end): one
// reactor per stream, driving a PushSession with its non-blocking calls. It reads the next chunk only
// once the session has taken the last one, so a full window stops reading
// and gRPC's flow control holds the sender back; a wait at the barrier
// holds no thread. The session's wakes resume it.
#pragma once

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/job_store.h"
#include "shardopt/v1/optimizer.pb.h"

namespace grpc {
class CallbackServerContext;
}

namespace shardopt {

// The reactor for one Push call; gRPC owns it until its OnDone.
grpc::ServerReadReactor<grpc::ByteBuffer>* StartPushReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                            grpc::ByteBuffer* response);

}  // namespace shardopt
