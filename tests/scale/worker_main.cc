// shardopt-scale-worker: one trainer rank of the scale-out tests. It trains
// scale::MakeJob through the client library for --steps steps with gradients
// from scale::Gradient, retries a step whose barrier timed out (a rank died:
// nothing was applied), and writes its final masters and gscales to
// scale::OutputPath(--out, rank). Every attempt that failed goes to
// OutputPath(...)+".log", one line each, for the tests to read.
#include <chrono>
#include <fstream>
#include <iostream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/scale/scale_job.h"

ABSL_FLAG(std::string, servers, "", "host:port,host:port,... in the order every rank shares");
ABSL_FLAG(std::string, server_pattern, "", "instead of --servers: NAME-{i}.SERVICE:PORT");
ABSL_FLAG(uint32_t, server_count, 0, "with --server_pattern");
ABSL_FLAG(std::string, job, "scale", "job name");
ABSL_FLAG(uint32_t, rank, 0, "this rank");
ABSL_FLAG(uint32_t, world_size, 1, "ranks");
ABSL_FLAG(uint64_t, seed, 1, "gradient and initial-value seed");
ABSL_FLAG(uint64_t, steps, 200, "train until the job is at this step");
ABSL_FLAG(double, max_grad_norm, 0, "0: no clipping");
ABSL_FLAG(uint32_t, barrier_timeout_ms, 2000, "the job's barrier deadline");
ABSL_FLAG(uint64_t, stall_at_step, 0, "if set, hang in this step (for the kill tests)");
ABSL_FLAG(int, stall_after_pushing_server, -1,
          "with --stall_at_step: first push that step to this server only, so the worker dies half-pushed");
ABSL_FLAG(int, step_attempts, 20, "attempts per step while the barrier times out");
ABSL_FLAG(uint32_t, size, 1, "scale::MakeJob's multiplier of the tensors' lengths");
ABSL_FLAG(std::string, out, "", "output path prefix");
ABSL_FLAG(bool, init, true,
          "at step 0, write this rank's share of the initial values and wait for the other ranks'; false: another "
          "process wrote them");
ABSL_FLAG(bool, init_all, false, "with --init: write all of the initial values, not only this rank's share");
ABSL_FLAG(bool, read_masters, true, "at the end, read the masters back into the output");
ABSL_FLAG(uint64_t, chunk_bytes, 0, "ClientOptions::chunk_bytes; 0: the client's choice");

