#include "shardopt/client.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "client/attach_answers.h"
#include "client/commit_params.h"
#include "client/fanout.h"
#include "client/option_checks.h"
#include "client/proto_convert.h"
#include "client/push_messages.h"
#include "client/wire.h"
#include "rpc/chunk_size.h"
#include "rpc/grpc_edge.h"
#include "rpc/initial_values.h"
#include "rpc/learning_rates.h"
#include "shardopt/safetensors.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace shardopt {

namespace v1 = ::shardopt::v1;


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
  // own fan-out thread, the only one that reads it while attached.
  mutable std::vector<uint64_t> incarnation;
  // This client's id as a trainer (GradChunk.trainer: ClientOptions's, or
  // random; nonzero), and [server] how many pushes the job had begun there when this client
  // attached (CreateJobResponse.pushes), renewed as incarnation is: a push
  // of this rank by another trainer since then is refused, not taken.
  uint64_t trainer = 0;
  mutable std::vector<uint64_t> attached_at;
  uint64_t step = 0;
  uint64_t pushed_ahead = 0;  // Client::pushed_ahead, as the attach found it
  uint64_t chunk_bytes = 0;  // per streamed message, once attached (rpc/chunk_size.h)
  uint32_t barrier_ms = 0;   // the job's barrier deadline as its servers hold it, once attached
  absl::flat_hash_map<std::string, uint32_t> tensor_index;
  std::vector<std::vector<ShardPlacement>> shards_of;  // [server] in tensor order
  std::vector<bool> pushes_to;                         // [server]: in push_servers
  // [server]: why this client cannot go on with the job there (Reattach
  // failed). The fresh job it dropped again is answered "was dropped" from
  // then on, which would read as if someone had dropped the job.
  mutable std::mutex lost_mu;
  mutable std::vector<std::string> lost;  // guarded by lost_mu

  uint32_t servers() const { return static_cast<uint32_t>(stubs.size()); }
  const std::string& address(uint32_t s) const { return options.servers[s]; }
  // Gradients come in the param's dtype for fp32 params, else in the job's.
  v1::DType grad_dtype(uint32_t tensor) const { return GradDType(job, job.tensors[tensor]); }

  absl::Status CheckAttached() const {
    if (attached) return absl::OkStatus();
    if (dropped) {
      return absl::FailedPreconditionError(absl::StrCat("job '", job.name, "' was dropped by this client (Drop): it ",
                                                        "is attached to no job until CreateOrAttach makes one anew"));
    }
    return absl::FailedPreconditionError("this client is attached to no job: call CreateOrAttach first");
  }

  // A push's deadline: the barrier's wait on top of the call's own, so that
  // the server's barrier ends first and its answer says which ranks it
  // lacked.
  uint32_t push_timeout_ms() const {
    return static_cast<uint32_t>(
        std::min<uint64_t>(uint64_t{barrier_ms} + options.rpc_timeout_ms, std::numeric_limits<uint32_t>::max()));
  }

  // Runs one RPC to server `server`, with retries (client/fanout.h). A
  // server that answers that it holds no such job (it restarted) is given
  // the job again (Reattach), and the RPC runs once more.
  template <typename Attempt>
  absl::Status Call(uint32_t server, uint32_t timeout_ms, const Attempt& attempt, bool reattach = true) const {
    const absl::Status st = fanout::Call(channels[server].get(), address(server), options.token, options.max_attempts, timeout_ms, attempt);
    if (absl::IsNotFound(st) && absl::StrContains(st.message(), "was dropped")) {
      std::lock_guard<std::mutex> lock(lost_mu);
      if (server < lost.size() && !lost[server].empty()) {
        return fanout::FailFanout(absl::FailedPreconditionError(lost[server]));
      }
    }
    if (!reattach || !attached || !absl::IsNotFound(st) || !absl::StrContains(st.message(), "no job ")) {
      return fanout::FailFanout(st);
    }
    SHARDOPT_RETURN_IF_ERROR(fanout::FailFanout(Reattach(server, st)));
    return fanout::FailFanout(fanout::Call(channels[server].get(), address(server), options.token, options.max_attempts, timeout_ms, attempt));
  }

  // The job on a server that no longer holds it: a new process in its place
  // (a pod replaced in a rolling upgrade), which restores the job from the
  // newest complete checkpoint when asked to create it. Fine if it is then
  // at the step this client is at (or another rank attached it already);
  // otherwise FAILED_PRECONDITION, and a job it made afresh is dropped
  // again. A job dropped on purpose is answered "was dropped" instead, and
  // never comes here.
  absl::Status Reattach(uint32_t s, const absl::Status& why) const {
    // Nothing begun yet: a failed fan-out need not wait for a restore.
    if (fanout::current != nullptr && fanout::current->failed()) {
      return absl::CancelledError(absl::StrCat(address(s), ": another server's call failed"));
    }
    // From here not cancelled by another server's failure: a CreateJob cut
    // off may have made the job afresh, and the drop that undoes it must be
    // sent.
    const fanout::Detached detached;
    v1::CreateJobRequest req = ToCreateJobRequest(job, shards_of[s], options.rank);
    req.set_restore_step(0);  // this run's newest, whatever the launch asked for
    req.set_incarnation(incarnation[s]);  // not if that life was dropped on purpose
    v1::CreateJobResponse resp;
    SHARDOPT_RETURN_IF_ERROR(fanout::Call(channels[s].get(), address(s), options.token, options.max_attempts, options.rpc_timeout_ms,
                                          [&](grpc::ClientContext* ctx) { return stubs[s]->CreateJob(ctx, req, &resp); }));
    // The job restored (or attached by another rank) must be this client's
    // life too: a server that holds the job of a new run made since (or
    // restored its checkpoint, whose life is the next one) refuses this
    // trainer, left running. One that holds no job and has this life
    // marked dropped restores nothing and answers "was dropped".
    const bool kept = resp.restored() || !resp.created();
    const bool same_life = incarnation[s] == 0 || resp.incarnation() == 0 || resp.incarnation() == incarnation[s];
    if (kept && !same_life) {
      return absl::NotFoundError(absl::StrCat("job '", job.name, "' was dropped and made again since this trainer ",
                                              "attached to it: ", address(s), " restarted and holds the new run's ",
                                              "job now, not this trainer's"));
    }
    if (kept && resp.step() == step) {
      incarnation[s] = resp.incarnation();  // its own, or the first this client learns of a server without lives
      attached_at[s] = resp.pushes();
      return absl::OkStatus();
    }
    if (resp.created() && !resp.restored()) {
      fanout::Call(channels[s].get(), address(s), options.token, options.max_attempts, options.rpc_timeout_ms,
                   [&](grpc::ClientContext* ctx) {
                     v1::DropJobRequest drop;
                     drop.set_job(job.name);
                     drop.set_incarnation(resp.incarnation());  // this fresh job, not one made meanwhile
                     v1::DropJobResponse unused;
                     return stubs[s]->DropJob(ctx, drop, &unused);
                   })
          .IgnoreError();  // a fresh job, with nothing in it
    }
    const absl::Status failed = absl::FailedPreconditionError(absl::StrCat(
        why.message(), "; asked to create job '", job.name, "' again, it ",
        resp.restored() ? absl::StrCat("restored step ", resp.step()) : std::string("has no checkpoint of it"),
        ", and this client is at step ", step, ": restore every server from one checkpoint (CreateOrAttach)"));
    std::lock_guard<std::mutex> lock(lost_mu);
    lost[s] = std::string(failed.message());
    return failed;
  }

  // A push or commit of this client's next step, t, that server `s` calls
  // "in the future" (OUT_OF_RANGE): the server is behind the step its peers
  // agreed on, so it lost steps (it restarted and restored an older
  // checkpoint while they went on). No retry mends that, and the server's
  // own words ("push step N") would send the trainer the wrong way.
  absl::Status UnlessServerBehind(uint32_t s, uint64_t t, absl::Status st) const {
    if (!absl::IsOutOfRange(st) || !absl::StrContains(st.message(), " is in the future") || t != step + 1) return st;
    // Without the server's own advice ("; push step N"), which pushing that
    // step on one server only would follow.
    absl::string_view said = st.message();
    said = said.substr(0, said.rfind("; push step "));
    return absl::FailedPreconditionError(absl::StrCat(
        said, "; this trainer is at step ", step, ", so ", address(s),
        " lost steps (it restarted and restored an older checkpoint, or none, while its peers went on) and the "
        "job's servers disagree; nothing of step ", t, " was applied on it. To go on: stop the trainers, restart "
        "every server of the job on its checkpoint directory so that each restores the same newest complete "
        "checkpoint (the steps after it are lost; with no checkpoint, the job is), then start the trainers again"));
  }

  // One server's commit of `req`: its params of the step into out[tensor]
  // (null: discarded), whole, or an error.
  absl::Status CommitOn(uint32_t s, const v1::CommitRequest& req, absl::Span<char* const> out) const {
    return UnlessServerBehind(s, req.step(), Call(s, options.rpc_timeout_ms, [&](grpc::ClientContext* ctx) {
      CommitParams received(job, tensor_index, shards_of[s], out, req.step());  // afresh for each attempt
      bool request_sent = false;
      auto next = [&](grpc::ByteBuffer* message) {
        if (request_sent) return wire::StreamCall::Ready::kEnd;
        request_sent = true;
        v1::CommitRequest here = req;
        here.set_incarnation(incarnation[s]);  // read at each attempt: a Reattach may have renewed it
        *message = wire::HeadAndBorrowedBytes(here.SerializeAsString(), nullptr, 0);
        return wire::StreamCall::Ready::kMessage;
      };
      const grpc::Status gs = wire::StreamCall::Run(
          generic[s].get(), ctx, "/shardopt.v1.Optimizer/Commit", next, [] {},
          [&](grpc::ByteBuffer* message) { return received.Take(message); });
      return gs.ok() ? received.Whole() : gs;
    }));
  }

  // Which servers hold part of the job.
  std::vector<bool> holds_part() const {
    std::vector<bool> holds(servers());
    for (uint32_t s = 0; s < servers(); ++s) holds[s] = !shards_of[s].empty();
    return holds;
  }

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

  absl::StatusOr<const TensorOptions*> FindTensor(const std::string& name) const {
    auto it = tensor_index.find(name);
    if (it == tensor_index.end()) {
      return absl::NotFoundError(absl::StrCat("job '", job.name, "' has no tensor '", name, "'"));
    }
    return &job.tensors[it->second];
  }

  // Describe from every server that holds part of the job; empty entries
  // for the others.
  absl::StatusOr<std::vector<v1::DescribeResponse>> DescribeAll() const {
    SHARDOPT_RETURN_IF_ERROR(CheckAttached());
    std::vector<v1::DescribeResponse> responses(servers());
    auto st = ForEachServer([&](uint32_t s) {
      // Page by page: a server answers at most a page of tensors at a time.
      google::protobuf::RepeatedPtrField<v1::TensorState> tensors;
      do {
        v1::DescribeResponse page;
        SHARDOPT_RETURN_IF_ERROR(Call(s, options.rpc_timeout_ms, [&](grpc::ClientContext* ctx) {
          v1::DescribeRequest req;
          req.set_job(job.name);
          req.set_incarnation(incarnation[s]);
          req.set_tensor_offset(tensors.size());
          return stubs[s]->Describe(ctx, req, &page);
        }));
        if (page.tensors_size() == 0 && page.tensor_count() > static_cast<uint32_t>(tensors.size())) {
          return absl::DataLossError(absl::StrCat(address(s), ": Describe answered an empty page"));
        }
        for (v1::TensorState& t : *page.mutable_tensors()) *tensors.Add() = std::move(t);
        page.clear_tensors();
        responses[s] = std::move(page);
      } while (static_cast<uint32_t>(tensors.size()) < responses[s].tensor_count());
      *responses[s].mutable_tensors() = std::move(tensors);
      return absl::OkStatus();
    });
    if (!st.ok()) return st;
    return responses;
  }

  // What a commit sends, checked before anything is sent (a Step's push
  // included): its learning rates, as the servers check them, and the
  // tensors of `params`. Where each tensor's params go, by tensor index.
  absl::StatusOr<std::vector<char*>> CommitTargets(double lr, absl::Span<const double> group_lr,
                                                   absl::Span<const ParamView> params) const {
    SHARDOPT_RETURN_IF_ERROR(CheckAttached());
    SHARDOPT_RETURN_IF_ERROR(CheckLearningRates(lr, group_lr, job.groups.size(), job.name));
    std::vector<char*> out(job.tensors.size(), nullptr);
    for (const ParamView& p : params) {
      SHARDOPT_RETURN_IF_ERROR(FindTensor(p.tensor).status());
      out[tensor_index.at(p.tensor)] = static_cast<char*>(p.data);
    }
    return out;
  }

  // Commits `step` on every server it pushes to, each server's params
  // written where CommitTargets said.
  absl::Status CommitTo(uint64_t t, double lr, float gscale, bool skip, absl::Span<const double> group_lr,
                        const std::vector<char*>& out) {
    v1::CommitRequest req;
    req.set_job(job.name);
    req.set_step(t);
    req.set_lr(lr);
    req.set_gscale(gscale);
    req.set_skip(skip);
    for (double g : group_lr) req.add_group_lr(g);
    SHARDOPT_RETURN_IF_ERROR(ForEachServer([&](uint32_t s) { return CommitOn(s, req, out); }, /*pushing=*/true));
    step = std::max(step, t);
    return absl::OkStatus();
  }

  // This caller's slice of a server's part of a tensor: every server gets
  // its bytes from every caller at once, and the slices tile the part.
  static ShardPlacement ShareOf(const ShardPlacement& placed, InitShare share) {
    ShardPlacement p = placed;
    p.offset = placed.offset + placed.length * share.index / share.count;
    p.length = placed.offset + placed.length * (share.index + 1) / share.count - p.offset;
    return p;
  }

  // What InitTensor would send of `values`, checked as the servers check it,
  // before anything is sent: a call the servers refuse partway would leave
  // the chunks before the refused one written.
  absl::Status CheckInit(const std::string& tensor, const void* values, v1::DType dtype, v1::StateKind kind,
                         InitShare share) const {
    SHARDOPT_RETURN_IF_ERROR(CheckAttached());
    SHARDOPT_ASSIGN_OR_RETURN(const TensorOptions* t, FindTensor(tensor));
    if (share.count == 0 || share.index >= share.count) {
      return absl::InvalidArgumentError(absl::StrCat("init share ", share.index, " of ", share.count,
                                                     " is out of range: 0 <= index < count"));
    }
    if (values == nullptr) return absl::InvalidArgumentError(absl::StrCat("no values given for tensor '", tensor, "'"));
    const bool bf16_state = job.groups[t->group].precision == StatePrecision::kBf16;
    const InitialKind initial = kind == v1::EXP_AVG       ? InitialKind::kExpAvg
                                : kind == v1::EXP_AVG_SQ ? InitialKind::kExpAvgSq
                                                         : InitialKind::kMaster;
    const uint64_t esize = dtype == v1::FP32 ? 4 : 2;
    for (uint32_t s = 0; s < servers(); ++s) {
      for (const ShardPlacement& placed : shards_of[s]) {
        if (placed.tensor != tensor) continue;
        const ShardPlacement p = ShareOf(placed, share);
        SHARDOPT_RETURN_IF_ERROR(CheckInitialValues(static_cast<const char*>(values) + p.offset * esize, p.length,
                                                    dtype == v1::FP32, bf16_state, initial,
                                                    absl::StrCat("'", tensor, "'"), p.offset));
      }
    }
    return absl::OkStatus();
  }

  // Sends what CheckInit checked.
  absl::Status InitTensor(const std::string& tensor, const void* values, v1::DType dtype,
                          v1::StateKind kind = v1::MASTER, uint64_t adam_step = 0, InitShare share = {}) {
    const uint64_t esize = dtype == v1::FP32 ? 4 : 2;
    const uint64_t per_chunk = std::max<uint64_t>(1, chunk_bytes / esize);
    return ForEachServer([&](uint32_t s) -> absl::Status {
      for (const ShardPlacement& placed : shards_of[s]) {
        if (placed.tensor != tensor) continue;
        const ShardPlacement p = ShareOf(placed, share);
        if (p.length == 0) return absl::OkStatus();
        return Call(s, options.rpc_timeout_ms, [&](grpc::ClientContext* ctx) {
          v1::InitResponse resp;
          auto writer = stubs[s]->Init(ctx, &resp);
          v1::InitChunk chunk;
          chunk.set_job(job.name);
          chunk.set_tensor(tensor);
          chunk.set_dtype(dtype);
          chunk.set_kind(kind);
          chunk.set_adam_step(adam_step);
          chunk.set_incarnation(incarnation[s]);
          for (uint64_t off = p.offset; off < p.offset + p.length; off += per_chunk) {
            const uint64_t n = std::min(per_chunk, p.offset + p.length - off);
            chunk.set_offset(off);
            chunk.set_data(static_cast<const char*>(values) + off * esize, n * esize);
            if (!writer->Write(chunk)) break;
          }
          writer->WritesDone();
          return writer->Finish();
        });
      }
      return absl::OkStatus();
    });
  }
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  SHARDOPT_RETURN_IF_ERROR(CheckClientOptions(options));
  if (options.tune_allocator) TuneAllocatorForStreaming();
  SHARDOPT_ASSIGN_OR_RETURN(std::string token, CleanBearerToken(options.token));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->options.token = std::move(token);
  impl->trainer = options.trainer;
  for (std::random_device entropy; impl->trainer == 0;) impl->trainer = (uint64_t{entropy()} << 32) ^ entropy();
  impl->pushes_to.assign(options.servers.size(), options.push_servers.empty());
  for (uint32_t s : options.push_servers) impl->pushes_to[s] = true;  // each in range (CheckClientOptions)
  for (const std::string& address : options.servers) {
    grpc::ChannelArguments args;
    TuneChannelArguments(&args);
    auto channel = grpc::CreateCustomChannel(
        address, ChannelCredentialsFor(options.tls_root_certs, options.tls_cert_chain, options.tls_private_key), args);
    impl->stubs.push_back(v1::Optimizer::NewStub(channel));
    impl->generic.push_back(std::make_unique<grpc::GenericStub>(channel));
    impl->channels.push_back(std::move(channel));
  }
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

