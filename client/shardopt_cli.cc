// shardopt: the admin command line. Talks to one server.
//   shardopt --server=HOST:PORT describe JOB
//   shardopt --server=HOST:PORT read JOB TENSOR master|exp_avg|exp_avg_sq|param [OFFSET [COUNT]]
//   shardopt --server=HOST:PORT drop JOB
//   shardopt export --checkpoint_dir=DIR [--step=N] [--dtype=fp32|bf16] JOB OUT.safetensors
// export reads a complete checkpoint from disk, no server needed, and writes
// each tensor's master: fp32 exactly (a BF16 group's bf16 master widened,
// exactly), or rounded to bf16 with --dtype=bf16.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <map>

#include "absl/strings/numbers.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/adamw_math.h"
#include "server/checkpoint.h"
#include "shardopt/safetensors.h"
#include "grpcpp/grpcpp.h"
#include "shardopt/grpc_edge.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace v1 = shardopt::v1;

namespace {

int Usage() {
  std::cerr << "usage: shardopt [--server=HOST:PORT] describe JOB\n"
               "       shardopt [--server=HOST:PORT] read JOB TENSOR master|exp_avg|exp_avg_sq|param [OFFSET [COUNT]]\n"
               "       shardopt [--server=HOST:PORT] drop JOB\n"
               "       shardopt export --checkpoint_dir=DIR [--step=N] [--dtype=fp32|bf16] JOB OUT.safetensors\n";
  return 2;
}

int Fail(const absl::Status& st) {
  std::cerr << "shardopt: " << st.ToString() << "\n";
  return 1;
}

int Fail(const grpc::Status& st) { return Fail(shardopt::FromGrpcStatus(st)); }

int Export(const std::string& dir, uint64_t step, bool bf16, const std::string& job, const std::string& out) {
  const auto log = [](const std::string& line) { std::cerr << "shardopt: " << line << "\n"; };
  auto at = shardopt::checkpoint::WholeJob(dir, job, step, log);
  if (!at.ok()) return Fail(at.status());
  auto part = shardopt::checkpoint::Load(dir, at->spec, at->step, log);
  if (!part.ok()) return Fail(part.status());
  std::vector<shardopt::SafetensorsTensor> tensors;
  uint64_t offset = 0;
  for (int s = 0; s < part->manifest.shards_size(); ++s) {
    const uint64_t n = at->spec.shards(s).length();
    const bool held_bf16 = part->manifest.shards(s).dtype() == v1::BF16;
    const char* master = part->data.data() + offset;  // the section's first array
    offset += shardopt::checkpoint::SectionBytes(part->manifest, s);
    shardopt::SafetensorsTensor t{at->spec.shards(s).tensor(), bf16 ? "BF16" : "F32", {n}, {}};
    t.data.resize(n * (bf16 ? 2 : 4));
    for (uint64_t i = 0; i < n; ++i) {
      float x;
      if (held_bf16) {
        uint16_t h;
        std::memcpy(&h, master + 2 * i, 2);
        x = shardopt::math::bf16_to_float(h);
      } else {
        std::memcpy(&x, master + 4 * i, 4);
      }
      if (bf16) {
        const uint16_t h = shardopt::math::float_to_bf16(x);
        std::memcpy(t.data.data() + 2 * i, &h, 2);
      } else {
        std::memcpy(t.data.data() + 4 * i, &x, 4);
      }
    }
    tensors.push_back(std::move(t));
  }
  const std::map<std::string, std::string> metadata = {
      {"job", job}, {"step", std::to_string(at->step)}, {"state", "master"}, {"format", "pt"}};
  if (auto st = shardopt::WriteSafetensors(out, tensors, metadata); !st.ok()) return Fail(st);
  std::cout << "exported job '" << job << "' step " << at->step << " (" << tensors.size() << " tensors, "
            << (bf16 ? "bf16" : "fp32") << ") to " << out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string server = "localhost:50051";
  std::string checkpoint_dir;
  uint64_t step = 0;
  bool bf16 = false;
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--server=", 9) == 0) {
      server = argv[i] + 9;
    } else if (std::strncmp(argv[i], "--checkpoint_dir=", 17) == 0) {
      checkpoint_dir = argv[i] + 17;
    } else if (std::strncmp(argv[i], "--step=", 7) == 0) {
      if (!absl::SimpleAtoi(argv[i] + 7, &step)) return Usage();
    } else if (std::strcmp(argv[i], "--dtype=bf16") == 0 || std::strcmp(argv[i], "--dtype=fp32") == 0) {
      bf16 = std::strcmp(argv[i], "--dtype=bf16") == 0;
    } else {
      args.emplace_back(argv[i]);
    }
  }
  if (args.size() < 2) return Usage();
  if (args[0] == "export") {
    if (args.size() != 3 || checkpoint_dir.empty()) return Usage();
    return Export(checkpoint_dir, step, bf16, args[1], args[2]);
  }
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
