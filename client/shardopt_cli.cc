// shardopt: the admin command line. Talks to one server.
//   shardopt --server=HOST:PORT describe JOB
//   shardopt --server=HOST:PORT read JOB TENSOR master|exp_avg|exp_avg_sq|param [OFFSET [COUNT]]
//   shardopt --server=HOST:PORT drop JOB
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "shardopt/grpc_edge.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace v1 = shardopt::v1;

namespace {

int Usage() {
  std::cerr << "usage: shardopt [--server=HOST:PORT] describe JOB\n"
               "       shardopt [--server=HOST:PORT] read JOB TENSOR master|exp_avg|exp_avg_sq|param [OFFSET [COUNT]]\n"
               "       shardopt [--server=HOST:PORT] drop JOB\n";
  return 2;
}

int Fail(const grpc::Status& st) {
  std::cerr << "shardopt: " << shardopt::FromGrpcStatus(st).ToString() << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string server = "localhost:50051";
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--server=", 9) == 0) {
      server = argv[i] + 9;
    } else {
      args.emplace_back(argv[i]);
    }
  }
  if (args.size() < 2) return Usage();
  grpc::ChannelArguments channel_args;
  shardopt::TuneChannelArguments(&channel_args);
  auto stub = v1::Optimizer::NewStub(grpc::CreateCustomChannel(server, grpc::InsecureChannelCredentials(), channel_args));
  grpc::ClientContext ctx;
  const std::string& command = args[0];

  if (command == "describe") {
    v1::DescribeRequest req;
    req.set_job(args[1]);
    v1::DescribeResponse resp;
    if (auto st = stub->Describe(&ctx, req, &resp); !st.ok()) return Fail(st);
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.always_print_primitive_fields = true;
    (void)google::protobuf::util::MessageToJsonString(resp, &json, options);
    std::cout << json;
    return 0;
  }
  if (command == "drop") {
    v1::DropJobRequest req;
    req.set_job(args[1]);
    v1::DropJobResponse resp;
    if (auto st = stub->DropJob(&ctx, req, &resp); !st.ok()) return Fail(st);
    std::cout << "dropped " << args[1] << "\n";
    return 0;
  }
  if (command == "read" && args.size() >= 4) {
    v1::ReadRequest req;
    req.set_job(args[1]);
    req.set_tensor(args[2]);
    const std::string& kind = args[3];
    req.set_kind(kind == "master" ? v1::MASTER : kind == "exp_avg" ? v1::EXP_AVG
                 : kind == "exp_avg_sq" ? v1::EXP_AVG_SQ : kind == "param" ? v1::PARAM_BF16
                 : v1::STATE_KIND_UNSPECIFIED);
    if (args.size() > 4) req.set_offset(std::stoull(args[4]));
    if (args.size() > 5) req.set_length(std::stoull(args[5]));
    auto reader = stub->Read(&ctx, req);
    v1::StateChunk chunk;
    while (reader->Read(&chunk)) {
      const std::string& d = chunk.data();
      if (chunk.dtype() == v1::FP32) {
        for (size_t i = 0; i + 4 <= d.size(); i += 4) {
          float x;
          std::memcpy(&x, d.data() + i, 4);
          std::printf("%.9g\n", x);
        }
      } else {
        for (size_t i = 0; i + 2 <= d.size(); i += 2) {
          uint16_t h;
          std::memcpy(&h, d.data() + i, 2);
          uint32_t u = uint32_t{h} << 16;
          float x;
          std::memcpy(&x, &u, 4);
          std::printf("%.9g\n", x);
        }
      }
    }
    if (auto st = reader->Finish(); !st.ok()) return Fail(st);
    return 0;
  }
  return Usage();
}
