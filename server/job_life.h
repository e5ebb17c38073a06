// A job's lives (CreateJobResponse.incarnation, docs/design.md section 4):
// the id a server gives each life of a job, so that the trainers of a life
// dropped on purpose never step the job made again under its name. Lives
// are never 0, which a request uses for "not checked".
#pragma once

#include <cstdint>
#include <string>

namespace shardopt {

// A new run's life: random, told apart from any before it.
uint64_t NewLife();
// The life after a dropped one, for a job made again from the dropped life's
// checkpoint: a fixed function of it, so that a server restarted before the
// new run's first checkpoint gives the new run's trainers back their life
// when they re-attach, while the dropped life's trainers are refused.
uint64_t NextLife(uint64_t life);
// The life of a job restored from a part that names none (written before
// lives existed, or another placement's): from the job and the step, the
// same on every restart.
uint64_t LifeOfUnnamedPart(const std::string& job, uint64_t step);

}  // namespace shardopt
