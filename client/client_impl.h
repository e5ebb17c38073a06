// Client's private half, as leveldb keeps DBImpl: the connection, the job
// this client is attached to, and what every public method is built from:
// one RPC with its retries and re-attach, the fan-out over the job's
// servers, a commit's stream, and the checks made before anything is sent.
// Only client/client*.cc include it.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/types/span.h"
#include "base/status_macros.h"
#include "client/fanout.h"
#include "client/proto_convert.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "shardopt/client.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace shardopt {

struct Client::Impl {
  ClientOptions options;
  std::vector<std::unique_ptr<v1::Optimizer::Stub>> stubs;
  std::vector<std::unique_ptr<grpc::GenericStub>> generic;  // the same channels, for the bulk paths
  std::vector<std::shared_ptr<grpc::Channel>> channels;      // [server], for waiting on a reconnection

  JobOptions job;
  bool attached = false;
  bool dropped = false;  // by this client's Drop, the job named `job`, until it attaches again
  // [server]: the life of the job this client attached to there
  // (CreateJobResponse.incarnation), echoed in each Push, Commit and Init so
  // that a job dropped and made again under the name is not stepped as if it
  // were this one. Set by CreateOrAttach, and by Reattach on that server's
  // own fan-out thread, the only one that reads it while attached, but for
  // ReadMany's lanes, several threads to one server, which never re-attach
  // (client_state.cc).
  mutable std::vector<uint64_t> incarnation;
  // This client's id as a trainer (GradChunk.trainer: ClientOptions's, or
  // random; nonzero), and [server] the job's push clock there when this
  // client attached (CreateJobResponse.push_clock), renewed as incarnation
  // is: a push of this rank by another trainer since then is refused, not
  // taken.
  uint64_t trainer = 0;
  mutable std::vector<uint64_t> attached_at;
  // [server]: it reads chunks packed in a push message
  // (CreateJobResponse.takes_packed_grads), renewed as incarnation is: a
  // server replaced by an older one would drop them. Bytes, not bits, as
  // servers' fan-out threads write their own.
  mutable std::vector<uint8_t> takes_packed_grads;
  uint64_t step = 0;
  // Whether this client pushed since it attached: a trainer, not a client
  // that only reads (which Reattach advises apart).
  std::atomic<bool> pushed{false};
  uint64_t pushed_ahead = 0;  // Client::pushed_ahead, as the attach found it
  std::vector<double> applied_group_lr;  // Client::applied_group_lr, likewise
  uint64_t chunk_bytes = 0;  // per streamed message, once attached (rpc/chunk_size.h)
  uint32_t barrier_ms = 0;   // the job's barrier deadline as its servers hold it, once attached
  absl::flat_hash_map<std::string, uint32_t> tensor_index;
  std::vector<std::vector<ShardPlacement>> shards_of;  // [server] in tensor order
  // [tensor index]: its parts in shards_of, in server order (at most one on
  // each server), so that a call of many tensors finds each one's at once.
  std::vector<std::vector<const ShardPlacement*>> parts_of;
  std::vector<bool> pushes_to;                         // [server]: in push_servers
  // [server]: why this client cannot go on with the job there (Reattach
  // failed). The fresh job it dropped again is answered "was dropped" from
  // then on, which would read as if someone had dropped the job.
  mutable std::mutex lost_mu;
  mutable std::vector<std::string> lost;  // guarded by lost_mu
  // A Client is called from one thread at a time, in the process that made
  // it (client.h); Entered refuses what breaks that instead of letting it
  // race or hang. `in_call`: the thread in a public call, if any.
  const pid_t made_in = getpid();
  std::atomic<std::thread::id> in_call{};
  // FAILED_PRECONDITION in a process forked from `parent`, which started
  // gRPC: no Client, old or new, can be used there (see Connect).
  static absl::Status ForkedFrom(pid_t parent);
  // Begins each public call of a Client that talks to its servers. A call
  // from a second thread while one runs is refused (FAILED_PRECONDITION): two
  // threads' Steps had each taken the other's push for a retry, and half the
  // gradients were lost without an error. So is every call in a process
  // forked from the one that made the client: gRPC's threads stayed with the
  // parent, and a child's call hung, writing on the parent's connections. A
  // call that another public call of the same thread makes (Step's Push) is
  // let in.
  class Entered {
   public:
    explicit Entered(Impl& im);
    ~Entered();
    Entered(const Entered&) = delete;
    Entered& operator=(const Entered&) = delete;
    const absl::Status& status() const { return status_; }