uint64_t Client::step() const { return impl_->step; }
uint64_t Client::pushed_ahead() const { return impl_->pushed_ahead; }
uint64_t Client::chunk_bytes() const { return impl_->chunk_bytes; }

absl::StatusOr<uint64_t> Client::CreateOrAttach(const JobOptions& job) {
  Impl& im = *impl_;
  im.attached = false;  // until this job is: a failed attach leaves no half of it
  im.dropped = false;
  SHARDOPT_RETURN_IF_ERROR(CheckJobOptions(job, im.options.rank));
  im.job = job;
  im.tensor_index.clear();
  for (uint32_t i = 0; i < job.tensors.size(); ++i) im.tensor_index[job.tensors[i].name] = i;
  im.shards_of.assign(im.servers(), {});
  {
    std::lock_guard<std::mutex> lock(im.lost_mu);
    im.lost.assign(im.servers(), "");
  }
  for (ShardPlacement& p : PlaceTensors(job.tensors, im.servers())) im.shards_of[p.server].push_back(std::move(p));

  std::vector<v1::CreateJobResponse> answers(im.servers());
  auto st = im.ForEachServer([&](uint32_t s) {
    const v1::CreateJobRequest req = ToCreateJobRequest(job, im.shards_of[s], im.options.rank);
    return im.Call(s, im.options.rpc_timeout_ms, [&](grpc::ClientContext* ctx) {
      return im.stubs[s]->CreateJob(ctx, req, &answers[s]);
    });
  });
  if (!st.ok()) return st;
  im.incarnation.clear();
  im.attached_at.clear();
  for (const v1::CreateJobResponse& answer : answers) {
    im.incarnation.push_back(answer.incarnation());
    im.attached_at.push_back(answer.pushes());
  }
  const std::vector<bool> holds_part = im.holds_part();
  // A step its trainer committed on some servers only is committed on the
  // others, as the trainer's own retry would have been, so that a restarted
  // trainer attaches at that step (their sealed round keeps its gradients:
  // nothing new is summed). Any other difference is refused below.
  if (std::optional<HalfCommitted> half = FindHalfCommittedStep(answers, holds_part)) {
    half->commit.set_job(job.name);
    const std::vector<char*> discard(job.tensors.size(), nullptr);
    SHARDOPT_RETURN_IF_ERROR(
        fanout::ForEach(half->behind, [&](uint32_t s) { return im.CommitOn(s, half->commit, discard); }));
    for (uint32_t s : half->behind) answers[s].set_step(half->commit.step());
  }
  SHARDOPT_ASSIGN_OR_RETURN(const uint64_t step, AgreedStep(answers, holds_part, im.options.servers, job.name));
  im.step = step;
  im.pushed_ahead = PushedAhead(answers, step, holds_part, im.pushes_to);
  std::vector<uint64_t> sent_to, barrier;  // the limits of the servers this job's messages go to
  for (uint32_t s = 0; s < im.servers(); ++s) {
    barrier.push_back(answers[s].barrier_timeout_ms());
    if (holds_part[s]) sent_to.push_back(answers[s].max_message_bytes());
  }
  im.chunk_bytes = ChunkBytesFor(im.options.chunk_bytes, job.world_size, sent_to);
  // The job's own deadline, or what its servers say it is when it gave none
  // (their --barrier_timeout_ms); servers too old to say default to 60 s.
  im.barrier_ms = job.barrier_timeout_ms;
  if (im.barrier_ms == 0) {
    const uint64_t said = *std::max_element(barrier.begin(), barrier.end());
    im.barrier_ms = said > 0 ? static_cast<uint32_t>(said) : 60000;
  }
  im.attached = true;
  return step;
}

