#include "client/client_impl.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/attach_answers.h"
#include "client/commit_params.h"
#include "client/init_streams.h"
#include "client/option_checks.h"
#include "client/wire.h"
#include "rpc/initial_values.h"
#include "rpc/wire_format.h"

namespace shardopt {

absl::Status Client::Impl::ForkedFrom(pid_t parent) {
  return absl::FailedPreconditionError(absl::StrCat(
      "this process (", getpid(), ") is a fork of process ", parent, ", which made a Client: gRPC's threads, "
      "pollers and connections do not survive a fork, so no Client can be used here, that one or a new one; make "
      "Clients in a process started afresh (exec'd: posix_spawn, subprocess, multiprocessing's 'spawn')"));
}

Client::Impl::Entered::Entered(Impl& im) : im_(im) {
  if (getpid() != im.made_in) {
    status_ = ForkedFrom(im.made_in);
    return;
  }
  const std::thread::id me = std::this_thread::get_id();
  std::thread::id none;
  if (im.in_call.compare_exchange_strong(none, me)) {
    outer_ = true;
  } else if (none != me) {
    status_ = absl::FailedPreconditionError(
        "another thread is in a call of this Client, which is not thread-safe: call it from one thread at a time "
        "(nothing was sent)");
  }
}

Client::Impl::Entered::~Entered() {
  if (outer_) im_.in_call.store(std::thread::id());
}

absl::Status Client::Impl::CheckAttached() const {
  if (attached) return absl::OkStatus();
  if (dropped) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job.name, "' was dropped by this client (Drop): it ",
                                                      "is attached to no job until CreateOrAttach makes one anew"));
  }
  return absl::FailedPreconditionError("this client is attached to no job: call CreateOrAttach first");
}

absl::Status Client::Impl::Reattach(uint32_t s, const absl::Status& why) const {
  // Nothing begun yet: a failed fan-out need not wait for a restore.
  if (fanout::current != nullptr && fanout::current->failed()) {
    return fanout::FanoutCancelled(address(s));
  }
  v1::CreateJobResponse resp;
  bool at_next = false;
  SHARDOPT_RETURN_IF_ERROR(CreateAgain(s, &resp, &at_next));
  // The job restored (or attached by another rank) must be this client's
  // life too: a server that holds the job of a new run made since (or
  // restored its checkpoint, whose life is the next one) refuses this
  // trainer, left running. One that holds no job and has this life
  // marked dropped restores nothing and answers "was dropped".
  if (Kept(resp) && !SameLife(s, resp)) {
    return absl::NotFoundError(absl::StrCat("job '", job.name, "' on ", address(s), " is not the one this "
                                            "trainer attached to: the server restarted and holds another life of "
                                            "it, made since (by a new run, or by another trainer's attach while "
                                            "the server had no checkpoint of this one)"));
  }
  if (HoldsOurs(s, resp, at_next)) {
    TakeAttach(s, resp);
    return absl::OkStatus();
  }
  // Made afresh, with no checkpoint to restore: that server's part of the
  // state is gone, unless it restarted on another directory than the
  // others, whose checkpoint it would restore once back on theirs (then
  // dropping the job, the way out otherwise, would lose the step). The
  // fresh job, holding nothing, is dropped again.
  const bool made_afresh = resp.created() && !resp.restored();
  std::string moved;
  if (made_afresh) {
    moved = OtherDirectory(s, resp.incarnation());
    DropLife(s, resp.incarnation(), /*undo=*/false);  // a fresh job, with nothing in it
  }
  const absl::Status failed = absl::FailedPreconditionError(absl::StrCat(
      why.message(), "; asked to create job '", job.name, "' again, it ", ReattachOutcome(resp),
      ", and this client is at step ", step,
      !moved.empty() ? absl::StrCat(": it restarted on another checkpoint directory than ", moved,
                                    ": restart it on the job's --checkpoint_dir and call again, and it restores its "
                                    "part (do not drop the job: the other servers hold its step)")
      : made_afresh  ? ": its part of the job's state is lost; drop the job on every server (shardopt "
                       "--server=HOST:PORT drop JOB) and start it again, from a checkpoint elsewhere if there is one "
                       "(restore_step)"
      // Past the step of a client that has not pushed since it attached:
      // another client stepped the job meanwhile (this one only reads).
      : resp.step() > step && !pushed ? ": the job went on past this client's step since it attached (another "
                                        "client steps it): attach again (CreateOrAttach), which takes the job's step"
                                      : ": restore every server from one checkpoint: stop the trainers, drop the job "
                                        "on every server (shardopt --server=HOST:PORT drop JOB) or restart each, and "
                                        "start the trainers again (RemoteAdamW resume=True; in C++ a new client's "
                                        "CreateOrAttach), which restores the newest complete checkpoint on each"));
  std::lock_guard<std::mutex> lock(lost_mu);
  lost[s] = std::string(failed.message());
  return failed;
}

