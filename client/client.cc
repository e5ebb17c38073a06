#include "shardopt/client.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "client/after_step.h"
#include "client/attach_answers.h"
#include "client/client_impl.h"
#include "client/option_checks.h"
#include "client/push_messages.h"
#include "client/wire.h"
#include "rpc/chunk_size.h"
#include "rpc/grpc_edge.h"
#include "rpc/push_incomplete.h"

namespace shardopt {

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() {
  // In a process forked from the one that made it, tearing gRPC's objects
  // down waits for threads that stayed in the parent (a child's exit hung):
  // they are left in place, for the process's end to free.
  if (impl_ != nullptr && getpid() != impl_->made_in) (void)impl_.release();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  // gRPC's pollers and threads are the process's that started them. In a
  // process forked from one that made a Client, a new Client's calls hung,
  // past their deadlines, or took the answers the parent's Client waited
  // for, which then waited out its own (an outside probe; so with
  // GRPC_ENABLE_FORK_SUPPORT=1 too): refused before anything of gRPC's is
  // touched. The first Connect's process, which a fork's memory keeps.
  static const pid_t grpc_process = getpid();
  if (getpid() != grpc_process) return Impl::ForkedFrom(grpc_process);
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
std::vector<double> Client::applied_group_lr() const { return impl_->applied_group_lr; }
uint64_t Client::chunk_bytes() const { return impl_->chunk_bytes; }

absl::StatusOr<uint64_t> Client::CreateOrAttach(const JobOptions& job) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  Impl& im = *impl_;
  im.attached = false;  // until this job is: a failed attach leaves no half of it
  im.dropped = false;
  im.pushed = false;
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
  im.parts_of.assign(job.tensors.size(), {});
  for (const std::vector<ShardPlacement>& parts : im.shards_of) {
    for (const ShardPlacement& p : parts) im.parts_of[im.tensor_index.at(p.tensor)].push_back(&p);
  }

  const std::vector<bool> holds_part = im.holds_part();
  std::vector<v1::CreateJobResponse> answers;
  std::optional<HalfCommitted> half;
  // Each CreateJob this attach had answered OK, by server and life: all
  // are undone if it fails (DropLife with undo), so that it changes nothing. A
  // server listed by mistake (a rank's one server too many, whose peers
  // refuse it ALREADY_EXISTS) kept the job, restored from an older
  // checkpoint or empty, and the next attach with the right servers found
  // it at another step than its peers.
  // Cancelled once attached, and where the job must stay.
  std::vector<std::pair<uint32_t, uint64_t>> answered;
  absl::Cleanup undo = [&] {
    std::vector<uint32_t> targets(answered.size());
    std::iota(targets.begin(), targets.end(), 0u);
    fanout::ForEach(targets, [&](uint32_t i) {
      im.DropLife(answered[i].first, answered[i].second, /*undo=*/true);
      return absl::OkStatus();
    }).IgnoreError();
  };
  // Servers one step apart that cannot be completed may be a torn view:
  // each answered at its own moment while another trainer's push sealed
  // that step and its commit applied it. Asked again (1.5 s in all), they
  // agree, or can be completed; a difference that stays is refused below.
  int asked = 0;
  std::chrono::milliseconds waited{0};
  for (auto pause = std::chrono::milliseconds(100);; pause *= 2) {
    const absl::Status asked_all = im.AskCreateJob(job, &answers);
    for (uint32_t s = 0; s < im.servers(); ++s) {
      if (answers[s].incarnation() != 0) answered.emplace_back(s, answers[s].incarnation());
    }
    SHARDOPT_RETURN_IF_ERROR(asked_all);
    ++asked;
    half = FindHalfCommittedStep(answers, holds_part);
    // Servers behind whose drain wrote their part of the step the others
    // hold live (a node drain restarted a server and this trainer): that
    // step is completed on the others, what the restarts made or restored
    // is undone, and they are asked again, to restore it. Other ranks'
    // attaches may hold the made jobs a while (each undoes its own).
    bool completed = false;
    if (const auto torn = half ? std::nullopt : FindDrainTornStep(answers, holds_part)) {
      std::vector<uint64_t> lives(im.servers());
      for (uint32_t s = 0; s < im.servers(); ++s) lives[s] = answers[s].incarnation();
      completed = im.CompleteStepOn(torn->at, torn->step, lives);
      if (completed) {
        for (uint32_t s : torn->behind) im.DropLife(s, lives[s], /*undo=*/true);
      }
    }
    if (half || (!completed && !OneStepApart(answers, holds_part)) || pause > std::chrono::milliseconds(800)) break;
    std::this_thread::sleep_for(pause);
    waited += pause;
  }
  im.incarnation.clear();
  im.attached_at.clear();
  im.takes_packed_grads.clear();
  for (const v1::CreateJobResponse& answer : answers) {
    im.incarnation.push_back(answer.incarnation());
    im.attached_at.push_back(answer.push_clock());
    im.takes_packed_grads.push_back(answer.takes_packed_grads());
  }
  // A step its trainer committed on some servers only is committed on the
  // others, as the trainer's own retry would have been, so that a restarted
  // trainer attaches at that step (their sealed round keeps its gradients:
  // nothing new is summed). Any other difference is refused below.
  if (half) {
    half->commit.set_job(job.name);
    const std::vector<char*> discard(job.tensors.size(), nullptr);
    SHARDOPT_RETURN_IF_ERROR(
        fanout::ForEach(half->behind, [&](uint32_t s) { return im.CommitOn(s, half->commit, discard); }));
    for (uint32_t s : half->behind) answers[s].set_step(half->commit.step());
  }
  absl::StatusOr<uint64_t> agreed = AgreedStep(answers, holds_part, im.options.servers, job.name);
  if (!agreed.ok()) {
    // Servers on separate directories (one restarted on another) say so:
    // dropping the job, the way out below, would lose the others' step.
    // Then the undo drops what this call made or restored and nothing
    // touched since (the job a server made afresh on the wrong directory);
    // a live job stays, and a restored one is on disk still.
    SHARDOPT_RETURN_IF_ERROR(im.CheckCheckpointsCanBeTaken(/*directories_only=*/true));
    // Servers that all answered, at different steps, keep what they
    // restored: the error says to drop the job on each, which must then
    // find it there.
    std::move(undo).Cancel();
    if (asked == 1) return agreed.status();
    return absl::Status(agreed.status().code(),
                        absl::StrCat(agreed.status().message(), " (asked ", asked, " times over ",
                                     static_cast<double>(waited.count()) / 1000, " s: not a step another trainer "
                                     "was committing meanwhile)"));
  }
  const uint64_t step = *agreed;
  if (job.resume == Resume::kNew && step != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.name, "' is at step ", step, " on its servers (held, or restored from a checkpoint), and this "
        "launch asked for a new job (resume: new): another run holds this name; give this run another job name, or "
        "drop the job first (a checkpoint of it stays on disk), or resume it"));
  }
  if (job.resume == Resume::kOnly && step == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.name, "' is at step 0: no server held it at a later step, nor a checkpoint of a later step "
        "(servers restarted on empty or other --checkpoint_dir directories?), and this launch asked to resume it "
        "(resume: only); a job this call made is dropped again"));
  }
  im.step = step;
  im.pushed_ahead = PushedAhead(answers, step, holds_part, im.pushes_to);
  im.applied_group_lr = AppliedGroupLr(answers, step, holds_part, job.groups.size());
  std::vector<uint64_t> sent_to, barrier;  // the limits of the servers this job's messages go to
  for (uint32_t s = 0; s < im.servers(); ++s) {
    barrier.push_back(answers[s].barrier_timeout_ms());
    if (!holds_part[s]) continue;
    const uint64_t max = answers[s].max_message_bytes();
    sent_to.push_back(max);
    // A size the caller chose is kept as given, so one that cannot fit is
    // said here, not as gRPC's "Sent message larger than max" at each push.
    if (const uint64_t chosen = im.options.chunk_bytes; chosen > 0 && max > 0 && chosen > max / 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ClientOptions::chunk_bytes is ", chosen, ", more than half of server ", im.options.servers[s],
          "'s --max_message_bytes (", max, "), which a message must leave room in for its other fields: give at "
          "most ", max / 2, ", or 0 to let the client choose"));
    }
  }
  im.chunk_bytes = ChunkBytesFor(im.options.chunk_bytes, job.world_size, sent_to);
  // The job's own deadline, or what its servers say it is when it gave none
  // (their --barrier_timeout_ms); servers too old to say default to 60 s.
  im.barrier_ms = job.barrier_timeout_ms;
  if (im.barrier_ms == 0) {
    const uint64_t said = *std::max_element(barrier.begin(), barrier.end());
    im.barrier_ms = said > 0 ? static_cast<uint32_t>(said) : 60000;
  }
  if (im.options.rank == 0) SHARDOPT_RETURN_IF_ERROR(im.CheckCheckpointsCanBeTaken());
  std::move(undo).Cancel();
  im.attached = true;
  return step;
}

