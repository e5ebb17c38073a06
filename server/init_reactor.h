// The Init RPC on gRPC's callback API, with raw messages parsed here: a
// message that does not parse ends the stream with INVALID_ARGUMENT (naming
// how many elements were written before it), never with OK, so a caller
// can't mistake a cut stream for whole initial values. No thread is held
// while the client is slow to send, and a stream that sends nothing for the
// idle timeout is cut (read_reactor.h).
#pragma once

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/server_callback.h"
#include "server/auth.h"
#include "server/job_store.h"
#include "server/read_reactor.h"

namespace grpc {
class CallbackServerContext;
}

namespace shardopt {

// The reactor for one Init call; gRPC owns it until its OnDone. `allows` is
// asked at each message whether its caller may Init the stream's job.
grpc::ServerReadReactor<grpc::ByteBuffer>* StartInitReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                            grpc::ByteBuffer* response, CallerCheck allows,
                                                            StreamSettings settings);

}  // namespace shardopt