absl::Status Client::InitFp32(const std::string& tensor, const float* values, InitShare share) {
  SHARDOPT_RETURN_IF_ERROR(impl_->CheckInit(tensor, values, v1::FP32, v1::MASTER, share));
  return impl_->InitTensor(tensor, values, v1::FP32, v1::MASTER, 0, share);
}
absl::Status Client::InitBf16(const std::string& tensor, const uint16_t* values, InitShare share) {
  SHARDOPT_RETURN_IF_ERROR(impl_->CheckInit(tensor, values, v1::BF16, v1::MASTER, share));
  return impl_->InitTensor(tensor, values, v1::BF16, v1::MASTER, 0, share);
}

absl::Status Client::WaitForInitialValues(int64_t timeout_ms) {
  Impl& im = *impl_;
  SHARDOPT_RETURN_IF_ERROR(im.CheckAttached());
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max<int64_t>(timeout_ms, 0));
  // A server whose parts all have values keeps them (they are taken only at
  // step 0, and never taken away), so only the others are asked again; and
  // ever less often, since every rank of the job asks every server.
  std::vector<uint32_t> pending;
  for (uint32_t s = 0; s < im.servers(); ++s) {
    if (!im.shards_of[s].empty()) pending.push_back(s);
  }
  std::vector<uint32_t> missing(im.servers(), 0);  // each server's thread writes its own entry
  for (auto pause = std::chrono::milliseconds(10);; pause = std::min(2 * pause, std::chrono::milliseconds(500))) {
    SHARDOPT_RETURN_IF_ERROR(fanout::ForEach(pending, [&](uint32_t s) {
      v1::DescribeResponse r;
      // Each call within what is left, so that an unresponsive server keeps
      // the wait near timeout_ms; but given a second at least, so that a
      // short wait still hears the servers' count and can say what lacks.
      const int64_t rpc_ms = im.options.rpc_timeout_ms;
      const int64_t left = std::chrono::duration_cast<std::chrono::milliseconds>(
                               give_up - std::chrono::steady_clock::now()).count();
      const uint32_t call_ms = static_cast<uint32_t>(std::clamp<int64_t>(left, std::min<int64_t>(1000, rpc_ms), rpc_ms));
      SHARDOPT_RETURN_IF_ERROR(im.Call(s, call_ms, [&](grpc::ClientContext* ctx) {
        v1::DescribeRequest req;
        req.set_job(im.job.name);
        req.set_incarnation(im.incarnation[s]);
        req.set_max_tensors(1);  // only the job-wide fields are wanted
        return im.stubs[s]->Describe(ctx, req, &r);
      }));
      missing[s] = r.uninitialized_tensors();
      return absl::OkStatus();
    }));
    pending.erase(std::remove_if(pending.begin(), pending.end(), [&](uint32_t s) { return missing[s] == 0; }),
                  pending.end());
    if (pending.empty()) return absl::OkStatus();
    if (std::chrono::steady_clock::now() >= give_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          im.address(pending.front()), ": ", missing[pending.front()], " of its parts of job '", im.job.name,
          "' still lack initial values after ", timeout_ms, " ms; is every rank that writes a share of them running?"));
    }
    std::this_thread::sleep_for(std::min(pause, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                    give_up - std::chrono::steady_clock::now())));
  }
}