   private:
    Impl& im_;
    bool outer_ = false;  // this call entered the client; a nested one did not
    absl::Status status_;
  };

  // Whether `failed` is a server's that cannot go on with the job: what
  // Reattach found there (`lost`) is in its message.
  bool FailedForALostServer(const absl::Status& failed) const {
    std::lock_guard<std::mutex> lock(lost_mu);
    return std::any_of(lost.begin(), lost.end(), [&](const std::string& why) {
      return !why.empty() && absl::StrContains(failed.message(), why);
    });
  }

  uint32_t servers() const { return static_cast<uint32_t>(stubs.size()); }
  const std::string& address(uint32_t s) const { return options.servers[s]; }
  // Gradients come in the param's dtype for fp32 params, else in the job's.
  v1::DType grad_dtype(uint32_t tensor) const { return GradDType(job, job.tensors[tensor]); }

  absl::Status CheckAttached() const;

  // A push's deadline: the barrier's wait on top of the call's own, so that
  // the server's barrier ends first and its answer says which ranks it
  // lacked.
  uint32_t push_timeout_ms() const {
    return static_cast<uint32_t>(
        std::min<uint64_t>(uint64_t{barrier_ms} + options.rpc_timeout_ms, std::numeric_limits<uint32_t>::max()));
  }

  // Runs one RPC to server `server`, with retries (client/fanout.h). A
  // server that answers that it holds no such job (it restarted) is given
  // the job again (Reattach), and the RPC runs once more; up to
  // max_attempts times, since a server may restart again meanwhile (a
  // rolling restart, a crash loop), and "no job" would otherwise reach the
  // caller, who takes it for a dropped job.
  template <typename Attempt>
  absl::Status Call(uint32_t server, uint32_t timeout_ms, const Attempt& attempt, bool reattach = true) const {
    absl::Status st = fanout::Call(channels[server].get(), address(server), options.token, options.max_attempts, timeout_ms, attempt);
    bool completed_torn = false;
    for (uint32_t reattached = 0;; ++reattached) {
      if (absl::IsNotFound(st) && absl::StrContains(st.message(), "was dropped")) {
        std::lock_guard<std::mutex> lock(lost_mu);
        if (server < lost.size() && !lost[server].empty()) {
          return fanout::FailFanout(absl::FailedPreconditionError(lost[server]));
        }
      }
      // Another rank's re-attach may be completing a step this server's
      // drain tore: its job made meanwhile is another life, or its restore
      // is behind this client's step, until it undoes them.
      const bool torn_meanwhile =
          (absl::IsNotFound(st) && absl::StrContains(st.message(), " is not the life this call names")) ||
          (absl::IsOutOfRange(st) && absl::StrContains(st.message(), " is in the future"));
      if (reattach && attached && torn_meanwhile && !completed_torn && CompleteTornOn(server)) {
        completed_torn = true;  // once a call
        st = fanout::Call(channels[server].get(), address(server), options.token, options.max_attempts, timeout_ms,
                          attempt);
        continue;
      }
      if (!reattach || !attached || !absl::IsNotFound(st) || !absl::StrContains(st.message(), "no job ")) {
        return fanout::FailFanout(st);
      }
      if (reattached == static_cast<uint32_t>(std::max(options.max_attempts, 1))) {
        return fanout::FailFanout(absl::UnavailableError(absl::StrCat(
            st.message(), " (given the job ", reattached, " times in this call, it restarted each time since: ",
            "call again once it stays up)")));
      }
      SHARDOPT_RETURN_IF_ERROR(fanout::FailFanout(Reattach(server, st)));
      st = fanout::Call(channels[server].get(), address(server), options.token, options.max_attempts, timeout_ms, attempt);
    }
  }

