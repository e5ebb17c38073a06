// JobStore's reads of a job: Describe, ListJobs, and its state (the Read RPC,
// RemoteAdamW's state_dict), a stream of ~1 MiB chunks of one tensor's range
// on this server, each read under the job's lock and never between two
// pieces of an update.
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "checkpoint/catalog.h"
#include "checkpoint/format.h"
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
                                                                           absl::FunctionRef<char*(size_t)> data,
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
  SHARDOPT_RETURN_IF_ERROR(job.state->ReadState(shard_, kind_, next_ - base_, n, dtype_, data(n * DTypeSize(dtype_))));
  chunk->set_step(job.step);
  next_ += n;
  return Pulled::kChunk;
}

absl::Status JobStore::Read(const v1::ReadRequest& req, const std::function<bool(const v1::StateChunk&)>& emit) const {
  SHARDOPT_ASSIGN_OR_RETURN(auto stream, OpenRead(req));
  v1::StateChunk chunk;
  for (;;) {
    SHARDOPT_ASSIGN_OR_RETURN(StateStream::Pulled pulled, stream->Next(&chunk, [&](size_t bytes) {
                                chunk.mutable_data()->resize(bytes);
                                return chunk.mutable_data()->data();
                              }));
    if (pulled == StateStream::Pulled::kEnd) return absl::OkStatus();
    if (!emit(chunk)) return absl::CancelledError("the caller stopped reading");
  }
}

absl::StatusOr<v1::DescribeResponse> JobStore::Describe(const v1::DescribeRequest& request) const {
  absl::StatusOr<std::shared_ptr<Job>> found = Find(request.job(), request.incarnation());
  if (!found.ok()) {
    // An operator describing a job on a server restarted since: its
    // checkpoints wait on disk until a trainer's CreateJob restores the
    // newest complete one, the one a restore finds.
    if (options_.checkpoint_dir.empty() || request.incarnation() != 0 || !absl::IsNotFound(found.status())) {
      return found.status();
    }
    if (const absl::Status here = CheckpointDirInPlace(); !here.ok()) {
      return absl::NotFoundError(absl::StrCat(found.status().message(), "; its checkpoints were not looked for: ",
                                              here.message()));
    }
    const auto newest = checkpoint::FindCommitted(options_.checkpoint_dir, request.job(), 0, [](const std::string&) {});
    if (absl::IsNotFound(newest.status())) return found.status();
    if (!newest.ok()) {
      // What the restore would meet first (a damaged COMMIT or part header),
      // rather than nothing, which read as a directory without checkpoints
      // (an outside probe).
      return absl::NotFoundError(absl::StrCat(found.status().message(), "; its checkpoint directory holds a ",
                                              "checkpoint that a trainer's CreateJob cannot restore: ",
                                              newest.status().ToString()));
    }
    // Only the COMMIT and the parts' headers are read here: a part's data
    // is checked as the restore reads it, so damaged data is named then,
    // not here (a probe took this for a promise that the step loads).
    return absl::NotFoundError(absl::StrCat(found.status().message(), "; its checkpoint directory holds a complete ",
                                            "checkpoint of step ", newest->marker.step(), ", which a trainer's ",
                                            "CreateJob restores (under a new life if the job was dropped) if its ",
                                            "parts' checksums match as they are read (DATA_LOSS, naming the part, if ",
                                            "not)"));
  }
  Job& job = **found;
  absl::MutexLock lock(&job.mu);
  const v1::JobSummary summary = Summarize(job);
  v1::DescribeResponse r;
  r.set_job(job.name());
  r.set_step(summary.step());
  r.set_world_size(summary.world_size());
  r.set_trainers_per_rank(summary.trainers_per_rank());
  r.set_grad_dtype(job.spec.grad_dtype());
  for (int g = 0; g < job.spec.groups_size(); ++g) {
    v1::GroupState* gs = r.add_groups();
    *gs->mutable_config() = job.spec.groups(g);
    // What the backend holds, not what was asked for: VerifyState compares the two.
    bool any = false;
    Precision held = Precision::kFp32;
    for (size_t s = 0; s < job.shards.size(); ++s) {
      if (job.spec.tensors(job.shards[s].tensor).group() != static_cast<uint32_t>(g)) continue;
      const Precision p = job.state->held_precision(static_cast<uint32_t>(s));
      if (!any || p == Precision::kBf16) held = p;
      any = true;
    }
    gs->set_state_dtype(!any ? v1::DTYPE_UNSPECIFIED : held == Precision::kFp32 ? v1::FP32 : v1::BF16);
  }
  const size_t count = job.shards.size();
  if (request.tensor_offset() > count) {
    return absl::OutOfRangeError(absl::StrCat("tensor_offset ", request.tensor_offset(), " is past the ", count,
                                              " tensors of job '", job.name(), "' on this server"));
  }
  const uint32_t page = request.max_tensors() == 0 ? kDescribePage : std::min(request.max_tensors(), kDescribePage);
  r.set_tensor_offset(request.tensor_offset());
  r.set_tensor_count(summary.tensors());
  // A page also ends before the answer would outgrow the server's message
  // limit: each tensor names itself twice, and every page repeats the
  // groups, so a job that its CreateJob's limit let in could otherwise not
  // be described at all. One tensor always goes in, so the pages advance;
  // the fields set below take a few hundred bytes at most (waiting_for names
  // at most 16 ranks and one tensor), well inside the margin.
  const uint64_t room =
      options_.max_message_bytes > kDescribeMarginBytes ? options_.max_message_bytes - kDescribeMarginBytes : 0;
  uint64_t bytes = r.ByteSizeLong();
  for (size_t si = request.tensor_offset(); si < std::min<size_t>(count, size_t{request.tensor_offset()} + page); ++si) {
    const OwnedShard& s = job.shards[si];
    v1::TensorState* ts = r.add_tensors();
    const v1::TensorSpec& spec = job.spec.tensors(s.tensor);
    ts->set_name(spec.name());
    ts->set_numel(spec.numel());
    ts->set_group(spec.group());
    ts->mutable_shard()->set_tensor(spec.name());
    ts->mutable_shard()->set_offset(s.offset);
    ts->mutable_shard()->set_length(s.length);
    ts->set_adam_step(job.adam_steps[si]);
    // On the wire: the entry, its length (at most 3 bytes here) and its tag.
    bytes += ts->ByteSizeLong() + 4;
    if (bytes > room && r.tensors_size() > 1) {
      r.mutable_tensors()->RemoveLast();
      break;
    }
  }
  r.set_state_bytes(summary.state_bytes());
  r.set_staging_bytes(summary.staging_bytes());
  r.set_bookkeeping_bytes(summary.bookkeeping_bytes());
  r.set_device(backend_->Describe());
  r.set_memory_limit_bytes(budget_.limit());
  r.set_memory_used_bytes(budget_.used());
  r.set_uninitialized_tensors(summary.uninitialized_tensors());
  r.set_checkpoint_dir(!options_.checkpoint_dir.empty());
  r.set_checkpoint_dir_id(options_.checkpoint_dir_id);
  r.set_waiting_for(summary.waiting_for());
  r.set_barrier_seconds_left(summary.barrier_seconds_left());
  r.set_owner(summary.owner());
  return r;
}