absl::StatusOr<PushResult> Client::Push(uint64_t step, absl::Span<const GradView> grads, const StepOptions* intent) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  std::vector<std::string> order;
  for (const GradView& g : grads) order.push_back(g.tensor);
  // Every gradient is given: each is asked for on gRPC's thread.
  return PushGradients(
      step, order, [&](size_t i) { return grads[i].data; }, [](size_t) { return true; }, intent);
}

absl::StatusOr<PushResult> Client::PushInOrder(uint64_t step, absl::Span<const std::string> order,
                                               const std::function<const void*(size_t)>& grad,
                                               const StepOptions* intent, const std::function<bool(size_t)>& ready) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  // Called on gRPC's threads, where an empty one's throw ended the process.
  if (!grad) return absl::InvalidArgumentError("PushInOrder needs a grad function (ready may be empty); nothing was sent");
  return PushGradients(step, order, grad, ready, intent);
}

absl::StatusOr<PushResult> Client::PushGradients(uint64_t step, absl::Span<const std::string> order,
                                                 const std::function<const void*(size_t)>& grad,
                                                 const std::function<bool(size_t)>& ready, const StepOptions* intent) {
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
  im.pushed = true;
  std::vector<v1::PushResponse> responses(im.servers());
  auto st = im.ForEachServer([&](uint32_t s) {
    // This server's shards in the caller's order; the shards of tensors
    // left out are declared without a gradient up front.
    std::vector<PushMessages::Send> sends;
    v1::GradChunk head;
    head.set_job(im.job.name);
    head.set_step(step);
    head.set_rank(im.options.rank);
    if (intent != nullptr) *head.mutable_intent() = ToProto(*intent);
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
      first.set_chunk_bytes(im.chunk_bytes);
      PushMessages messages(std::move(first), sends, im.chunk_bytes, im.takes_packed_grads[s] != 0, grad, ready);
      // Without its answer the server's partial norm would be taken as 0.
      const wire::OneAnswer received(&responses[s], "push");
      return received.Ended(wire::StreamCall::Run(
          im.generic[s].get(), ctx, "/shardopt.v1.Optimizer/Push",
          [&](grpc::ByteBuffer* out) { return messages.Next(out); }, [&] { messages.Wait(); }, received));
    }));
  }, /*pushing=*/true);
  if (!st.ok()) return st;
  std::vector<PushPartial> partials(im.servers());
  for (uint32_t s = 0; s < im.servers(); ++s) partials[s] = {responses[s].sum_squares(), responses[s].nonfinite()};
  return CombinePartials(std::move(partials));
}