namespace shardopt::scale {
namespace {

int Fail(std::ofstream& log, const absl::Status& st, const std::string& what) {
  log << what << ": " << st << std::endl;
  std::cerr << what << ": " << st << std::endl;
  return 2;
}

int Run() {
  const uint32_t rank = absl::GetFlag(FLAGS_rank);
  const std::string out = OutputPath(absl::GetFlag(FLAGS_out), rank);
  std::ofstream log(out + ".log", std::ios::app);
  ClientOptions options;
  options.rank = rank;
  // The step loop below does the retrying, so that each failed attempt is seen.
  options.max_attempts = 1;
  options.rpc_timeout_ms = 10000;
  options.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  if (!absl::GetFlag(FLAGS_server_pattern).empty()) {
    auto servers = ExpandServerPattern(absl::GetFlag(FLAGS_server_pattern), absl::GetFlag(FLAGS_server_count));
    if (!servers.ok()) return Fail(log, servers.status(), "servers");
    options.servers = *servers;
  } else {
    options.servers = absl::StrSplit(absl::GetFlag(FLAGS_servers), ',', absl::SkipEmpty());
  }
  auto client = Client::Connect(options);
  if (!client.ok()) return Fail(log, client.status(), "connect");
  const JobOptions job = MakeJob(absl::GetFlag(FLAGS_job), absl::GetFlag(FLAGS_world_size),
                                 absl::GetFlag(FLAGS_barrier_timeout_ms), absl::GetFlag(FLAGS_size));
  // A server that many workers reach at once may be slow to take the
  // connection: attaching changes nothing, so it is retried here.
  auto start = (*client)->CreateOrAttach(job);
  for (int attempt = 2; attempt <= absl::GetFlag(FLAGS_step_attempts) && absl::IsUnavailable(start.status()); ++attempt) {
    log << "attach attempt " << attempt - 1 << ": " << start.status() << std::endl;
    std::this_thread::sleep_for(std::chrono::seconds(1));
    start = (*client)->CreateOrAttach(job);
  }
  if (!start.ok()) return Fail(log, start.status(), "attach");
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  if (*start == 0 && absl::GetFlag(FLAGS_init)) {
    // Every rank holds the same values and sends its share of them.
    InitShare share{rank, job.world_size};
    if (absl::GetFlag(FLAGS_init_all)) share = {};
    for (uint32_t t = 0; t < job.tensors.size(); ++t) {
      const auto init = InitialValues(seed, t, job.tensors[t].numel);
      if (auto st = (*client)->InitFp32(job.tensors[t].name, init.data(), share); !st.ok()) return Fail(log, st, "init");
    }
    if (auto st = (*client)->WaitForInitialValues(60000); !st.ok()) return Fail(log, st, "initial values");
  }
  log << "rank " << rank << " attached at step " << *start << std::endl;

  std::vector<std::vector<uint16_t>> params(job.tensors.size());
  std::vector<ParamView> param_views;
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    params[t].resize(job.tensors[t].numel);
    param_views.push_back({job.tensors[t].name, params[t].data()});
  }
  StepOptions step_options;
  step_options.lr = kLr;
  step_options.max_grad_norm = absl::GetFlag(FLAGS_max_grad_norm);
  WorkerOutput output;
  std::vector<std::vector<uint16_t>> grads(job.tensors.size());
  std::vector<GradView> grad_views;
  for (uint32_t t = 0; t < job.tensors.size(); ++t) grad_views.push_back({job.tensors[t].name, nullptr});
  for (uint64_t step = *start + 1; step <= absl::GetFlag(FLAGS_steps); ++step) {
    for (uint32_t t = 0; t < job.tensors.size(); ++t) {
      grads[t] = Gradient(seed, step, rank, t, job.tensors[t].numel);
      grad_views[t].data = grads[t].data();
    }
    if (step == absl::GetFlag(FLAGS_stall_at_step)) {
      if (const int s = absl::GetFlag(FLAGS_stall_after_pushing_server); s >= 0) {
        ClientOptions one = options;
        one.push_servers = {static_cast<uint32_t>(s)};
        auto partial = Client::Connect(one);
        if (!partial.ok()) return Fail(log, partial.status(), "connect");
        if (auto st = (*partial)->CreateOrAttach(job); !st.ok()) return Fail(log, st.status(), "attach");
        auto pushed = (*partial)->Push(step, grad_views);
        if (!pushed.ok()) return Fail(log, pushed.status(), "partial push");
        log << "pushed step " << step << " to server " << s << " only" << std::endl;
      }
      std::ofstream(out + ".stalled") << step << std::endl;
      std::this_thread::sleep_for(std::chrono::minutes(5));  // the test kills it long before
      return Fail(log, absl::DeadlineExceededError("nobody killed the stalled worker"), "stall");
    }
    absl::StatusOr<StepResult> result;
    for (int attempt = 1; attempt <= absl::GetFlag(FLAGS_step_attempts); ++attempt) {
      result = (*client)->Step(grad_views, step_options, param_views);
      if (result.ok()) break;
      log << "step " << step << " attempt " << attempt << ": " << result.status() << std::endl;
      // Only a barrier that timed out is worth waiting again: a rank died or
      // is late, and nothing was applied. Anything else is for a person.
      if (result.status().code() != absl::StatusCode::kDeadlineExceeded) break;
    }
    if (!result.ok()) return Fail(log, result.status(), absl::StrCat("step ", step));
    if (result->step != step) return Fail(log, absl::InternalError("step out of order"), absl::StrCat("step ", step));
    output.gscales.push_back(result->decision.gscale);
  }

  for (const TensorOptions& t : job.tensors) {
    if (!absl::GetFlag(FLAGS_read_masters)) break;
    std::vector<float> master(t.numel);
    if (auto st = (*client)->Read(t.name, StateToRead::kMaster, 0, t.numel, master.data()); !st.ok()) {
      return Fail(log, st, "read");
    }
    output.masters.insert(output.masters.end(), master.begin(), master.end());
  }
  if (auto st = WriteOutput(out, output); !st.ok()) return Fail(log, st, "write");
  log << "rank " << rank << " done at step " << (*client)->step() << std::endl;
  return 0;
}

}  // namespace
}  // namespace shardopt::scale

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return shardopt::scale::Run();
}