absl::Status Client::Impl::UnlessServerBehind(uint32_t s, uint64_t t, absl::Status st) const {
  if (!absl::IsOutOfRange(st) || !absl::StrContains(st.message(), " is in the future") || t != step + 1) return st;
  // Without the server's own advice ("; push step N"), which pushing that
  // step on one server only would follow.
  absl::string_view said = st.message();
  said = said.substr(0, said.rfind("; push step "));
  return absl::FailedPreconditionError(absl::StrCat(
      said, "; this trainer is at step ", step, ", so ", address(s),
      " lost steps (it restarted and restored an older checkpoint, or none); nothing of step ", t,
      " was applied on it. To go on: if every server of the job is at that step (shardopt describe on each: all "
      "restored one checkpoint), restart the trainers, which resume from it (the steps after it are lost); if "
      "the servers disagree, stop the trainers, restart every server of the job on its checkpoint directory so "
      "that each restores the same newest complete checkpoint (with no checkpoint, the job is lost), then start "
      "the trainers again"));
}

absl::Status Client::Impl::CommitOn(uint32_t s, const v1::CommitRequest& req, absl::Span<char* const> out) const {
  return UnlessServerBehind(
      s, req.step(), Call(s, options.rpc_timeout_ms, [&](grpc::ClientContext* ctx) {
        CommitParams received(job, tensor_index, shards_of[s], out, req.step());  // afresh for each attempt
        v1::CommitRequest here = req;
        here.set_incarnation(incarnation[s]);  // read at each attempt: a Reattach may have renewed it
        here.set_pack(true);  // CommitParams reads ParamChunk.more; older servers send none
        wire::SendOnce request(here.SerializeAsString());
        const grpc::Status gs = wire::StreamCall::Run(
            generic[s].get(), ctx, "/shardopt.v1.Optimizer/Commit", request, [] {},
            [&](grpc::ByteBuffer* message) { return received.Take(message); });
        return gs.ok() ? received.Whole() : gs;
      }));
}

std::vector<bool> Client::Impl::holds_part() const {
  std::vector<bool> holds(servers());
  for (uint32_t s = 0; s < servers(); ++s) holds[s] = !shards_of[s].empty();
  return holds;
}

namespace {

// What a server's Describe says of its checkpoint directory: its id,
// kNoDirectory, or "" (a server too old to say).
constexpr char kNoDirectory[] = "(none)";
std::string DirectoryOf(const v1::DescribeResponse& described) {
  return described.has_checkpoint_dir() && !described.checkpoint_dir() ? kNoDirectory : described.checkpoint_dir_id();
}

}  // namespace

absl::Status Client::Impl::DescribeSettings(uint32_t s, uint64_t life, int attempts, uint32_t timeout_ms,
                                            v1::DescribeResponse* out) const {
  // Not Call: no reattach (the job was just attached, or is being), and a
  // failure does not cancel the others' calls unless the caller makes it.
  return fanout::Call(channels[s].get(), address(s), options.token, attempts, timeout_ms,
                      [&](grpc::ClientContext* ctx) {
                        v1::DescribeRequest req;
                        req.set_job(job.name);
                        req.set_incarnation(life);
                        req.set_max_tensors(1);  // the server's settings, not the tensors
                        return stubs[s]->Describe(ctx, req, out);
                      });
}

