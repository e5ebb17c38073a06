#include "client/commit_params.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/wire.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

CommitParams::CommitParams(const JobOptions& job, const absl::flat_hash_map<std::string, uint32_t>& tensor_index,
                           const std::vector<ShardPlacement>& shards, absl::Span<char* const> out, uint64_t step)
    : job_(job), tensor_index_(tensor_index), shards_(shards), out_(out), step_(step),
      shard_of_(job.tensors.size(), -1), came_(shards.size()) {
  for (size_t i = 0; i < shards.size(); ++i) shard_of_[tensor_index.at(shards[i].tensor)] = static_cast<int64_t>(i);
}

grpc::Status CommitParams::Take(grpc::ByteBuffer* message) {
  const bool good = wire::ReadChunks(
      message, wire::kParamChunk,
      [&](const wire::ChunkHead& h) -> char* {
        auto it = tensor_index_.find(h.tensor);
        if (it == tensor_index_.end() || shard_of_[it->second] < 0) return nullptr;
        const bool fp32 = job_.tensors[it->second].param_type == ParamType::kFp32;
        // Servers send bf16 params with the dtype unset, as before
        // param_dtype existed. Checked before anything is written, as the
        // range is: a chunk of another step must not land in the caller's
        // params either.
        const uint64_t dtype = h.dtype == v1::DTYPE_UNSPECIFIED ? uint64_t{v1::BF16} : h.dtype;
        if (h.step != step_ || dtype != (fp32 ? v1::FP32 : v1::BF16)) return nullptr;
        const uint64_t esize = fp32 ? 4 : 2;
        const int64_t shard = shard_of_[it->second];
        const ShardPlacement& p = shards_[shard];
        const uint64_t n = h.data_bytes / esize;
        if (h.data_bytes % esize != 0 || h.offset < p.offset || h.offset - p.offset > p.length ||
            n > p.offset + p.length - h.offset) {
          return nullptr;
        }
        came_[shard].emplace_back(h.offset, n);
        if (char* dst = out_[it->second]) return dst + h.offset * esize;
        discard_.resize(h.data_bytes);
        return discard_.data();
      });
  if (!good) {
    return grpc::Status(grpc::StatusCode::INTERNAL,
                        "server sent params outside its shards of the job's tensors, of another step or in another "
                        "dtype");
  }
  return grpc::Status::OK;
}

grpc::Status CommitParams::Whole() {
  for (size_t i = 0; i < shards_.size(); ++i) {
    std::sort(came_[i].begin(), came_[i].end());
    uint64_t at = shards_[i].offset;
    for (const auto& [offset, n] : came_[i]) at = offset == at ? at + n : ~uint64_t{0};  // ~0: a gap or overlap
    if (at != shards_[i].offset + shards_[i].length) {
      return grpc::Status(grpc::StatusCode::DATA_LOSS,
                          absl::StrCat("commit of step ", step_, " returned params of '", shards_[i].tensor,
                                       "' that overlap or leave a gap"));
    }
  }
  return grpc::Status::OK;
}

}  // namespace shardopt
