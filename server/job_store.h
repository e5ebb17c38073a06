// The optimizer's core: jobs, their state, and the exactly-once step protocol
// of DESIGN.md. No network here: the gRPC service is a thin adapter over this
// class, and tests drive it directly.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

namespace v1 = ::shardopt::v1;

struct JobStoreOptions {
  absl::Duration default_barrier_timeout = absl::Seconds(60);
  // Elements per streamed ParamChunk / StateChunk: 1 MiB of bf16. Rounded up
  // to a multiple of kApplyAlignment.
  uint64_t stream_chunk_elements = 512 * 1024;
  // Where checkpoints go and come from (server/checkpoint.h); empty: none.
  std::string checkpoint_dir;
  // Told what restore found: which checkpoint it loaded, and why it passed
  // over newer, torn ones.
  std::function<void(const std::string&)> checkpoint_log = [](const std::string& line) {
    std::cerr << "shardopt-server: " << line << std::endl;
  };
};

class Job;

class JobStore {
 public:
  JobStore(Backend* backend, JobStoreOptions options = {});
  ~JobStore();

  // With a checkpoint_dir, a job not in memory is restored from its newest
  // complete checkpoint (or request.restore_step's), by the request's
  // placement: each shard is read from whichever parts cover it.
  absl::StatusOr<v1::CreateJobResponse> CreateJob(const v1::CreateJobRequest& request);
  // Writes this server's part of the job's checkpoint of request.step(),
  // from a snapshot taken at a step boundary.
  absl::StatusOr<v1::CheckpointResponse> Checkpoint(const v1::CheckpointRequest& request);
  // For SIGTERM: from now on commits that would apply a step fail with
  // UNAVAILABLE; commits already applying finish first. Then every job is
  // checkpointed at its step, one result each; a job still waiting for its
  // initial values holds nothing a restart could not rebuild and is skipped.
  std::vector<std::pair<std::string, absl::StatusOr<v1::CheckpointResponse>>> DrainAndCheckpoint();
  absl::Status DropJob(const std::string& job);
  absl::StatusOr<v1::DescribeResponse> Describe(const std::string& job) const;

  // Writes one chunk of initial values. All-or-nothing: a chunk with a bad
  // range or a nonfinite value changes nothing.
  // Returns the number of elements written.
  absl::StatusOr<uint64_t> Init(const v1::InitChunk& chunk);

  // One rank's push of one step: Begin, any number of Add, then Finish, which
  // waits at the barrier for the other ranks.
  class PushSession {
   public:
    absl::Status Add(const v1::GradChunk& chunk);
    absl::StatusOr<v1::PushResponse> Finish();
    ~PushSession();

   private:
    friend class JobStore;
    PushSession(std::shared_ptr<Job> job, uint64_t step, uint32_t rank);
    // Joins the round of step_, starting it if needed. Under the job's lock.
    void Start(std::chrono::steady_clock::time_point now);
    absl::StatusOr<v1::PushResponse> Seal();
    std::shared_ptr<Job> job_;
    uint64_t step_;
    uint32_t rank_;
    uint64_t epoch_ = 0;    // the barrier round this session's chunks belong to
    uint64_t session_ = 0;  // this stream's number among the rank's in the round
    bool started_ = false;
    bool answered_ = false;
    std::vector<std::string> no_grad_;
  };
  absl::StatusOr<std::unique_ptr<PushSession>> BeginPush(const v1::GradChunk& first);

  // Applies the step if it is the next one, then hands the params to `emit`
  // in chunks, stopping early if `emit` returns false.
  absl::Status Commit(const v1::CommitRequest& request,
                      const std::function<bool(const v1::ParamChunk&)>& emit);
  absl::Status Read(const v1::ReadRequest& request,
                    const std::function<bool(const v1::StateChunk&)>& emit) const;

  std::string backend_name() const { return backend_->Describe(); }

 private:
  absl::StatusOr<std::shared_ptr<Job>> Find(const std::string& name) const;
  absl::StatusOr<v1::CreateJobResponse> Attach(const Job& job, const v1::CreateJobRequest& spec) const;

  Backend* backend_;
  JobStoreOptions options_;
  std::atomic<bool> draining_{false};
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs_;
};

}  // namespace shardopt
