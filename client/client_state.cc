// A Client's reads of the job as its servers hold it: one tensor's state
// (Read), every server's description (Describe), each tensor's Adam step,
// and the check that the state is held in the precision the job asked for.
#include <algorithm>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "client/client_impl.h"
#include "client/proto_convert.h"
#include "client/wire.h"
#include "shardopt/client.h"

namespace shardopt {

absl::Status Client::Read(const std::string& tensor, StateToRead what, uint64_t offset, uint64_t count, void* out) {
  Impl& im = *impl_;
  SHARDOPT_RETURN_IF_ERROR(im.CheckAttached());
  SHARDOPT_ASSIGN_OR_RETURN(auto t, im.FindTensor(tensor));
  if (out == nullptr && count > 0) return absl::InvalidArgumentError("Read needs a buffer to read into");
  if (offset > (t)->numel || count > (t)->numel - offset) {
    return absl::OutOfRangeError(absl::StrCat("range past the ", (t)->numel, " elements of tensor '", tensor, "'"));
  }
  const uint64_t esize = what == StateToRead::kParamBf16 ? 2 : 4;
  const uint64_t dtype = what == StateToRead::kParamBf16 ? v1::BF16 : v1::FP32;
  // Every chunk, from every server, must be of one step, or the caller would
  // get a mix of two steps' state.
  std::mutex step_mu;
  std::optional<uint64_t> read_step;
  bool mixed = false;
  auto st = im.ForEachServer([&](uint32_t s) -> absl::Status {
    for (const ShardPlacement& p : im.shards_of[s]) {
      const uint64_t begin = std::max(offset, p.offset);
      const uint64_t end = std::min(offset + count, p.offset + p.length);
      if (p.tensor != tensor || begin >= end) continue;
      v1::ReadRequest req;
      req.set_job(im.job.name);
      req.set_tensor(tensor);
      req.set_offset(begin);
      req.set_length(end - begin);
      req.set_kind(ToProto(what));
      // Through the generic stub, each chunk's data copied from gRPC's
      // slices straight into `out`: parsed into a StateChunk first, a read
      // made two copies of every byte on the caller's thread.
      return im.Call(s, im.options.rpc_timeout_ms, [&](grpc::ClientContext* ctx) {
        req.set_incarnation(im.incarnation[s]);  // at each attempt: a Reattach may have renewed it
        uint64_t received = 0;
        wire::SendOnce request(req.SerializeAsString());
        const grpc::Status finished = wire::StreamCall::Run(
            im.generic[s].get(), ctx, "/shardopt.v1.Optimizer/Read", request, [] {},
            [&](grpc::ByteBuffer* message) {
              wire::ChunkHead head;
              const auto place = [&](const wire::ChunkHead& h) -> char* {
                const uint64_t n = h.data_bytes / esize;
                if (h.tensor != tensor || (h.dtype != dtype && h.dtype != v1::DTYPE_UNSPECIFIED) ||
                    h.data_bytes % esize != 0 || h.offset < begin ||
                    h.offset > end || n > end - h.offset) {
                  return nullptr;
                }
                received += n;
                return static_cast<char*>(out) + (h.offset - offset) * esize;
              };
              if (!wire::ReadChunk(message, wire::kStateChunk, place, &head)) {
                return grpc::Status(grpc::StatusCode::INTERNAL,
                                    "server sent a malformed chunk, or state outside the range asked for");
              }
              std::lock_guard<std::mutex> lock(step_mu);
              mixed = mixed || (read_step && *read_step != head.step);
              read_step = head.step;
              return grpc::Status::OK;
            });
        // A stream that ends OK short of the range would leave the rest of
        // the caller's buffer as it was, passed off as state.
        if (finished.ok() && received != end - begin) {
          return grpc::Status(grpc::StatusCode::DATA_LOSS,
                              absl::StrCat("server sent ", received, " of the ", end - begin, " elements asked for"));
        }
        return finished;
      });
    }
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  if (mixed) return absl::AbortedError(absl::StrCat("tensor '", tensor, "' changed step during the read; read it again"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ServerState>> Client::Describe() {
  Impl& im = *impl_;
  SHARDOPT_ASSIGN_OR_RETURN(auto responses, im.DescribeAll());
  std::vector<ServerState> out;
  for (uint32_t s = 0; s < im.servers(); ++s) {
    if (im.shards_of[s].empty()) continue;
    const v1::DescribeResponse& r = (responses)[s];
    out.push_back(FromProto(im.address(s), r));
  }
  return out;
}

absl::StatusOr<std::vector<uint64_t>> Client::AdamSteps() {
  Impl& im = *impl_;
  SHARDOPT_ASSIGN_OR_RETURN(auto responses, im.DescribeAll());
  // Every server holding part of a tensor counts its steps alike.
  std::vector<uint64_t> steps(im.job.tensors.size(), 0);
  for (const v1::DescribeResponse& r : responses) {
    for (const v1::TensorState& t : r.tensors()) {
      if (auto it = im.tensor_index.find(t.name()); it != im.tensor_index.end()) steps[it->second] = t.adam_step();
    }
  }
  return steps;
}

absl::Status Client::VerifyState() {
  Impl& im = *impl_;
  SHARDOPT_ASSIGN_OR_RETURN(auto responses, im.DescribeAll());
  for (uint32_t s = 0; s < im.servers(); ++s) {
    if (im.shards_of[s].empty()) continue;
    const v1::DescribeResponse& r = (responses)[s];
    if (r.groups_size() != static_cast<int>(im.job.groups.size())) {
      return absl::FailedPreconditionError(absl::StrCat(im.address(s), " reports ", r.groups_size(), " groups, the job has ",
                                                        im.job.groups.size()));
    }
    for (int g = 0; g < r.groups_size(); ++g) {
      const v1::DType held = r.groups(g).state_dtype();
      if (held == v1::DTYPE_UNSPECIFIED) continue;  // no tensor of this group on that server
      const v1::DType asked = StateDType(im.job.groups[g].precision);
      if (held != asked) {
        return absl::FailedPreconditionError(absl::StrCat(
            "group ", g, " ('", im.job.groups[g].name, "') state is held in ", v1::DType_Name(held), " on ",
            im.address(s), " but ", v1::DType_Name(asked), " was asked for: refusing to train on it"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace shardopt
