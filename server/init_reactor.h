// The Init RPC on gRPC's callback API, with raw messages parsed here: a
// message that does not parse ends the stream with INVALID_ARGUMENT (naming
// how many elements were written before it), never with OK, so a caller
// can't mistake a cut stream for whole initial values. No thread is held
// while the client is slow to send.
#pragma once

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/job_store.h"

namespace grpc {
class CallbackServerContext;
}

namespace shardopt {

// The reactor for one Init call; gRPC owns it until its OnDone.
grpc::ServerReadReactor<grpc::ByteBuffer>* StartInitReactor(JobStore* store, grpc::ByteBuffer* response);

}  // namespace shardopt