std::string Client::Impl::OtherDirectory(uint32_t s, uint64_t life) const {
  // One attempt, of at most 5 s, for each server in turn: a hint for an
  // error, while a step's other calls wait.
  const uint32_t timeout_ms = std::min<uint32_t>(options.rpc_timeout_ms, 5000);
  const auto directory_of = [&](uint32_t server, uint64_t its_life) {
    v1::DescribeResponse described;
    return DescribeSettings(server, its_life, 1, timeout_ms, &described).ok() ? DirectoryOf(described) : "";
  };
  const std::string here = directory_of(s, life);
  if (here.empty()) return "";
  for (uint32_t o = 0; o < servers(); ++o) {
    if (o == s || shards_of[o].empty()) continue;
    // Life 0, not checked: another server's life is its own thread's to read.
    if (const std::string there = directory_of(o, 0); !there.empty() && there != here) {
      return absl::StrCat("server ", address(o), "'s (directory ids ", here, " and ", there, ")");
    }
  }
  return "";
}

absl::Status Client::Impl::CheckCheckpointsCanBeTaken(bool directories_only) const {
  // Asked by rank 0 alone but with directories_only (client.cc): only rank
  // 0 takes the checkpoints of checkpoint_every.
  const bool every = !directories_only && options.checkpoint_every > 0;
  const std::vector<bool> holds = holds_part();
  if (!every && std::count(holds.begin(), holds.end(), true) < 2) return absl::OkStatus();  // nothing to compare
  std::vector<std::string> dirs(servers());  // DirectoryOf each; "" where it did not answer
  SHARDOPT_RETURN_IF_ERROR(ForEachServer([&](uint32_t s) -> absl::Status {
    v1::DescribeResponse described;
    const absl::Status asked =
        DescribeSettings(s, incarnation[s], options.max_attempts, options.rpc_timeout_ms, &described);
    // Without checkpoint_every the directories are compared as a safeguard
    // only: a server that does not answer is not compared, as one too old
    // to report its directory is not, and the attach stays as it was.
    if (!asked.ok()) return every ? fanout::FailFanout(asked) : absl::OkStatus();
    dirs[s] = DirectoryOf(described);
    if (every && dirs[s] == kNoDirectory) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint_every is ", options.checkpoint_every, ", but server ", address(s),
          " has no --checkpoint_dir: each of its checkpoints would fail after its step was applied; start the "
          "servers with --checkpoint_dir, or give checkpoint_every 0"));
    }
    return absl::OkStatus();
  }));
  const auto first =
      std::find_if(dirs.begin(), dirs.end(), [](const std::string& d) { return !d.empty() && d != kNoDirectory; });
  if (first == dirs.end()) return absl::OkStatus();  // no directories, or none said
  const uint32_t f = static_cast<uint32_t>(first - dirs.begin());
  for (uint32_t s = 0; s < servers(); ++s) {
    if (dirs[s] == kNoDirectory) {
      return absl::FailedPreconditionError(absl::StrCat(
          "server ", address(f), " of job '", job.name, "' has a --checkpoint_dir and server ", address(s),
          " has none: no checkpoint of the job would complete, and a restart of ", address(s),
          " would lose its part; give every server of the job the same --checkpoint_dir, or none"));
    }
    if (!dirs[s].empty() && dirs[s] != dirs[f]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "servers ", address(f), " and ", address(s), " of job '", job.name,
          "' have different checkpoint directories (their --checkpoint_dir holds directory id ", dirs[f], " and ",
          dirs[s], "): no server would see every part of a checkpoint, so none would complete, and a restart of "
          "the servers would lose the job; mount one shared directory at every server's --checkpoint_dir (the "
          "same path on separate volumes, or copies of one directory, are not one; if they do share one, its id "
          "file, shardopt+directory-id, was replaced since one of them started: restart that one)"));
    }
  }
  return absl::OkStatus();
}

absl::Status Client::Impl::AskCreateJob(const JobOptions& job, std::vector<v1::CreateJobResponse>* answers) const {
  answers->assign(servers(), v1::CreateJobResponse());
  return ForEachServer([&](uint32_t s) {
    const fanout::Detached detached;
    const v1::CreateJobRequest req = ToCreateJobRequest(job, shards_of[s], options.rank);
    return Call(s, options.rpc_timeout_ms, [&](grpc::ClientContext* ctx) {
      return stubs[s]->CreateJob(ctx, req, &(*answers)[s]);
    });
  });
}