  // The job on a server that no longer holds it: a new process in its place
  // (a pod replaced in a rolling upgrade), which restores the job from the
  // newest complete checkpoint when asked to create it. Fine if it is then
  // at the step this client is at (or another rank attached it already);
  // otherwise FAILED_PRECONDITION, and a job it made afresh is dropped
  // again (its life marked, so that later calls say why: `lost`). A job dropped on purpose is answered "was dropped" instead, and
  // never comes here.
  absl::Status Reattach(uint32_t s, const absl::Status& why) const;
  // Reattach's CreateJob of server s (restore_step 0, this client's life),
  // answered into `answer`; where the server does not hold this client's
  // step and names its own part of that step, of this client's life
  // (own_part_step), that step is completed on the other servers first
  // (CompleteStepOn) and the server asked again until it restores it.
  // `at_next`: the server's part was of the next step, which this client
  // calls again, and the server may hold that step.
  absl::Status CreateAgain(uint32_t s, v1::CreateJobResponse* answer, bool* at_next) const;
  // Whether `resp` from server s holds this client's step in its life (or,
  // `at_next`, the next one): Kept, at that step, and SameLife.
  bool HoldsOurs(uint32_t s, const v1::CreateJobResponse& resp, bool at_next) const;
  // Whether a CreateJob answer kept a job (restored it, or attached to one
  // held) rather than making it afresh.
  static bool Kept(const v1::CreateJobResponse& resp);
  // Whether it is of the life this client holds of server s (or either
  // side names none: a server too old to).
  bool SameLife(uint32_t s, const v1::CreateJobResponse& resp) const;
  // Server s's life, push clock and packing, from an answer that holds
  // this client's step.
  void TakeAttach(uint32_t s, const v1::CreateJobResponse& resp) const;
  // For a call answered as if the job had moved on without this client
  // while another rank's re-attach completes a step server s's drain tore
  // (a job of another life there, just made; or one restored behind this
  // client's step): CreateAgain, and whether s then holds this client's
  // step. If not, what it made or attached is undone and the caller keeps
  // its error.
  bool CompleteTornOn(uint32_t s) const;
  // The way back for a server whose drain wrote its part of step `t` while
  // the servers `on` held it live (Reattach, CreateOrAttach): checkpoints
  // `t` on each of them, of life lives[server], at once. Whether one of them
  // then completed it.
  bool CompleteStepOn(const std::vector<uint32_t>& on, uint64_t t, const std::vector<uint64_t>& lives) const;

  // A push or commit of this client's next step, t, that server `s` calls
  // "in the future" (OUT_OF_RANGE): the server is behind the step its peers
  // agreed on, so it lost steps (it restarted and restored an older
  // checkpoint while they went on). No retry mends that, and the server's
  // own words ("push step N") would send the trainer the wrong way.
  absl::Status UnlessServerBehind(uint32_t s, uint64_t t, absl::Status st) const;

  // One server's commit of `req`: its params of the step into out[tensor]
  // (null: discarded), whole, or an error.
  absl::Status CommitOn(uint32_t s, const v1::CommitRequest& req, absl::Span<char* const> out) const;

  // Which servers hold part of the job.
  std::vector<bool> holds_part() const;

  // FAILED_PRECONDITION if the job's checkpoints could never be taken:
  // this client would take them (options.checkpoint_every, rank 0) and a
  // server of the job has no --checkpoint_dir, so each would fail after its
  // step was applied; or two servers of the job report different checkpoint
  // directories (DescribeResponse.checkpoint_dir_id), or one a directory and
  // another none, so no server would see every part, no checkpoint would
  // complete, and a restart of the servers (their drain writes only parts)
  // would lose the job. Rank 0's attach asks it; any rank's, where the
  // servers disagree on the step (a server restarted on another directory
  // is one way there, and dropping the job, the way out that error gives,
  // would lose the step the others hold), with `directories_only`: the
  // directories compared, as far as the servers answer, and nothing else.
  absl::Status CheckCheckpointsCanBeTaken(bool directories_only = false) const;

  // Describe of the job's life `life` (0: any) on server `s`, for the
  // server's settings only (one tensor at most), in `attempts` tries.
  absl::Status DescribeSettings(uint32_t s, uint64_t life, int attempts, uint32_t timeout_ms,
                                v1::DescribeResponse* out) const;
  // Where server `s` (the job's life `life` there) reports another
  // checkpoint directory than a server that holds part of the job, "server
  // ADDRESS's (directory ids ...)"; else "".
  std::string OtherDirectory(uint32_t s, uint64_t life) const;

