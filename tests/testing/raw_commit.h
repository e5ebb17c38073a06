// A Commit sent over a bare stub, as a client written from the proto would
// send it, its params read and dropped: the status the server ends it with.
#pragma once

#include "grpcpp/client_context.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace shardopt::testing {

inline grpc::Status CommitAndDrain(v1::Optimizer::Stub& stub, const v1::CommitRequest& request) {
  grpc::ClientContext ctx;
  auto reader = stub.Commit(&ctx, request);
  v1::ParamChunk chunk;
  while (reader->Read(&chunk)) {
  }
  return reader->Finish();
}

}  // namespace shardopt::testing