absl::Status Client::InitAdamState(const std::string& tensor, const float* exp_avg, const float* exp_avg_sq,
                                   uint64_t adam_step, InitShare share) {
  SHARDOPT_RETURN_IF_ERROR(CheckAdamStep(adam_step, absl::StrCat("'", tensor, "'")));
  SHARDOPT_RETURN_IF_ERROR(impl_->CheckInit(tensor, exp_avg, v1::FP32, v1::EXP_AVG, share));
  SHARDOPT_RETURN_IF_ERROR(impl_->CheckInit(tensor, exp_avg_sq, v1::FP32, v1::EXP_AVG_SQ, share));
  SHARDOPT_RETURN_IF_ERROR(impl_->InitTensor(tensor, exp_avg, v1::FP32, v1::EXP_AVG, adam_step, share));
  return impl_->InitTensor(tensor, exp_avg_sq, v1::FP32, v1::EXP_AVG_SQ, adam_step, share);
}

absl::Status Client::InitFromSafetensors(const std::string& path) {
  Impl& im = *impl_;
  SHARDOPT_RETURN_IF_ERROR(im.CheckAttached());
  SHARDOPT_ASSIGN_OR_RETURN(auto file, ReadSafetensors(path));
  absl::flat_hash_map<std::string, const SafetensorsTensor*> by_name;
  for (const SafetensorsTensor& t : file) by_name[t.name] = &t;
  for (const TensorOptions& t : im.job.tensors) {
    auto it = by_name.find(t.name);
    if (it == by_name.end()) return absl::InvalidArgumentError(absl::StrCat(path, " has no tensor '", t.name, "'"));
    const SafetensorsTensor& f = *it->second;
    if (f.dtype != "F32" && f.dtype != "BF16") {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", t.name, "' is ", f.dtype, "; F32 or BF16 needed"));
    }
    if (f.data.size() != t.numel * (f.dtype == "F32" ? 4 : 2)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", t.name, "' has ", f.data.size(),
                                                     " bytes of ", f.dtype, "; the job's has ", t.numel, " elements"));
    }
  }
  for (const TensorOptions& t : im.job.tensors) {
    const SafetensorsTensor& f = *by_name[t.name];
    SHARDOPT_RETURN_IF_ERROR(im.CheckInit(t.name, f.data.data(), f.dtype == "F32" ? v1::FP32 : v1::BF16, v1::MASTER, {}));
  }
  for (const TensorOptions& t : im.job.tensors) {
    const SafetensorsTensor& f = *by_name[t.name];
    SHARDOPT_RETURN_IF_ERROR(im.InitTensor(t.name, f.data.data(), f.dtype == "F32" ? v1::FP32 : v1::BF16));
  }
  return absl::OkStatus();
}

