// Describe of a job on one server straight through the generated stub: a
// test's way to see what that server holds without a Client, which would
// attach (and, for a job it does not hold, make it).
#pragma once

#include <string>

#include "grpcpp/grpcpp.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace shardopt::testing {

// `token`: the bearer token to send, if the server asks for one.
inline grpc::Status DescribeOn(const std::string& address, const std::string& job,
                               v1::DescribeResponse* out = nullptr, const std::string& token = "") {
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  v1::DescribeRequest req;
  req.set_job(job);
  v1::DescribeResponse unused;
  return stub->Describe(&ctx, req, out != nullptr ? out : &unused);
}

}  // namespace shardopt::testing
