// Client::Impl's way back for a server whose drain (SIGTERM, a pod's
// restart) wrote its part of the step its peers still hold: that step is
// checkpointed on the peers, which completes it, and the server asked again
// until it restores it (docs/design.md, section 7.4).
#include <algorithm>
#include <chrono>
#include <thread>

#include "client/client_impl.h"
#include "client/proto_convert.h"

namespace shardopt {

absl::Status Client::Impl::CreateAgain(uint32_t s, v1::CreateJobResponse* answer, bool* at_next) const {
  // A CreateJob cut off may have made the job afresh, and the drop that
  // undoes it must be sent: not cancelled by another server's failure.
  const fanout::Detached detached;
  v1::CreateJobRequest req = ToCreateJobRequest(job, shards_of[s], options.rank);
  req.set_restore_step(0);              // this run's newest, whatever the launch asked for
  req.set_incarnation(incarnation[s]);  // not if that life was dropped on purpose
  v1::CreateJobResponse& resp = *answer;
  const auto create = [&] {
    return fanout::Call(channels[s].get(), address(s), options.token, options.max_attempts, options.rpc_timeout_ms,
                        [&](grpc::ClientContext* ctx) { return stubs[s]->CreateJob(ctx, req, &resp); });
  };
  SHARDOPT_RETURN_IF_ERROR(create());
  // Not holding this client's step in its life, with its own part of that
  // step, of that life, on disk: its drain (SIGTERM, a pod's restart) wrote
  // the part while the others held the step, which their parts now
  // complete. The job made or restored here is undone (its life not
  // marked), and the next CreateJob restores the step. Other ranks may be
  // doing the same, each undoing only its own count of the job made here:
  // a pause after the undo lets them, and the job is asked for again a few
  // times. So is one that another rank made or restored here and no part
  // names (that rank may have completed the step already, and be about to
  // undo it); not one this call made, with nothing of this client's step.
  std::vector<uint32_t> peers;
  for (uint32_t o = 0; o < servers(); ++o) {
    if (o != s && !shards_of[o].empty()) peers.push_back(o);
  }
  // Where the peers cannot complete the step (one applied the next step
  // already: its commit reached it and not this server), this server's own
  // part of it is its state at the step, and it is asked to restore that
  // part alone (CreateJobRequest.own_part_step); the call then pushes and
  // commits the next step again, as after any restart between the two.
  // The part may be of the next step too: this server applied it (its
  // drain let the sealed round's commit apply) and its answer to this
  // client was cut off by the stop, so that this client, at `step`, calls
  // the next step again; its peers applied it, or hold its sealed round.
  // That part is then the server's state, and the call's push and commit
  // of that step are answered from it as retries are (`at_next`).
  bool tried = false, completed = false;
  *at_next = false;
  for (auto pause = std::chrono::milliseconds(100); !HoldsOurs(s, resp, *at_next); pause *= 2) {
    const bool own = resp.has_own_part_step() && (resp.own_part_step() == step || resp.own_part_step() == step + 1);
    if (own && !tried) {
      *at_next = resp.own_part_step() == step + 1;
      completed = CompleteStepOn(peers, resp.own_part_step(), incarnation);
      tried = true;
    }
    const bool others = !resp.created();  // another rank's attach made or restored it
    if (!own && !(others && pause <= std::chrono::milliseconds(200))) break;
    if (pause > std::chrono::milliseconds(800)) break;
    DropLife(s, resp.incarnation(), /*undo=*/true);
    if (others || pause > std::chrono::milliseconds(100)) std::this_thread::sleep_for(pause);
    if (own && !completed) {
      req.set_own_part_step(resp.own_part_step());
    } else {
      req.clear_own_part_step();
    }
    SHARDOPT_RETURN_IF_ERROR(create());
  }
  return absl::OkStatus();
}

bool Client::Impl::Kept(const v1::CreateJobResponse& resp) { return resp.restored() || !resp.created(); }

bool Client::Impl::SameLife(uint32_t s, const v1::CreateJobResponse& resp) const {
  return incarnation[s] == 0 || resp.incarnation() == 0 || resp.incarnation() == incarnation[s];
}

bool Client::Impl::HoldsOurs(uint32_t s, const v1::CreateJobResponse& resp, bool at_next) const {
  return Kept(resp) && (resp.step() == step || (at_next && resp.step() == step + 1)) && SameLife(s, resp);
}

void Client::Impl::TakeAttach(uint32_t s, const v1::CreateJobResponse& resp) const {
  incarnation[s] = resp.incarnation();  // its own, or the first this client learns of a server without lives
  attached_at[s] = resp.push_clock();
  takes_packed_grads[s] = resp.takes_packed_grads();
}

bool Client::Impl::CompleteTornOn(uint32_t s) const {
  if (fanout::current != nullptr && fanout::current->failed()) return false;
  v1::CreateJobResponse resp;
  bool at_next = false;
  if (!CreateAgain(s, &resp, &at_next).ok()) return false;
  if (HoldsOurs(s, resp, at_next)) {
    TakeAttach(s, resp);
    return true;
  }
  DropLife(s, resp.incarnation(), /*undo=*/true);  // this call's attach, or the job it made
  return false;
}

bool Client::Impl::CompleteStepOn(const std::vector<uint32_t>& on, uint64_t t,
                                  const std::vector<uint64_t>& lives) const {
  if (on.empty()) return false;
  std::vector<v1::CheckpointResponse> answers(servers());
  const absl::Status written = fanout::ForEach(on, [&](uint32_t o) {
    return fanout::FailFanout(fanout::Call(
        channels[o].get(), address(o), options.token, options.max_attempts, options.rpc_timeout_ms,
        [&](grpc::ClientContext* ctx) {
          v1::CheckpointRequest req;
          req.set_job(job.name);
          req.set_step(t);  // FAILED_PRECONDITION on a server that applied another step: nothing written there
          req.set_incarnation(lives[o]);
          return stubs[o]->Checkpoint(ctx, req, &answers[o]);
        }));
  });
  return written.ok() && std::any_of(answers.begin(), answers.end(), [](const v1::CheckpointResponse& a) {
           return a.complete();
         });
}

}  // namespace shardopt
