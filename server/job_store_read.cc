// JobStore's reads of a job's state (the Read RPC, RemoteAdamW's
// state_dict): a stream of ~1 MiB chunks of one tensor's range on this
// server, each read under the job's lock and never between two pieces of an
// update.
#include <algorithm>
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "server/job_store.h"
#include "server/messages.h"

namespace shardopt {

absl::StatusOr<std::unique_ptr<JobStore::StateStream>> JobStore::OpenRead(const v1::ReadRequest& req) const {
  SHARDOPT_ASSIGN_OR_RETURN(auto found, Find(req.job(), req.incarnation()));
  Job& job = *found;
  StateKind kind;
  switch (req.kind()) {
    case v1::MASTER: kind = StateKind::kMaster; break;
    case v1::EXP_AVG: kind = StateKind::kExpAvg; break;
    case v1::EXP_AVG_SQ: kind = StateKind::kExpAvgSq; break;
    case v1::PARAM_BF16: kind = StateKind::kParamBf16; break;
    default: return absl::InvalidArgumentError("read kind must be MASTER, EXP_AVG, EXP_AVG_SQ or PARAM_BF16");
  }
  const DType dtype = kind == StateKind::kParamBf16 ? DType::kBf16 : DType::kFp32;
  uint32_t shard;
  uint64_t length = req.length();
  {
    absl::MutexLock lock(&job.mu);
    if (length == 0) {
      auto it = job.tensor_index.find(req.tensor());
      if (it != job.tensor_index.end() && job.shard_of_tensor[it->second] >= 0) {
        const OwnedShard& s = job.shards[job.shard_of_tensor[it->second]];
        if (req.offset() < s.offset + s.length) length = s.offset + s.length - req.offset();
      }
    }
    SHARDOPT_ASSIGN_OR_RETURN(auto located, job.LocateRange(req.tensor(), req.offset(), length));
    shard = located;
    if (length == 0) {  // the offset is at the shard's end: no element of it is asked for
      const OwnedShard& s = job.shards[shard];
      return absl::OutOfRangeError(absl::StrCat("offset ", req.offset(), " of tensor '", req.tensor(),
                                                "' is at the end of this server's shard ",
                                                Range(s.offset, s.offset + s.length), "; nothing to read"));
    }
  }
  auto stream = std::make_unique<StateStream>();
  stream->job_ = std::move(found);
  stream->shard_ = shard;
  stream->kind_ = kind;
  stream->dtype_ = dtype;
  stream->base_ = stream->job_->shards[shard].offset;
  stream->next_ = req.offset();
  stream->end_ = req.offset() + length;
  stream->per_chunk_ = options_.stream_chunk_elements * 2 / DTypeSize(dtype);  // ~1 MiB
  stream->tensor_ = req.tensor();
  return stream;
}

absl::StatusOr<JobStore::StateStream::Pulled> JobStore::StateStream::Next(v1::StateChunk* chunk,
                                                                           const std::function<void()>& wake) {
  if (next_ >= end_) return Pulled::kEnd;
  const uint64_t n = std::min(per_chunk_, end_ - next_);
  Job& job = *job_;
  absl::MutexLock lock(&job.mu);
  // Never between two pieces of an update.
  if (wake && job.applying && !job.dropped) {
    job.Watch(wake);
    return Pulled::kLater;
  }
  job.AwaitWholeStep();
  SHARDOPT_RETURN_IF_ERROR(job.CheckNotDropped());
  if (!job.failed.ok()) return job.failed;
  chunk->set_tensor(tensor_);
  chunk->set_dtype(ToProto(dtype_));
  chunk->set_offset(next_);
  chunk->mutable_data()->resize(n * DTypeSize(dtype_));
  SHARDOPT_RETURN_IF_ERROR(job.state->ReadState(shard_, kind_, next_ - base_, n, dtype_, chunk->mutable_data()->data()));
  chunk->set_step(job.step);
  next_ += n;
  return Pulled::kChunk;
}

absl::Status JobStore::Read(const v1::ReadRequest& req, const std::function<bool(const v1::StateChunk&)>& emit) const {
  SHARDOPT_ASSIGN_OR_RETURN(auto stream, OpenRead(req));
  v1::StateChunk chunk;
  for (;;) {
    SHARDOPT_ASSIGN_OR_RETURN(StateStream::Pulled pulled, stream->Next(&chunk));
    if (pulled == StateStream::Pulled::kEnd) return absl::OkStatus();
    if (!emit(chunk)) return absl::CancelledError("the caller stopped reading");
  }
}

}  // namespace shardopt