void Client::Impl::DropLife(uint32_t s, uint64_t life, bool undo) const {
  if (life == 0) return;  // none made, or a server too old to name lives
  const fanout::Detached detached;
  fanout::Call(channels[s].get(), address(s), options.token, options.max_attempts, options.rpc_timeout_ms,
               [&](grpc::ClientContext* ctx) {
                 v1::DropJobRequest drop;
                 drop.set_job(job.name);
                 drop.set_incarnation(life);  // the job it made, not one made meanwhile
                 drop.set_undo(undo);
                 v1::DropJobResponse unused;
                 return stubs[s]->DropJob(ctx, drop, &unused);
               })
      .IgnoreError();
}

absl::StatusOr<const TensorOptions*> Client::Impl::FindTensor(const std::string& name) const {
  auto it = tensor_index.find(name);
  if (it == tensor_index.end()) {
    return absl::NotFoundError(absl::StrCat("job '", job.name, "' has no tensor '", name, "'"));
  }
  return &job.tensors[it->second];
}

absl::StatusOr<std::vector<v1::DescribeResponse>> Client::Impl::DescribeAll() const {
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

absl::StatusOr<std::vector<char*>> Client::Impl::CommitTargets(double lr, absl::Span<const double> group_lr,
                                                               absl::Span<const ParamView> params) const {
  SHARDOPT_RETURN_IF_ERROR(CheckAttached());
  SHARDOPT_RETURN_IF_ERROR(CheckJobLearningRates(job, lr, group_lr));
  std::vector<char*> out(job.tensors.size(), nullptr);
  for (const ParamView& p : params) {
    SHARDOPT_RETURN_IF_ERROR(FindTensor(p.tensor).status());
    char*& target = out[tensor_index.at(p.tensor)];
    // One buffer would be written and the other left as it was, the call OK.
    if (target != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", p.tensor, "' is given two params buffers"));
    }
    target = static_cast<char*>(p.data);
  }
  return out;
}

absl::Status Client::Impl::CommitTo(uint64_t t, double lr, float gscale, bool skip, absl::Span<const double> group_lr,
                                    const std::vector<char*>& out) {
  v1::CommitRequest req;
  req.set_job(job.name);
  req.set_step(t);
  req.set_skip(skip);
  // A skip's other arguments are the same for every skip (the server's
  // too): ranks that skip a step for different reasons agree.
  req.set_lr(skip ? 0.0 : lr);
  req.set_gscale(skip ? 1.0f : gscale);
  if (!skip) {
    for (double g : group_lr) req.add_group_lr(g);
  }
  SHARDOPT_RETURN_IF_ERROR(ForEachServer([&](uint32_t s) { return CommitOn(s, req, out); }, /*pushing=*/true));
  step = std::max(step, t);
  return absl::OkStatus();
}

ShardPlacement Client::Impl::ShareOf(const ShardPlacement& placed, InitShare share) {
  ShardPlacement p = placed;
  p.offset = placed.offset + placed.length * share.index / share.count;
  p.length = placed.offset + placed.length * (share.index + 1) / share.count - p.offset;
  return p;
}

absl::Status Client::Impl::CheckShare(InitShare share) {
  if (share.count == 0 || share.index >= share.count) {
    return absl::InvalidArgumentError(
        absl::StrCat("init share ", share.index, " of ", share.count, " is out of range: 0 <= index < count"));
  }
  return absl::OkStatus();
}

absl::Status Client::Impl::CheckInit(const std::string& tensor, const void* values, v1::DType dtype, v1::StateKind kind,
                                     InitShare share) const {
  SHARDOPT_RETURN_IF_ERROR(CheckAttached());
  SHARDOPT_ASSIGN_OR_RETURN(const TensorOptions* t, FindTensor(tensor));
  SHARDOPT_RETURN_IF_ERROR(CheckShare(share));
  if (values == nullptr) return absl::InvalidArgumentError(absl::StrCat("no values given for tensor '", tensor, "'"));
  const bool bf16_state = job.groups[t->group].precision == StatePrecision::kBf16;
  const InitialKind initial = kind == v1::EXP_AVG      ? InitialKind::kExpAvg
                              : kind == v1::EXP_AVG_SQ ? InitialKind::kExpAvgSq
                                                       : InitialKind::kMaster;
  const uint64_t esize = dtype == v1::FP32 ? 4 : 2;
  for (const ShardPlacement* placed : PartsOf(t)) {
    const ShardPlacement p = ShareOf(*placed, share);
    SHARDOPT_RETURN_IF_ERROR(CheckInitialValues(static_cast<const char*>(values) + p.offset * esize, p.length,
                                                dtype == v1::FP32, bf16_state, initial, absl::StrCat("'", tensor, "'"),
                                                p.offset));
  }
  return absl::OkStatus();
}

namespace {
// The most data one Init stream carries (client/init_streams.h).
constexpr uint64_t kInitStreamBytes = uint64_t{256} << 20;
}  // namespace

absl::Status Client::Impl::SendInit(absl::Span<const InitWrite> writes, InitShare share) {
  // [server]: this caller's share of each write's part there, in the writes'
  // order, and the write of each.
  std::vector<std::vector<InitRange>> ranges(servers());
  std::vector<std::vector<const InitWrite*>> of_write(servers());
  for (const InitWrite& w : writes) {
    SHARDOPT_ASSIGN_OR_RETURN(const TensorOptions* t, FindTensor(w.tensor));
    for (const ShardPlacement* placed : PartsOf(t)) {
      const ShardPlacement mine = ShareOf(*placed, share);
      ranges[placed->server].push_back({mine.offset, mine.length, w.dtype == v1::FP32 ? 4u : 2u});
      of_write[placed->server].push_back(&w);
    }
  }
  // One stream to server s. Each chunk borrows its data from the write's
  // values (as a push borrows the gradients), where protobuf would copy it
  // into the message, and again when gRPC serialized it.
  const auto send = [&](uint32_t s, const std::vector<InitPiece>& pieces) {
    return Call(s, options.rpc_timeout_ms, [&](grpc::ClientContext* ctx) {
      size_t k = 0;  // the piece being sent, from `off`, with its chunks' other fields in `common`
      uint64_t off = 0;
      std::string common;
      const auto begin_piece = [&] {
        const InitWrite& w = *of_write[s][pieces[k].range];
        v1::InitChunk fields;
        fields.set_job(job.name);
        fields.set_tensor(w.tensor);
        fields.set_dtype(w.dtype);
        fields.set_kind(w.kind);
        fields.set_adam_step(w.adam_step);
        fields.set_incarnation(incarnation[s]);
        common = fields.SerializeAsString();
        off = pieces[k].offset;
      };
      begin_piece();
      auto next = [&](grpc::ByteBuffer* message) {
        if (k == pieces.size()) return wire::StreamCall::Ready::kEnd;
        const InitPiece& piece = pieces[k];
        const uint64_t esize = ranges[s][piece.range].esize;
        const uint64_t n = std::min(std::max<uint64_t>(1, chunk_bytes / esize), piece.offset + piece.length - off);
        std::string head = common;
        wire::AppendVarintField(&head, v1::InitChunk::kOffsetFieldNumber, off);
        wire::AppendBytesHeader(&head, v1::InitChunk::kDataFieldNumber, n * esize);
        const char* values = static_cast<const char*>(of_write[s][piece.range]->values);
        *message = wire::HeadAndBorrowedBytes(head, values + off * esize, n * esize);
        off += n;
        if (off == piece.offset + piece.length && ++k < pieces.size()) begin_piece();
        return wire::StreamCall::Ready::kMessage;
      };
      v1::InitResponse answer;
      const wire::OneAnswer received(&answer, "init");
      return received.Ended(
          wire::StreamCall::Run(generic[s].get(), ctx, "/shardopt.v1.Optimizer/Init", next, [] {}, received));
    });
  };
  return ForEachServer([&](uint32_t s) -> absl::Status {
    for (const std::vector<InitPiece>& stream : CutIntoStreams(ranges[s], kInitStreamBytes)) {
      SHARDOPT_RETURN_IF_ERROR(send(s, stream));
    }
    return absl::OkStatus();
  });
}

}  // namespace shardopt