  // Every server's answer to CreateJob for `job` (the tensors' placement
  // known: shards_of). Each call runs to its end, whatever the others
  // answer: a job one made must be known, to be undone if another refused.
  absl::Status AskCreateJob(const JobOptions& job, std::vector<v1::CreateJobResponse>* answers) const;

  // Drops, on server `s`, the job's life `life` (0: none) that a CreateJob
  // of this client made there; sent to the end whatever other servers do,
  // its error ignored. With `undo` (DropJobRequest.undo), one CreateJob this
  // client's failed attach had answered OK is undone, if nothing has
  // happened to the job since: the job goes with the last of its CreateJobs
  // undone, so a failed attach leaves no job behind, and none goes from
  // under a rank whose attach went through; a restored one goes back to its
  // checkpoints. Without, a fresh job that holds nothing is dropped, its
  // life marked (a re-attach that found no checkpoint of it).
  void DropLife(uint32_t s, uint64_t life, bool undo) const;

  // Runs fn(server) on every server that holds part of the job (only those
  // in push_servers when `pushing`), at once. Each thread builds one chunk
  // message at a time, so in flight per server there is one chunk plus what
  // gRPC buffers within one HTTP/2 flow-control window.
  template <typename Fn>
  absl::Status ForEachServer(const Fn& fn, bool pushing = false) const {
    std::vector<uint32_t> targets;
    for (uint32_t s = 0; s < servers(); ++s) {
      if (!shards_of[s].empty() && (!pushing || pushes_to[s])) targets.push_back(s);
    }
    return fanout::ForEach(targets, fn);
  }

  absl::StatusOr<const TensorOptions*> FindTensor(const std::string& name) const;
  // The parts of a tensor FindTensor found.
  const std::vector<const ShardPlacement*>& PartsOf(const TensorOptions* t) const {
    return parts_of[static_cast<size_t>(t - job.tensors.data())];
  }

  // Describe from every server that holds part of the job; empty entries
  // for the others.
  absl::StatusOr<std::vector<v1::DescribeResponse>> DescribeAll() const;

  // What a commit sends, checked before anything is sent (a Step's push
  // included): its learning rates, as the servers check them, and the
  // tensors of `params`. Where each tensor's params go, by tensor index.
  absl::StatusOr<std::vector<char*>> CommitTargets(double lr, absl::Span<const double> group_lr,
                                                   absl::Span<const ParamView> params) const;

  // Commits `step` on every server it pushes to, each server's params
  // written where CommitTargets said.
  absl::Status CommitTo(uint64_t t, double lr, float gscale, bool skip, absl::Span<const double> group_lr,
                        const std::vector<char*>& out);

  // This caller's slice of a server's part of a tensor: every server gets
  // its bytes from every caller at once, and the slices tile the part.
  static ShardPlacement ShareOf(const ShardPlacement& placed, InitShare share);
  // INVALID_ARGUMENT for a share that is none of its count's.
  static absl::Status CheckShare(InitShare share);

  // What SendInit would send of `values`, checked as the servers check it,
  // before anything is sent: a call the servers refuse partway would leave
  // the chunks before the refused one written.
  absl::Status CheckInit(const std::string& tensor, const void* values, v1::DType dtype, v1::StateKind kind,
                         InitShare share) const;

  // One array of a tensor's initial values: its master, or a moment.
  struct InitWrite {
    std::string tensor;
    const void* values = nullptr;
    v1::DType dtype = v1::FP32;
    v1::StateKind kind = v1::MASTER;
    uint64_t adam_step = 0;  // with a moment: the tensor's Adam step from then on
  };
  // Sends what CheckInit checked: this caller's share of each write, in
  // their order, in as few Init streams per server as hold 256 MiB each (a
  // stream each cost a round trip and its thread switches: 0.5 ms).
  absl::Status SendInit(absl::Span<const InitWrite> writes, InitShare share = {});
};

}  // namespace shardopt