absl::StatusOr<PushResult> Client::Push(uint64_t step, absl::Span<const GradView> grads) {
  std::vector<std::string> order;
  for (const GradView& g : grads) order.push_back(g.tensor);
  return PushInOrder(step, order, [&](size_t i) { return grads[i].data; });
}

absl::StatusOr<PushResult> Client::PushInOrder(uint64_t step, absl::Span<const std::string> order,
                                               const std::function<const void*(size_t)>& grad) {
  Impl& im = *impl_;
  SHARDOPT_RETURN_IF_ERROR(im.CheckAttached());
  std::vector<int64_t> position(im.job.tensors.size(), -1);  // [tensor]: its index in `order`
  for (size_t i = 0; i < order.size(); ++i) {
    SHARDOPT_RETURN_IF_ERROR(im.FindTensor(order[i]).status());
    int64_t& at = position[im.tensor_index[order[i]]];
    // Two gradients for one tensor: the last would be pushed and the other
    // silently ignored.
    if (at >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", order[i], "' is given twice (", at, " and ", i, ")"));
    }
    at = static_cast<int64_t>(i);
  }
  std::vector<v1::PushResponse> responses(im.servers());
  auto st = im.ForEachServer([&](uint32_t s) {
    // This server's shards in the caller's order; the shards of tensors
    // left out are declared without a gradient up front.
    std::vector<PushMessages::Send> sends;
    v1::GradChunk head;
    head.set_job(im.job.name);
    head.set_step(step);
    head.set_rank(im.options.rank);
    for (const ShardPlacement& p : im.shards_of[s]) {
      const uint32_t t = im.tensor_index[p.tensor];
      if (position[t] < 0) {
        head.add_no_grad(p.tensor);
      } else {
        sends.push_back({p.tensor, p.offset, p.length, im.grad_dtype(t), static_cast<size_t>(position[t])});
      }
    }
    std::stable_sort(sends.begin(), sends.end(), [](const PushMessages::Send& a, const PushMessages::Send& b) {
      return a.grad_index < b.grad_index;
    });
    return im.UnlessServerBehind(s, step, im.Call(s, im.push_timeout_ms(), [&](grpc::ClientContext* ctx) {
      // Made afresh for each attempt: a retried stream sends it all again,
      // with the life of the job a Reattach may have renewed.
      v1::GradChunk first = head;
      first.set_incarnation(im.incarnation[s]);
      first.set_trainer(im.trainer);
      first.set_attached_at(im.attached_at[s]);
      PushMessages messages(std::move(first), sends, im.chunk_bytes, grad);
      int answers = 0;
      auto received = [&](grpc::ByteBuffer* answer) -> grpc::Status {
        if (++answers > 1) return grpc::Status(grpc::StatusCode::INTERNAL, "the server answered a push twice");
        std::vector<grpc::Slice> slices;
        std::string bytes;
        if (answer->Dump(&slices).ok()) {
          for (const grpc::Slice& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
        }
        if (!responses[s].ParseFromString(bytes)) {
          return grpc::Status(grpc::StatusCode::INTERNAL, "malformed push response");
        }
        return grpc::Status::OK;
      };
      grpc::Status gs = wire::StreamCall::Run(
          im.generic[s].get(), ctx, "/shardopt.v1.Optimizer/Push",
          [&](grpc::ByteBuffer* out) { return messages.Next(out); }, [&] { messages.Wait(); }, received);
      // Without its answer the server's partial norm would be taken as 0.
      if (gs.ok() && answers == 0) {
        return grpc::Status(grpc::StatusCode::INTERNAL, "the server ended the push without an answer");
      }
      return gs;
    }));
  }, /*pushing=*/true);
  if (!st.ok()) return st;
  std::vector<PushPartial> partials(im.servers());
  for (uint32_t s = 0; s < im.servers(); ++s) partials[s] = {responses[s].sum_squares(), responses[s].nonfinite()};
  return CombinePartials(std::move(partials));
}

absl::Status Client::Commit(uint64_t step, double lr, float gscale, bool skip, absl::Span<const ParamView> params,
                            absl::Span<const double> group_lr) {
  SHARDOPT_ASSIGN_OR_RETURN(auto out, impl_->CommitTargets(lr, group_lr, params));
  return impl_->CommitTo(step, lr, gscale, skip, group_lr, out);
}

absl::StatusOr<StepResult> Client::Step(absl::Span<const GradView> grads, const StepOptions& options,
                                        absl::Span<const ParamView> params) {
  SHARDOPT_RETURN_IF_ERROR(CheckStepOptions(options));
  // Before the push: a Step refused after it would leave its gradients on
  // the servers, and the caller's next Step would be taken as its retry.
  SHARDOPT_ASSIGN_OR_RETURN(auto out, impl_->CommitTargets(options.lr, options.group_lr, params));
  const uint64_t t = impl_->step + 1;
  SHARDOPT_ASSIGN_OR_RETURN(auto push, Push(t, grads));
  StepResult result;
  result.step = t;
  result.decision = Decide(push, impl_->job.world_size, options);
  SHARDOPT_RETURN_IF_ERROR(
      impl_->CommitTo(t, options.lr, result.decision.gscale, result.decision.skip, options.group_lr, out));
  const uint64_t every = impl_->options.checkpoint_every;
  if (every > 0 && impl_->options.rank == 0 && t % every == 0) {
    // Said so, since the caller's way out of a failed Step, calling it
    // again, would here apply the next step with the same gradients.
    if (absl::Status st = Checkpoint(); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("step ", t, " was applied and its params returned (step() is ", t,
                                                  "; do not repeat it), but its checkpoint (checkpoint_every) failed; "
                                                  "call Checkpoint() for it: ",
                                                  st.message()));
    }
  }
  return result;
}