absl::Status Client::Commit(uint64_t step, double lr, float gscale, bool skip, absl::Span<const ParamView> params,
                            absl::Span<const double> group_lr) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  // A skip sends none of its learning rates (CommitTo), so they are not checked.
  SHARDOPT_ASSIGN_OR_RETURN(auto out, skip ? impl_->CommitTargets(0.0, {}, params)
                                           : impl_->CommitTargets(lr, group_lr, params));
  if (skip) return CommitSkip(step, out);
  return impl_->CommitTo(step, lr, gscale, skip, group_lr, out);
}

absl::Status Client::CommitSkip(uint64_t t, const std::vector<char*>& out) {
  const absl::Status skipped = impl_->CommitTo(t, 0.0, 1.0f, /*skip=*/true, {}, out);
  if (!IsPushIncomplete(skipped, t)) return skipped;
  SHARDOPT_RETURN_IF_ERROR(PushInOrder(t, {}, [](size_t) -> const void* { return nullptr; }).status());
  return impl_->CommitTo(t, 0.0, 1.0f, /*skip=*/true, {}, out);
}

absl::StatusOr<StepResult> Client::Step(absl::Span<const GradView> grads, const StepOptions& options,
                                        absl::Span<const ParamView> params) {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
  SHARDOPT_RETURN_IF_ERROR(CheckStepOptions(options, Trainers(impl_->job)));
  // Before the push: a Step refused after it would leave its gradients on
  // the servers, and the caller's next Step would be taken as its retry.
  SHARDOPT_ASSIGN_OR_RETURN(auto out, impl_->CommitTargets(options.lr, options.group_lr, params));
  const uint64_t t = impl_->step + 1;
  SHARDOPT_ASSIGN_OR_RETURN(auto push, Push(t, grads, &options));
  StepResult result;
  result.step = t;
  result.decision = Decide(push, Trainers(impl_->job), options);
  const auto commit = [&] {
    return result.decision.skip
               ? CommitSkip(t, out)
               : impl_->CommitTo(t, options.lr, result.decision.gscale, false, options.group_lr, out);
  };
  absl::Status committed = commit();
  // A server that lost the push is pushed the caller's gradients again, once
  // (a skip's commit has done so already). Its answer must decide the step
  // as before: the other servers may have applied it so.
  if (!result.decision.skip && IsPushIncomplete(committed, t)) {
    SHARDOPT_ASSIGN_OR_RETURN(auto again, Push(t, grads, &options));
    const Decision redecided = Decide(again, Trainers(impl_->job), options);
    if (redecided.skip || redecided.gscale != result.decision.gscale) {
      return RepushDecidedOtherwise(t, result.decision.gscale, redecided);
    }
    committed = commit();
  }
  SHARDOPT_RETURN_IF_ERROR(committed);
  const uint64_t every = impl_->options.checkpoint_every;
  if (every > 0 && impl_->options.checkpoint_in_step && impl_->options.rank == 0 && t % every == 0) {
    if (absl::Status st = Checkpoint(); !st.ok()) return CheckpointAfterStepFailed(t, st, impl_->FailedForALostServer(st));
  }
  return result;
}

absl::Status Client::Checkpoint() {
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
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
  const Impl::Entered call(*impl_);
  SHARDOPT_RETURN_IF_ERROR(call.status());
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