v1::JobSummary JobStore::Summarize(const Job& job) {
  v1::JobSummary s;
  s.set_job(job.name());
  s.set_step(job.step);
  s.set_world_size(job.world_size());
  s.set_trainers_per_rank(job.spec.trainers_per_rank());
  s.set_tensors(static_cast<uint32_t>(job.shards.size()));
  const MemoryUse use = job.memory_use();
  s.set_state_bytes(use.state_bytes);
  s.set_staging_bytes(use.staging_bytes);
  s.set_bookkeeping_bytes(use.bookkeeping_bytes);
  s.set_uninitialized_tensors(static_cast<uint32_t>(job.uninitialized_shards));
  s.set_owner(job.owner());
  if (job.round.active && !job.round.sealed) {
    const std::chrono::duration<double> left = job.round.deadline - std::chrono::steady_clock::now();
    // A round past its deadline lasts until a push or commit ends it (and
    // names the missing ranks to its caller): a read leaves it, saying so.
    s.set_waiting_for(left.count() > 0 ? job.MissingSummary()
                                       : absl::StrCat(Job::kDeadlinePassed, job.MissingSummary(),
                                                      "; the step's next push or commit ends the round, and "
                                                      "nothing of it is applied"));
    s.set_barrier_seconds_left(std::max(0.0, left.count()));
  }
  return s;
}

v1::ListJobsResponse JobStore::ListJobs(const v1::ListJobsRequest& request,
                                        const std::function<bool(const std::string&)>& visible) const {
  std::vector<std::shared_ptr<Job>> listed;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, job] : jobs_) {
      if (name > request.after() && visible(name)) listed.push_back(job);
    }
  }
  std::sort(listed.begin(), listed.end(),
            [](const std::shared_ptr<Job>& a, const std::shared_ptr<Job>& b) { return a->name() < b->name(); });
  v1::ListJobsResponse r;
  r.set_device(backend_->Describe());
  r.set_memory_limit_bytes(budget_.limit());
  r.set_memory_used_bytes(budget_.used());
  const uint32_t page = request.max_jobs() == 0 ? kListPage : std::min(request.max_jobs(), kListPage);
  // As Describe's pages: one job always goes in, and a page ends before it
  // would outgrow the message limit (a summary is at most a few hundred bytes
  // past its name, and waiting_for names at most 16 ranks and one tensor).
  const uint64_t room =
      options_.max_message_bytes > kDescribeMarginBytes ? options_.max_message_bytes - kDescribeMarginBytes : 0;
  uint64_t bytes = r.ByteSizeLong();
  size_t next = 0;
  for (; next < listed.size() && static_cast<uint32_t>(r.jobs_size()) < page; ++next) {
    v1::JobSummary summary;
    {
      absl::MutexLock lock(&listed[next]->mu);
      if (listed[next]->dropped) continue;  // since the map was read
      summary = Summarize(*listed[next]);
    }
    bytes += summary.ByteSizeLong() + 4;
    if (bytes > room && r.jobs_size() > 0) break;
    *r.add_jobs() = std::move(summary);
  }
  r.set_more(next < listed.size());
  return r;
}

}  // namespace shardopt