absl::Status Client::Read(const std::string& tensor, StateToRead what, uint64_t offset, uint64_t count, void* out) {
  Impl& im = *impl_;
  SHARDOPT_RETURN_IF_ERROR(im.CheckAttached());
  SHARDOPT_ASSIGN_OR_RETURN(auto t, im.FindTensor(tensor));
  if (out == nullptr && count > 0) return absl::InvalidArgumentError("Read needs a buffer to read into");
  if (offset > (t)->numel || count > (t)->numel - offset) {
    return absl::OutOfRangeError(absl::StrCat("range past tensor '", tensor, "''s ", (t)->numel, " elements"));
  }
  const uint64_t esize = what == StateToRead::kParamBf16 ? 2 : 4;
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
      return im.Call(s, im.options.rpc_timeout_ms, [&](grpc::ClientContext* ctx) {
        req.set_incarnation(im.incarnation[s]);  // at each attempt: a Reattach may have renewed it
        auto reader = im.stubs[s]->Read(ctx, req);
        v1::StateChunk chunk;
        uint64_t received = 0;
        while (reader->Read(&chunk)) {
          const uint64_t n = chunk.data().size() / esize;
          if (chunk.data().size() % esize != 0 || chunk.offset() < begin || chunk.offset() > end ||
              n > end - chunk.offset()) {
            ctx->TryCancel();
            reader->Finish();
            return grpc::Status(grpc::StatusCode::INTERNAL, "server sent state outside the range asked for");
          }
          std::memcpy(static_cast<char*>(out) + (chunk.offset() - offset) * esize, chunk.data().data(), n * esize);
          received += n;
          std::lock_guard<std::mutex> lock(step_mu);
          mixed = mixed || (read_step && *read_step != chunk.step());
          read_step = chunk.step();
        }
        grpc::Status finished = reader->Finish();
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

absl::Status Client::Checkpoint() {
  Impl& im = *impl_;
  SHARDOPT_RETURN_IF_ERROR(im.CheckAttached());
  std::vector<v1::CheckpointResponse> responses(im.servers());
  auto st = im.ForEachServer([&](uint32_t s) {
    return im.Call(s, im.options.rpc_timeout_ms, [&](grpc::ClientContext* ctx) {
      v1::CheckpointRequest req;
      req.set_job(im.job.name);
      req.set_step(im.step);
      req.set_incarnation(im.incarnation[s]);
      return im.stubs[s]->Checkpoint(ctx, req, &responses[s]);
    });
  });
  if (!st.ok()) return st;
  // The last server to write sees every part and writes the marker.
  for (const v1::CheckpointResponse& r : responses) {
    if (r.complete()) return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat("job '", im.job.name, "' step ", im.step,
                                                    ": every server wrote its part, but none saw all of them; do the "
                                                    "servers share one --checkpoint_dir?"));
}

absl::Status Client::Drop() {
  Impl& im = *impl_;
  SHARDOPT_RETURN_IF_ERROR(im.CheckAttached());
  auto st = im.ForEachServer([&](uint32_t s) {
    return im.Call(
        s, im.options.rpc_timeout_ms,
        [&](grpc::ClientContext* ctx) {
          v1::DropJobRequest req;
          req.set_job(im.job.name);
          req.set_incarnation(im.incarnation[s]);  // not a job made again since
          v1::DropJobResponse resp;
          return im.stubs[s]->DropJob(ctx, req, &resp);
        },
        /*reattach=*/false);
  });
  if (st.ok()) {
    im.attached = false;
    im.dropped = true;
  }
  return st;
}

}  // namespace shardopt
