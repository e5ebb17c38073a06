// One server's answer to a Commit, message by message: each params chunk is
// checked against this server's own shards, for the step committed, in the
// tensor's param dtype, and copied once, from the received slices, into the
// caller's buffer (a node group's buffers hold only the ranges it owns, so a
// chunk outside the server's shards is refused before a byte is written).
// Whole once each shard came exactly once: a chunk sent twice does not make
// up for one that never came. The receiving half of Client::Commit, as
// PushMessages is the sending half of a push.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "shardopt/client.h"

namespace shardopt {

class CommitParams {
 public:
  // `shards`: this server's placements, at most one per tensor. `out[t]`:
  // where tensor t's params go, at its element 0 (null: not asked for, and
  // discarded). All must outlive this.
  CommitParams(const JobOptions& job, const absl::flat_hash_map<std::string, uint32_t>& tensor_index,
               const std::vector<ShardPlacement>& shards, absl::Span<char* const> out, uint64_t step);

  // One received message, with the chunks packed in it (ParamChunk.more):
  // INTERNAL for a malformed one, or params outside the server's shards, of
  // another step or in another dtype.
  grpc::Status Take(grpc::ByteBuffer* message);
  // After the call ended OK: DATA_LOSS unless every shard came whole, once.
  grpc::Status Whole();

 private:
  const JobOptions& job_;
  const absl::flat_hash_map<std::string, uint32_t>& tensor_index_;
  const std::vector<ShardPlacement>& shards_;
  const absl::Span<char* const> out_;
  const uint64_t step_;
  std::vector<int64_t> shard_of_;                           // [tensor]: its index in shards_, or -1
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> came_;  // [shard]: (offset, elements) received
  std::vector<char> discard_;                               // params of tensors the caller did not ask for
};

}  // namespace shardopt
