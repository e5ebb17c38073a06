// What the job's servers' CreateJob answers say about attaching to it:
// pure functions of the answers, with no calls (Client::CreateOrAttach
// makes the calls and acts on these). `holds_part[s]`: server s holds part
// of the job; servers that hold none are not asked about it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

// A step that some of the job's servers applied and the others only sealed
// (its trainer died between its commits): the servers behind, and the
// commit that completes it there, with the arguments the others applied it
// with (the request's job is left to the caller). Nothing if the servers
// are not exactly one step apart, if a server does not keep that step's
// sealed round (a server too old to say reports 0), or if the servers past
// it applied it with other arguments.
struct HalfCommitted {
  std::vector<uint32_t> behind;
  v1::CommitRequest commit;
};
std::optional<HalfCommitted> FindHalfCommittedStep(const std::vector<v1::CreateJobResponse>& answers,
                                                   const std::vector<bool>& holds_part);

// Whether the servers holding a part are exactly one step apart: a view
// that may be torn (each server answered at its own moment while another
// trainer sealed and applied that step), so worth asking again.
bool OneStepApart(const std::vector<v1::CreateJobResponse>& answers, const std::vector<bool>& holds_part);

// The step every server holding a part is at, or FAILED_PRECONDITION
// naming each server's (`addresses`) and what to do.
absl::StatusOr<uint64_t> AgreedStep(const std::vector<v1::CreateJobResponse>& answers,
                                    const std::vector<bool>& holds_part, const std::vector<std::string>& addresses,
                                    const std::string& job);

// A step one server's drain tore while its peers held it live: every server
// holding a part is at `step` (the highest) but those `behind`, each of
// which answered with its own part of `step` on disk
// (CreateJobResponse.own_part_step) and is at an older one. The servers
// `at` it can complete it (a Checkpoint of it). nullopt otherwise.
struct DrainTorn {
  uint64_t step = 0;
  std::vector<uint32_t> behind, at;
};
std::optional<DrainTorn> FindDrainTornStep(const std::vector<v1::CreateJobResponse>& answers,
                                           const std::vector<bool>& holds_part);

// What a server did when a trainer that lost its job there asked to create
// it again (a re-attach), for the trainer's error: "restored step N", "holds
// it at step N" (another trainer's attach restored or made it first), or
// "has no checkpoint of it" (made afresh).
std::string ReattachOutcome(const v1::CreateJobResponse& answer);

// Client::applied_group_lr: the lr of each of `groups` groups that `step`
// was applied with, as the first server holding a part at it says; empty at
// step 0, for a skip, or where no such server says (older servers).
std::vector<double> AppliedGroupLr(const std::vector<v1::CreateJobResponse>& answers, uint64_t step,
                                   const std::vector<bool>& holds_part, size_t groups);

// Client::pushed_ahead: step + 1 if a server this client pushes to
// (`pushes_to`) holds that step's sealed round, or some of this client's
// rank's push of it (rank_pushed), else 0.
uint64_t PushedAhead(const std::vector<v1::CreateJobResponse>& answers, uint64_t step,
                     const std::vector<bool>& holds_part, const std::vector<bool>& pushes_to);

}  // namespace shardopt
