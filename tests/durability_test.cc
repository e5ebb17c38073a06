// Durability over real server processes: a checkpoint, a restart and a
// resume give the bits of an uninterrupted run; SIGTERM checkpoints and exits
// 0; a checkpoint restores onto another server count; bad files are refused
// with a clear status while the server goes on serving.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/same_bits.h"
#include "checkpoint/directory_id.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "shardopt/client.h"
#include "shardopt/safetensors.h"
#include "rpc/grpc_edge.h"
#include "rpc/push_incomplete.h"
#include "shardopt/v1/optimizer.grpc.pb.h"
#include "tests/testing/blackhole_proxy.h"
#include "tests/testing/describe_on.h"
#include "tests/testing/reference.h"
#include "tests/testing/scripted_trainer.h"
#include "tests/testing/server_process.h"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
namespace v1 = ::shardopt::v1;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::Connect;
using testing::DescribeOn;
using testing::DurableJob;
using testing::Fingerprint;
using testing::ScriptedTrainer;
using testing::StartServers;
using testing::TempDir;
using testing::Train;
using testing::Uninterrupted;

// Runs the CLI against `server`; its stdout and stderr into `out`, its wait
// status returned.
int RunCli(const std::string& server, const std::string& args, std::string* out) {
  const std::string command = absl::StrCat(SHARDOPT_CLI_BINARY, " --server=", server, " ", args, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  char buffer[4096];
  out->clear();
  for (size_t n; (n = fread(buffer, 1, sizeof buffer, pipe)) > 0;) out->append(buffer, n);
  return pclose(pipe);
}

// Servers on fixed loopback ports sharing a checkpoint directory, so that
// each can be started again in its place (a pod replaced under its name).
struct FixedPortServers {
  std::vector<std::vector<std::string>> args;
  std::vector<std::unique_ptr<testing::ServerProcess>> servers;

  std::vector<int> metrics_ports;  // with `metrics`: each server's /metrics

  FixedPortServers(int n, const std::string& checkpoint_dir, bool metrics = false) {
    for (int i = 0; i < n; ++i) {
      args.push_back({"--threads=1", absl::StrCat("--port=", testing::FreeLoopbackPort()),
                      "--checkpoint_dir=" + checkpoint_dir});
      if (metrics) {
        metrics_ports.push_back(testing::FreeLoopbackPort());
        args.back().push_back(absl::StrCat("--metrics_port=", metrics_ports.back()));
      }
      servers.push_back(nullptr);
      Restart(i);
    }
  }
  void Restart(int i) {
    servers[i] = testing::ServerProcess::Start(args[i]);
    ASSERT_NE(servers[i], nullptr);
  }
  // Servers 0 .. n-1 killed (kill -9) and started again in their places.
  void KillAndRestart(int n) {
    for (int i = 0; i < n; ++i) {
      servers[i]->Stop(SIGKILL);
      Restart(i);
    }
  }
  // A client's options for every server, whose addresses outlive restarts.
  ClientOptions Options() const {
    ClientOptions options;
    for (const auto& server : servers) options.servers.push_back(server->address());
    return options;
  }
};

// The fingerprints of one uninterrupted run after N and after 2N steps.
std::pair<std::vector<uint32_t>, std::vector<uint32_t>> AtNAnd2N(const JobOptions& job, uint64_t n) {
  auto at = Uninterrupted(job, {n, 2 * n});
  return {std::move(at[0]), std::move(at[1])};
}

TEST(DurabilityTest, CheckpointRestartResumeIsBitwiseEqualToAnUninterruptedRunForFp32AndBf16Groups) {
  const JobOptions job = DurableJob("resume", {{"w", 5000}, {"b", 300}});
  constexpr uint64_t kN = 12;
  const auto [at_n, at_2n] = AtNAnd2N(job, kN);
  TempDir dir;

  std::vector<std::vector<uint16_t>> params_at_n;
  StepResult last;
  PushResult push_at_n;
  {
    auto servers = StartServers(1, dir.path());
    ClientOptions every_n;
    every_n.checkpoint_every = kN;
    auto client = Connect(servers, every_n);
    ScriptedTrainer trainer = Train(*client, job, kN - 1);
    EXPECT_FALSE(fs::exists(dir.path() + "/resume"));
    last = trainer.Step(*client).value();  // step N, then its checkpoint
    params_at_n = trainer.params();
    push_at_n = trainer.Push(*client, kN).value();
    EXPECT_EQ(Fingerprint(*client, job).value(), at_n);
    servers[0]->Stop(SIGKILL);
  }

  auto servers = StartServers(1, dir.path());
  auto client = Connect(servers);
  ASSERT_EQ(client->CreateOrAttach(job).value(), kN);
  ASSERT_TRUE(client->VerifyState().ok());
  EXPECT_EQ(Fingerprint(*client, job).value(), at_n);
  // A push and a commit of step N retried after the restore: the same
  // answers, nothing applied.
  ScriptedTrainer trainer(job);
  const PushResult retried_push = trainer.Push(*client, kN).value();
  EXPECT_EQ(retried_push.sum_squares, push_at_n.sum_squares);
  EXPECT_EQ(retried_push.nonfinite, push_at_n.nonfinite);
  std::vector<std::vector<uint16_t>> retried(job.tensors.size());
  std::vector<ParamView> pv;
  for (size_t i = 0; i < job.tensors.size(); ++i) {
    retried[i].assign(job.tensors[i].numel, 0xFFFF);
    pv.push_back({job.tensors[i].name, retried[i].data()});
  }
  ASSERT_TRUE(client->Commit(kN, 1e-2, last.decision.gscale, last.decision.skip, pv).ok());
  EXPECT_EQ(retried, params_at_n);
  EXPECT_EQ(client->Commit(kN, 2e-2, last.decision.gscale, false, pv).code(), absl::StatusCode::kAborted);

  for (uint64_t t = kN; t < 2 * kN; ++t) ASSERT_TRUE(trainer.Step(*client).ok());
  EXPECT_EQ(Fingerprint(*client, job).value(), at_2n);
}

// A trainer that died between its commits: step 2 applied on server 0 only,
// sealed on server 1. A restarted trainer's CreateOrAttach completes it on
// server 1 with the arguments server 0 applied it with (before, it was
// refused: "servers disagree", and only going back to a checkpoint or
// dropping the job got out), and the run is bitwise the uninterrupted one.
// A step that is not sealed on the server behind is still refused.
TEST(DurabilityTest, ARestartedTrainerCompletesAStepCommittedOnSomeServersOnly) {
  const JobOptions job = DurableJob("half-committed", {{"w", 6000}, {"b", 3000}});
  const auto at = Uninterrupted(job, {3});
  TempDir dir;
  auto servers = StartServers(2, dir.path());
  {
    auto client = Connect(servers);
    ScriptedTrainer trainer = Train(*client, job, 1);
    const PushResult pushed = trainer.Push(*client, 2).value();
    ClientOptions only_first;
    only_first.push_servers = {0};  // the commit that reached server 0 before the trainer died
    auto dying = Connect(servers, only_first);
    ASSERT_EQ(dying->CreateOrAttach(job).value(), 1u);
    StepOptions so;
    so.lr = 1e-2;  // the scripted trainer's
    const Decision decision = Decide(pushed, job.world_size, so);
    ASSERT_TRUE(dying->Commit(2, so.lr, decision.gscale, decision.skip, {}).ok());
  }
  auto restarted = Connect(servers);
  const auto attached = restarted->CreateOrAttach(job);
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(*attached, 2u);
  ScriptedTrainer trainer(job);
  ASSERT_TRUE(trainer.Step(*restarted).ok());
  EXPECT_EQ(Fingerprint(*restarted, job).value(), at[0]);

  // Behind by a step it holds no sealed round of: server 1 restored step
  // 3's checkpoint while server 0 applied step 4. Still refused.
  ASSERT_TRUE(restarted->Checkpoint().ok());
  ASSERT_TRUE(trainer.Step(*restarted).ok());
  servers[1]->Stop(SIGKILL);
  servers[1] = std::move(StartServers(1, dir.path())[0]);
  const auto refused = Connect(servers)->CreateOrAttach(job);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("servers disagree"));
  // One step apart, it was asked again first: what stays is no commit in flight.
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("(asked 5 times over 1.5 s"));
}

// Servers one step apart where the one behind has not sealed that step yet:
// a view an attach meets when each server answers at its own moment while
// another trainer's push seals the step and its commit applies it (seen by
// a probe of 8 ranks relaunched at once, 3 of 13 runs). The attach asks
// again instead of answering "servers disagree" with advice to restore or
// drop the job; here the step is sealed on server 1 500 ms after the first
// answer, and the attach completes it.
TEST(DurabilityTest, AnAttachThatMeetsAStepBeingSealedAsksAgainAndCompletesIt) {
  const JobOptions job = DurableJob("torn-view", {{"w", 6000}, {"b", 3000}});
  const auto at = Uninterrupted(job, {3});
  TempDir dir;
  auto servers = StartServers(2, dir.path());
  ScriptedTrainer trainer(job);
  ClientOptions first, second;
  first.push_servers = {0};
  second.push_servers = {1};
  std::unique_ptr<Client> to_first, to_second;
  {
    auto client = Connect(servers);
    trainer = Train(*client, job, 1);
    to_first = Connect(servers, first);
    to_second = Connect(servers, second);
    ASSERT_EQ(to_first->CreateOrAttach(job).value(), 1u);
    ASSERT_EQ(to_second->CreateOrAttach(job).value(), 1u);
  }
  const PushResult pushed = trainer.Push(*to_first, 2).value();
  StepOptions so;
  so.lr = 1e-2;  // the scripted trainer's
  const Decision decision = Decide(pushed, job.world_size, so);
  ASSERT_TRUE(to_first->Commit(2, so.lr, decision.gscale, decision.skip, {}).ok());
  // Server 0 is at step 2; server 1 at step 1, with nothing of step 2.
  std::thread sealing([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // after the first answer, before the fourth ask
    EXPECT_TRUE(trainer.Push(*to_second, 2).ok());
  });
  auto restarted = Connect(servers);
  const auto attached = restarted->CreateOrAttach(job);
  sealing.join();
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(*attached, 2u);
  ASSERT_TRUE(trainer.Step(*restarted).ok());
  EXPECT_EQ(Fingerprint(*restarted, job).value(), at[0]);
}

// Two servers that share a --checkpoint_dir each hold a job of one name (two
// runs under one name): the second to checkpoint step 3 found the first's
// COMMIT and answered "complete" having written nothing, so a restore would
// give it the other run's state. Its part of the step is another life's
// (CreateJobResponse.incarnation, kept in the part): it is refused, and
// the first run's checkpoint stays as it was.
TEST(DurabilityTest, AServerDoesNotTakeAnotherLifesCheckpointOfItsJobsNameAsItsOwn) {
  const JobOptions job = DurableJob("shared-name", {{"w", 3000}});
  TempDir dir;
  auto servers = StartServers(2, dir.path());
  std::vector<std::unique_ptr<Client>> clients;
  for (const auto& server : servers) {
    ClientOptions alone;
    alone.servers = {server->address()};
    clients.push_back(Client::Connect(alone).value());
    ASSERT_EQ(clients.back()->CreateOrAttach(job).value(), 0u);
  }
  for (auto& client : clients) Train(*client, job, 3);
  ASSERT_TRUE(clients[0]->Checkpoint().ok());
  const std::vector<uint32_t> first = Fingerprint(*clients[0], job).value();
  const absl::Status refused = clients[1]->Checkpoint();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("another life of job"));
  clients.clear();
  for (auto& server : servers) server->Stop(SIGKILL);
  auto restarted = StartServers(1, dir.path());
  auto client = Connect(restarted);
  ASSERT_EQ(client->CreateOrAttach(job).value(), 3u);
  EXPECT_EQ(Fingerprint(*client, job).value(), first);
}

// The same with the second run on another placement (two servers where the
// first ran on one): no part of the complete step is its placement's, and
// it was answered "complete" with the first run's state on disk (an outside
// probe); now the life of the step's parts is compared.
TEST(DurabilityTest, ARunOnAnotherPlacementDoesNotTakeAnotherLifesCheckpointAsItsOwn) {
  const JobOptions job = DurableJob("shared-name-placed", {{"w", 3000}, {"b", 700}});
  TempDir dir;
  auto servers = StartServers(3, dir.path());
  const auto connect = [&](std::vector<size_t> which) {
    ClientOptions o;
    for (size_t i : which) o.servers.push_back(servers[i]->address());
    return Client::Connect(o).value();
  };
  auto first = connect({0});
  auto second = connect({1, 2});
  ASSERT_EQ(first->CreateOrAttach(job).value(), 0u);
  ASSERT_EQ(second->CreateOrAttach(job).value(), 0u);  // before any checkpoint, which it would restore
  Train(*first, job, 3);
  Train(*second, job, 3);
  ASSERT_TRUE(first->Checkpoint().ok());
  const absl::Status refused = second->Checkpoint();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("(of another placement) is another life of job"));
  // The first run restored onto the second's placement takes the life of
  // one of the parts it read, and its checkpoint of the restored step is
  // complete, as before.
  const std::vector<uint32_t> at3 = Fingerprint(*first, job).value();
  ASSERT_TRUE(second->Drop().ok());
  first.reset();
  second.reset();
  auto restored = connect({1, 2});
  ASSERT_EQ(restored->CreateOrAttach(job).value(), 3u);
  EXPECT_EQ(Fingerprint(*restored, job).value(), at3);
  const absl::Status again = restored->Checkpoint();
  EXPECT_TRUE(again.ok()) << again;
}

// A job restored under a new life (made again after a drop, or from a
// restore_step) holds exactly the state of the parts it was read from, of
// the life before: a checkpoint of that step is the one already complete,
// not another run's (a SIGTERM drain before the job's first step failed
// for it and exited 1).
TEST(DurabilityTest, AJobRestoredUnderANewLifeCheckpointsTheStepItWasRestoredAt) {
  const JobOptions job = DurableJob("new-life", {{"w", 3000}, {"b", 700}});
  TempDir dir;
  auto servers = StartServers(2, dir.path());
  std::vector<uint32_t> at2;
  {
    auto client = Connect(servers);
    Train(*client, job, 2);  // makes the job at step 0
    ASSERT_TRUE(client->Checkpoint().ok());
    at2 = Fingerprint(*client, job).value();
    ASSERT_TRUE(client->Drop().ok());
  }
  auto made_again = Connect(servers);
  ASSERT_EQ(made_again->CreateOrAttach(job).value(), 2u);  // restored, a new life
  const absl::Status again = made_again->Checkpoint();
  EXPECT_TRUE(again.ok()) << again;
  made_again.reset();
  for (auto& server : servers) server->Stop(SIGKILL);
  servers = StartServers(2, dir.path());
  JobOptions back = job;
  back.restore_step = 2;  // a new life again, from the same parts
  auto restored = Connect(servers);
  ASSERT_EQ(restored->CreateOrAttach(back).value(), 2u);
  const absl::Status once_more = restored->Checkpoint();
  EXPECT_TRUE(once_more.ok()) << once_more;
  EXPECT_EQ(Fingerprint(*restored, job).value(), at2);
  restored.reset();
  for (auto& server : servers) EXPECT_EQ(server->Stop(SIGTERM), 0) << "the drain's checkpoint of step 2 failed";
}

// checkpoint_every on a server without --checkpoint_dir is refused when the
// trainer attaches (rank 0, which takes the checkpoints): every checkpoint
// would fail, after its step was applied. Other ranks take none.
TEST(DurabilityTest, CheckpointEveryWithoutACheckpointDirIsRefusedAtAttach) {
  const JobOptions job = DurableJob("no-dir", {{"w", 3000}});
  auto servers = StartServers(1, "");  // no --checkpoint_dir
  ClientOptions every;
  every.checkpoint_every = 1;
  const auto refused = Connect(servers, every)->CreateOrAttach(job);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              AllOf(HasSubstr("checkpoint_every is 1"), HasSubstr("has no --checkpoint_dir")));
  EXPECT_TRUE(Connect(servers)->CreateOrAttach(job).ok());
}

// A Step whose checkpoint_every checkpoint fails (here the job's directory
// is a file) says the step was applied: the caller's usual way out, calling
// Step again, would apply the next one.
TEST(DurabilityTest, AStepWhoseCheckpointFailsSaysTheStepWasApplied) {
  const JobOptions job = DurableJob("no-dir", {{"w", 3000}});
  TempDir dir;
  auto servers = StartServers(1, dir.path());
  ClientOptions every;
  every.checkpoint_every = 1;
  auto client = Connect(servers, every);
  ScriptedTrainer trainer(job);
  ASSERT_EQ(client->CreateOrAttach(job).value(), 0u);
  ASSERT_TRUE(trainer.Init(*client).ok());
  std::filesystem::remove_all(dir.path() + "/no-dir");
  std::ofstream(dir.path() + "/no-dir") << "not a directory";
  const auto stepped = trainer.Step(*client);
  EXPECT_EQ(stepped.status().code(), absl::StatusCode::kFailedPrecondition) << stepped.status();  // the directory
  EXPECT_THAT(std::string(stepped.status().message()), HasSubstr("step 1 was applied"));
  EXPECT_EQ(client->step(), 1u);
}

// Servers of one job on separate checkpoint directories (each pod its own
// volume, mounted at the same path): no server sees every part, so no
// checkpoint completes and a restart loses the job. Rank 0's attach is
// refused, naming both servers, and the job it made is undone; once the
// servers share one directory, the job attaches and its checkpoint
// completes. Before, nothing was said until the first Checkpoint failed,
// and a SIGTERM drain wrote parts that no restart could load.
TEST(DurabilityTest, ServersOfOneJobOnSeparateCheckpointDirectoriesAreRefusedAtAttach) {
  const JobOptions job = DurableJob("apart", {{"w", 6000}, {"b", 3000}});
  TempDir one, other;
  std::vector<std::unique_ptr<testing::ServerProcess>> servers;
  servers.push_back(std::move(StartServers(1, one.path())[0]));
  servers.push_back(std::move(StartServers(1, other.path())[0]));
  const auto refused = Connect(servers)->CreateOrAttach(job);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              AllOf(HasSubstr("different checkpoint directories"), HasSubstr(servers[0]->address()),
                    HasSubstr(servers[1]->address()), HasSubstr("mount one shared directory")));
  for (const auto& server : servers) {
    EXPECT_EQ(DescribeOn(server->address(), job.name).error_code(), grpc::StatusCode::NOT_FOUND) << "undone";
  }
  servers[1]->Stop(SIGKILL);
  servers[1] = std::move(StartServers(1, one.path())[0]);
  auto client = Connect(servers);
  ScriptedTrainer trainer = Train(*client, job, 2);
  const absl::Status written = client->Checkpoint();
  EXPECT_TRUE(written.ok()) << written;
  EXPECT_TRUE(fs::exists(one.path() + "/apart/step-00000000000000000002/COMMIT"));
  v1::DescribeResponse described[2];
  for (int s : {0, 1}) ASSERT_TRUE(DescribeOn(servers[s]->address(), job.name, &described[s]).ok());
  EXPECT_THAT(described[0].checkpoint_dir_id(), ::testing::MatchesRegex("[0-9a-f]{32}"));
  EXPECT_EQ(described[1].checkpoint_dir_id(), described[0].checkpoint_dir_id());
}

// One server of two restarted on another --checkpoint_dir makes the job
// afresh at step 0 while the other holds step 2. The running trainer was
// told that its part was lost and to drop the job on every server, and a
// new attach that the servers disagree on the step and to drop the job on
// each: either would have thrown the step away. Both now say the server is
// on another directory, and once it is restarted on the job's directory an
// attach is at step 2, bitwise.
TEST(DurabilityTest, AServerRestartedOnAnotherCheckpointDirectoryIsNamedNotADisagreementToDropTheJobOver) {
  const JobOptions job = DurableJob("moved", {{"w", 6000}, {"b", 3000}});
  TempDir shared, elsewhere;
  FixedPortServers fixed(2, shared.path());  // the running trainer finds server 1 at its address again
  auto running = Client::Connect(fixed.Options()).value();
  ScriptedTrainer trainer = Train(*running, job, 2);
  ASSERT_TRUE(running->Checkpoint().ok());
  const std::vector<uint32_t> at_2 = Fingerprint(*running, job).value();
  fixed.servers[1]->Stop(SIGKILL);
  fixed.args[1].back() = "--checkpoint_dir=" + elsewhere.path();
  fixed.Restart(1);
  const auto told = trainer.Step(*running);
  EXPECT_EQ(told.status().code(), absl::StatusCode::kFailedPrecondition) << told.status();
  EXPECT_THAT(std::string(told.status().message()), HasSubstr("restarted on another checkpoint directory"));
  EXPECT_THAT(std::string(told.status().message()), Not(HasSubstr("drop the job on every server")));
  const auto refused = Client::Connect(fixed.Options()).value()->CreateOrAttach(job);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("different checkpoint directories"));
  EXPECT_THAT(std::string(refused.status().message()), Not(HasSubstr("drop the job")));
  fixed.servers[1]->Stop(SIGKILL);
  fixed.args[1].back() = "--checkpoint_dir=" + shared.path();
  fixed.Restart(1);
  auto client = Client::Connect(fixed.Options()).value();
  ASSERT_EQ(client->CreateOrAttach(job).value(), 2u);
  EXPECT_EQ(Fingerprint(*client, job).value(), at_2);
}

// A --checkpoint_dir deleted under a running server is made again at the
// next checkpoint with the id the server started with, where it used to be
// made again without one (a server started later then made another id,
// and was refused beside this one).
TEST(DurabilityTest, ACheckpointDirectoryDeletedUnderARunningServerIsMadeAgainWithItsId) {
  const JobOptions job = DurableJob("gone", {{"w", 3000}});
  TempDir dir;
  const std::string root = dir.path() + "/root";
  std::vector<std::unique_ptr<testing::ServerProcess>> servers;
  servers.push_back(std::move(StartServers(1, root)[0]));
  auto client = Connect(servers);
  Train(*client, job, 1);
  v1::DescribeResponse described;
  ASSERT_TRUE(DescribeOn(servers[0]->address(), job.name, &described).ok());
  fs::remove_all(root);
  ASSERT_TRUE(client->Checkpoint().ok());
  EXPECT_EQ(testing::ReadText(root + "/shardopt+directory-id"), described.checkpoint_dir_id() + "\n");
  EXPECT_TRUE(fs::exists(root + "/gone/step-00000000000000000001/COMMIT"));
}

// JobOptions::resume, for a launch that knows which it is. kNew refuses a
// job another run left at a later step, held or in a checkpoint (the one
// this call restored is let go again, and restores later as before); kOnly
// refuses a job at step 0 (nothing found: servers on empty directories),
// and drops the job it made. Either way FAILED_PRECONDITION naming the step.
TEST(DurabilityTest, ResumeNewRefusesAJobAtALaterStepAndResumeOnlyAFreshOne) {
  JobOptions job = DurableJob("expect", {{"w", 6000}});
  TempDir dir;
  auto servers = StartServers(1, dir.path());
  job.resume = Resume::kOnly;
  const auto nothing = Connect(servers)->CreateOrAttach(job);
  EXPECT_EQ(nothing.status().code(), absl::StatusCode::kFailedPrecondition) << nothing.status();
  EXPECT_THAT(std::string(nothing.status().message()), HasSubstr("is at step 0"));
  EXPECT_EQ(DescribeOn(servers[0]->address(), job.name).error_code(), grpc::StatusCode::NOT_FOUND);
  job.resume = Resume::kEither;
  std::vector<uint32_t> at_2;
  {
    auto client = Connect(servers);
    Train(*client, job, 2);
    ASSERT_TRUE(client->Checkpoint().ok());
    at_2 = Fingerprint(*client, job).value();
  }
  job.resume = Resume::kNew;
  const auto held = Connect(servers)->CreateOrAttach(job);
  EXPECT_EQ(held.status().code(), absl::StatusCode::kFailedPrecondition) << held.status();
  EXPECT_THAT(std::string(held.status().message()), HasSubstr("is at step 2"));
  servers[0]->Stop(SIGKILL);
  servers = StartServers(1, dir.path());
  const auto restored = Connect(servers)->CreateOrAttach(job);
  EXPECT_EQ(restored.status().code(), absl::StatusCode::kFailedPrecondition) << restored.status();
  EXPECT_EQ(DescribeOn(servers[0]->address(), job.name).error_code(), grpc::StatusCode::NOT_FOUND) << "let go";
  job.resume = Resume::kOnly;
  auto client = Connect(servers);
  ASSERT_EQ(client->CreateOrAttach(job).value(), 2u);
  EXPECT_EQ(Fingerprint(*client, job).value(), at_2);
}

// One server's SIGTERM completes its job's checkpoint; of two servers, the
// second one's does, since both stop at the same step.
TEST(DurabilityTest, SigtermCheckpointsEveryJobAndExitsZero) {
  for (int n : {1, 2}) {
    SCOPED_TRACE(n);
    const JobOptions job = DurableJob("sigterm", {{"w", 9000}});
    TempDir dir;
    std::vector<uint32_t> before;
    {
      auto servers = StartServers(n, dir.path());
      auto client = Connect(servers);
      Train(*client, job, 7);
      before = Fingerprint(*client, job).value();
      client.reset();
      for (int i = 0; i < n; ++i) {
        const int status = servers[i]->Stop(SIGTERM);
        ASSERT_TRUE(WIFEXITED(status));
        EXPECT_EQ(WEXITSTATUS(status), 0);
        EXPECT_EQ(fs::exists(dir.path() + "/sigterm/step-00000000000000000007/COMMIT"), i == n - 1);
      }
    }
    auto servers = StartServers(n, dir.path());
    auto client = Connect(servers);
    ASSERT_EQ(client->CreateOrAttach(job).value(), 7u);
    EXPECT_EQ(Fingerprint(*client, job).value(), before);
  }
}

TEST(DurabilityTest, ACheckpointOfTwoServersRestoresOntoThreeAndOntoOne) {
  const JobOptions job = DurableJob("reshard", {{"w", 20000}, {"b", 9000}});
  constexpr uint64_t kN = 6;
  const auto [at_n, at_2n] = AtNAnd2N(job, kN);
  TempDir dir;
  {
    auto servers = StartServers(2, dir.path());
    auto client = Connect(servers);
    ScriptedTrainer trainer = Train(*client, job, kN);
    ASSERT_TRUE(client->Checkpoint().ok());
    // Step N+1 torn: one of the two servers writes its part, then both die.
    ASSERT_TRUE(trainer.Step(*client).ok());
    auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(servers[0]->address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::CheckpointRequest req;
    req.set_job(job.name);
    req.set_step(kN + 1);
    v1::CheckpointResponse resp;
    ASSERT_TRUE(stub->Checkpoint(&ctx, req, &resp).ok());
    ASSERT_FALSE(resp.complete());
  }
  {
    auto one = StartServers(1, dir.path());
    auto client = Connect(one);
    ASSERT_EQ(client->CreateOrAttach(job).value(), kN);
    EXPECT_EQ(Fingerprint(*client, job).value(), at_n);
  }
  auto three = StartServers(3, dir.path());
  auto client = Connect(three);
  ASSERT_EQ(client->CreateOrAttach(job).value(), kN);
  EXPECT_EQ(Fingerprint(*client, job).value(), at_n);
  // Step N is complete already; step N+1's torn part of the old placement
  // overlaps the new ones and gives way to them.
  ASSERT_TRUE(client->Checkpoint().ok());
  ScriptedTrainer trainer(job);
  ASSERT_TRUE(trainer.Step(*client).ok());
  ASSERT_TRUE(client->Checkpoint().ok());
  for (uint64_t t = kN + 1; t < 2 * kN; ++t) ASSERT_TRUE(trainer.Step(*client).ok());
  EXPECT_EQ(Fingerprint(*client, job).value(), at_2n);
}

// A connection that stops answering without a reset (the server's machine
// died, or the path to it went away): an unanswered keepalive ping finds it
// dead within about 15 s, and the step is pushed again on a new connection,
// bitwise as an uninterrupted run. Without pings every retry went over the
// dead connection until its deadline (an outside probe's proxy: a call
// failed after 5 attempts), and TCP gives such a connection up only after
// about 15 minutes.
TEST(DurabilityTest, AStepGoesOnThroughAConnectionThatStoppedAnswering) {
  const JobOptions job = DurableJob("blackholed", {{"w", 5000}});
  const std::vector<uint32_t> want = Uninterrupted(job, {3})[0];
  TempDir dir;
  auto servers = StartServers(1, dir.path());
  testing::BlackholeProxy proxy(servers[0]->port());
  ClientOptions options;
  options.servers = {absl::StrCat("127.0.0.1:", proxy.port())};
  auto client = Client::Connect(options).value();
  ScriptedTrainer trainer = Train(*client, job, 1);
  proxy.BlackholeOpenConnections();
  const auto start = std::chrono::steady_clock::now();
  for (int t = 2; t <= 3; ++t) {
    const auto stepped = trainer.Step(*client);
    ASSERT_TRUE(stepped.ok()) << "step " << t << ": " << stepped.status();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 40.0);  // the ping's 10 s and its 5 s wait, with room for a loaded machine
  std::printf("two steps over a connection gone dead took %.1f s\n", seconds);
  EXPECT_EQ(Fingerprint(*client, job).value(), want);
}

// The same, for a push waiting at its barrier: by default gRPC pings twice
// and then waits until the client sends something, so a server that died
// after 20 s of waiting was noticed late or not at all (with that default,
// this test's rank 0 failed UNAVAILABLE after its two attempts). Rank 0
// reaches the server through the proxy and waits 25 s for rank 1; its
// connection then goes dead; rank 1 pushes at 40 s. Rank 0's push is
// retried on a new connection once a ping goes unanswered, and the step is
// bitwise the one without the fault. The run without the fault, the
// reference, waits 45 s at the barrier on a healthy connection, in one
// attempt: the pings of such a wait do not cut it.
TEST(DurabilityTest, APushWaitingAtItsBarrierFindsItsConnectionDead) {
  JobOptions job = DurableJob("quiet", {{"w", 5000}});
  job.world_size = 2;
  job.barrier_timeout_ms = 60000;
  const auto run = [&](bool fault) -> std::vector<uint32_t> {
    TempDir dir;
    auto servers = StartServers(1, dir.path());
    testing::BlackholeProxy proxy(servers[0]->port());
    std::vector<std::unique_ptr<Client>> ranks;
    for (uint32_t r = 0; r < 2; ++r) {
      ClientOptions options;
      options.servers = {r == 0 ? absl::StrCat("127.0.0.1:", proxy.port()) : servers[0]->address()};
      options.rank = r;
      // A push may wait 65 s; two attempts bound how long a failure takes,
      // and the healthy wait must succeed in one.
      options.rpc_timeout_ms = 5000;
      options.max_attempts = fault ? 2 : 1;
      ranks.push_back(Client::Connect(options).value());
      EXPECT_TRUE(ranks[r]->CreateOrAttach(job).ok());
    }
    EXPECT_TRUE(ScriptedTrainer(job).Init(*ranks[0]).ok());
    const auto step = [&](uint32_t r) {
      std::mt19937_64 rng(100 * (ranks[r]->step() + 1) + r);
      const std::vector<uint16_t> g = testing::RandomBf16(rng, 5000, 1.0f);
      std::vector<uint16_t> out(5000);
      return ranks[r]->Step({{"w", g.data()}}, StepOptions{}, {{"w", out.data()}}).status();
    };
    for (int t = 1; t <= 2; ++t) {
      absl::Status rank0;
      std::thread zero([&] { rank0 = step(0); });
      if (fault && t == 2) {
        std::this_thread::sleep_for(std::chrono::seconds(25));
        proxy.BlackholeOpenConnections();
        std::this_thread::sleep_for(std::chrono::seconds(15));
      } else if (t == 2) {
        std::this_thread::sleep_for(std::chrono::seconds(45));
      }
      EXPECT_TRUE(step(1).ok()) << "step " << t;
      zero.join();
      EXPECT_TRUE(rank0.ok()) << "step " << t << ": " << rank0;
    }
    return Fingerprint(*ranks[1], job).value_or(std::vector<uint32_t>{});
  };
  const std::vector<uint32_t> want = run(false);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(run(true), want);
  std::printf("two steps, the second's connection dead after 25 s of waiting, took %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

// Initial values sent to a job at step 0 whose step 0 is checkpointed (a
// launch that died before step 1 and was relaunched with other weights,
// whose job the drain had checkpointed) are what a restart restores. The
// first such write sets the step's COMMIT and this server's part aside.
// Before, the drain after them failed (exit 1, "initial values written
// since have changed it"), and the restart restored the old values, under a
// trainer that stepped on from them without a word.
TEST(DurabilityTest, InitialValuesSentAfterADrainAtStep0AreWhatTheNextDrainKeeps) {
  const JobOptions job = DurableJob("reinit", {{"w", 5000}});
  TempDir dir;
  FixedPortServers fixed(1, dir.path());
  if (HasFailure()) return;
  std::mt19937_64 rng(17);
  const std::vector<float> other = testing::RandomFloats(rng, 5000, -2, 2);
  std::vector<uint32_t> first, second;
  {
    auto client = Client::Connect(fixed.Options()).value();
    ASSERT_TRUE(client->CreateOrAttach(job).ok());
    ASSERT_TRUE(ScriptedTrainer(job).Init(*client).ok());
    first = Fingerprint(*client, job).value();
  }
  ASSERT_EQ(fixed.servers[0]->Stop(SIGTERM) >> 8, 0);  // step 0, complete
  ASSERT_NO_FATAL_FAILURE(fixed.Restart(0));
  {
    auto client = Client::Connect(fixed.Options()).value();
    ASSERT_EQ(client->CreateOrAttach(job).value(), 0u);  // restored
    ASSERT_EQ(Fingerprint(*client, job).value(), first);
    ASSERT_TRUE(client->InitFp32("w", other.data()).ok());
    second = Fingerprint(*client, job).value();
    ASSERT_NE(second, first);
    // Written anew, complete; the drain's checkpoint then finds it so (it
    // was refused, "initial values written since have changed it").
    const absl::Status checkpointed = client->Checkpoint();
    ASSERT_TRUE(checkpointed.ok()) << checkpointed;
  }
  EXPECT_EQ(fixed.servers[0]->Stop(SIGTERM) >> 8, 0);
  ASSERT_NO_FATAL_FAILURE(fixed.Restart(0));
  auto client = Client::Connect(fixed.Options()).value();
  ASSERT_EQ(client->CreateOrAttach(job).value(), 0u);
  EXPECT_EQ(Fingerprint(*client, job).value(), second);
}

// The same write after a checkpoint the trainer took at step 0, then a
// kill -9: the old checkpoint is no longer complete, so the restart holds
// no state of the job, and the trainer's next step says its part is lost
// instead of stepping from the values before the write.
TEST(DurabilityTest, InitialValuesSentAfterACheckpointAtStep0AreNeverLostSilentlyByAKill) {
  const JobOptions job = DurableJob("reinit-kill", {{"w", 5000}});
  TempDir dir;
  FixedPortServers fixed(1, dir.path());
  if (HasFailure()) return;
  std::mt19937_64 rng(18);
  const std::vector<float> other = testing::RandomFloats(rng, 5000, -2, 2);
  auto client = Client::Connect(fixed.Options()).value();
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  ScriptedTrainer trainer(job);
  ASSERT_TRUE(trainer.Init(*client).ok());
  ASSERT_TRUE(client->Checkpoint().ok());  // step 0, complete
  ASSERT_TRUE(client->InitFp32("w", other.data()).ok());
  EXPECT_FALSE(fs::exists(dir.path() + "/reinit-kill/step-00000000000000000000/COMMIT"));
  fixed.servers[0]->Stop(SIGKILL);
  ASSERT_NO_FATAL_FAILURE(fixed.Restart(0));
  const auto stepped = trainer.Step(*client);
  ASSERT_EQ(stepped.status().code(), absl::StatusCode::kFailedPrecondition) << stepped.status();
  EXPECT_THAT(std::string(stepped.status().message()), HasSubstr("has no checkpoint of it"));
}

// A server replaced under a running job (a rolling upgrade: SIGTERM, whose
// drain checkpoints the job, then a new process on the same port and
// directory): the trainer's next step finds the new server without the job,
// gives it the job again, which restores it, and steps on, bitwise as an
// uninterrupted run. A job dropped on purpose is not given back: its
// server says it was dropped, and the next step is NOT_FOUND.
TEST(DurabilityTest, ATrainerStepsOnThroughARestartOfItsServerButNotThroughADrop) {
  const JobOptions job = DurableJob("roll", {{"w", 5000}, {"b", 300}});
  constexpr uint64_t kN = 4;
  const auto [at_n, at_2n] = AtNAnd2N(job, kN);
  TempDir dir;
  FixedPortServers fixed(1, dir.path());
  if (HasFailure()) return;
  const ClientOptions options = fixed.Options();
  auto client = Client::Connect(options).value();
  ScriptedTrainer trainer = Train(*client, job, kN);
  ASSERT_EQ(fixed.servers[0]->Stop(SIGTERM) >> 8, 0);  // its drain checkpoints step N
  ASSERT_NO_FATAL_FAILURE(fixed.Restart(0));
  for (uint64_t t = kN; t < 2 * kN; ++t) {
    const auto stepped = trainer.Step(*client);
    ASSERT_TRUE(stepped.ok()) << "step " << t + 1 << ": " << stepped.status();
  }
  EXPECT_EQ(Fingerprint(*client, job).value(), at_2n);

  ASSERT_TRUE(client->Checkpoint().ok());
  auto other = Client::Connect(options).value();
  ASSERT_EQ(other->CreateOrAttach(job).value(), 2 * kN);
  ASSERT_TRUE(other->Drop().ok());
  const auto dropped = trainer.Step(*client);
  EXPECT_EQ(dropped.status().code(), absl::StatusCode::kNotFound) << dropped.status();
  EXPECT_THAT(std::string(dropped.status().message()), HasSubstr("was dropped"));
  auto describe = other->CreateOrAttach(job);  // the checkpoint is there: attaching again restores it, on purpose
  ASSERT_TRUE(describe.ok()) << describe.status();
  EXPECT_EQ(*describe, 2 * kN);
}

// A ReadMany's lanes do not re-attach (client_state.cc): a server restarted
// since the attach has the whole read again, one piece at a time, which
// re-attaches and reads the state it restored. Without that second pass, the
// read was NOT_FOUND "no job".
TEST(DurabilityTest, AReadOfManyTensorsAfterARestartOfTheirServerReadsTheRestoredState) {
  const JobOptions job = DurableJob("read-restart", {{"w", 5000}, {"b", 300}, {"c", 9000}});
  constexpr uint64_t kN = 3;
  const auto at = Uninterrupted(job, {kN});
  TempDir dir;
  FixedPortServers fixed(2, dir.path());
  if (HasFailure()) return;
  auto client = Client::Connect(fixed.Options()).value();
  const ScriptedTrainer trainer = Train(*client, job, kN);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(fixed.servers[i]->Stop(SIGTERM) >> 8, 0);  // its drain checkpoints step N
    ASSERT_NO_FATAL_FAILURE(fixed.Restart(i));
  }
  const auto read = Fingerprint(*client, job);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, at[0]);
}

// A client that only reads is at the step it attached at. A server that
// restarted since restores the newest checkpoint, past that step: the read
// says the job went on and to attach again (it said to restore every
// server from one checkpoint, which they all were), and after the attach
// the client reads the restored state.
TEST(DurabilityTest, AReaderBehindTheJobIsToldToAttachAgainAfterARestart) {
  const JobOptions job = DurableJob("reader-behind", {{"w", 5000}});
  TempDir dir;
  FixedPortServers fixed(1, dir.path());
  if (HasFailure()) return;
  auto stepping = Client::Connect(fixed.Options()).value();
  ScriptedTrainer trainer = Train(*stepping, job, 1);
  auto reader = Client::Connect(fixed.Options()).value();
  ASSERT_EQ(reader->CreateOrAttach(job).value(), 1u);
  for (int t = 0; t < 2; ++t) ASSERT_TRUE(trainer.Step(*stepping).ok());
  ASSERT_EQ(fixed.servers[0]->Stop(SIGTERM) >> 8, 0);  // its drain checkpoints step 3
  ASSERT_NO_FATAL_FAILURE(fixed.Restart(0));
  const auto behind = Fingerprint(*reader, job);
  EXPECT_EQ(behind.status().code(), absl::StatusCode::kFailedPrecondition) << behind.status();
  EXPECT_THAT(std::string(behind.status().message()), HasSubstr("attach again"));
  ASSERT_EQ(reader->CreateOrAttach(job).value(), 3u);
  const auto read = Fingerprint(*reader, job);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, Fingerprint(*stepping, job).value());
}

// A stopping server's gRPC answers each call it has received but not begun
// with CANCELLED "CANCELLED" (grpc/grpc#41785), not UNAVAILABLE: a trainer's
// step failed so once in 15 SIGTERMs of a chaos test. The client retries
// them as it retries UNAVAILABLE. Whether a call meets one rides on gRPC's
// shutdown race, which this cannot see: against the client before, one to
// five of the eight failed so in each of three runs. FanoutTest checks the
// retry against a server that answers so to its first call.
TEST(DurabilityTest, EveryCallOfEightClientsThroughThreeStopsOfTheirServerSucceeds) {
  const JobOptions job = DurableJob("busy", {{"w", 500}});
  TempDir dir;
  FixedPortServers fixed(1, dir.path());
  if (HasFailure()) return;
  ClientOptions options = fixed.Options();
  options.max_attempts = 10;  // backoffs of 11 s in all: past a restart, also on a busy machine
  {
    auto client = Client::Connect(options).value();
    const ScriptedTrainer trainer = Train(*client, job, 1);  // a step for each drain to checkpoint
  }
  constexpr int kClients = 8;
  std::atomic<bool> stop{false};
  std::vector<absl::Status> failed(kClients);
  std::vector<int> calls(kClients, 0);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      auto client = Client::Connect(options).value();
      failed[c] = client->CreateOrAttach(job).status();
      for (; failed[c].ok() && !stop.load(); ++calls[c]) failed[c] = client->Describe().status();
    });
  }
  for (int restart = 0; restart < 3 && !HasFailure(); ++restart) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_EQ(fixed.servers[0]->Stop(SIGTERM) >> 8, 0);  // its drain checkpoints step 1
    fixed.Restart(0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  stop = true;
  for (auto& thread : threads) thread.join();
  for (int c = 0; c < kClients; ++c) {
    EXPECT_TRUE(failed[c].ok()) << "client " << c << ", call " << calls[c] + 1 << ": " << failed[c];
  }
}

// Two ranks' steps of a job whose tensor "a" is on server 0 and "gain" on
// server 1. Rank 1 pushes step 2 through PushInOrder, its "gain" held back
// until `hold` returns, and commits it apart: a trainer of the low-level
// calls, which pushes a step again itself when a commit finds its push lost
// (with `other_gradients_again`, other gradients than the first time).
class TwoRanks {
 public:
  explicit TwoRanks(const ClientOptions& options, double max_grad_norm = 0, bool other_gradients_again = false,
                    uint32_t barrier_timeout_ms = 10000)
      : other_gradients_again_(other_gradients_again) {
    options_.max_grad_norm = max_grad_norm;
    job_ = DurableJob("between", {{"a", 4096}});  // 4096 + 64: one block each
    job_.barrier_timeout_ms = barrier_timeout_ms;
    job_.world_size = 2;
    for (uint32_t r = 0; r < 2; ++r) {
      ClientOptions o = options;
      o.rank = r;
      clients_.push_back(Client::Connect(o).value());
      EXPECT_TRUE(clients_[r]->CreateOrAttach(job_).ok());
    }
    EXPECT_TRUE(ScriptedTrainer(job_).Init(*clients_[0]).ok());
  }
  const JobOptions& job() const { return job_; }
  Client& client(uint32_t r) { return *clients_[r]; }

  absl::Status Step(uint32_t r, std::vector<uint16_t>* params) {
    Grads g(r, clients_[r]->step() + 1);
    params->assign(kParams, 0xFFFF);  // poisoned: the commit must write every one
    return clients_[r]->Step(g.views, options_, Views(*params)).status();
  }
  // The next step of both ranks at once, rank 1 on a thread of its own:
  // whether both went through, each rank's params into `params0`/`params1`.
  bool StepBoth(std::vector<uint16_t>* params0, std::vector<uint16_t>* params1) {
    absl::Status one;
    std::thread rank1([&] { one = Step(1, params1); });
    const absl::Status zero = Step(0, params0);
    rank1.join();  // before any ASSERT: a joinable thread's destructor aborts the binary
    EXPECT_TRUE(zero.ok()) << zero;
    EXPECT_TRUE(one.ok()) << one;
    return zero.ok() && one.ok();
  }
  absl::Status PushAndCommitHolding(const std::function<void()>& hold, std::vector<uint16_t>* params) {
    const uint64_t t = clients_[1]->step() + 1;
    Grads g(1, t);
    params->assign(kParams, 0xFFFF);
    auto pushed = clients_[1]->PushInOrder(t, {"a", "gain"}, [&](size_t i) {
      if (i == 1) hold();
      return g.views[i].data;
    });
    if (!pushed.ok()) return pushed.status();
    absl::Status committed = Commit(t, *pushed, *params);
    if (!IsPushIncomplete(committed, t)) return committed;
    Grads other(7, t);
    pushed = clients_[1]->Push(t, (other_gradients_again_ ? other : g).views);
    return pushed.ok() ? Commit(t, *pushed, *params) : pushed.status();
  }

 private:
  static constexpr size_t kParams = 4096 + 64;
  struct Grads {
    Grads(uint32_t rank, uint64_t t) {
      std::mt19937_64 rng(100 * t + rank);
      a = testing::RandomBf16(rng, 4096, 1.0f);
      gain = testing::RandomBf16(rng, 64, 1.0f);
      views = {{"a", a.data()}, {"gain", gain.data()}};
    }
    std::vector<uint16_t> a, gain;
    std::vector<GradView> views;
  };
  static std::vector<ParamView> Views(std::vector<uint16_t>& params) {
    return {{"a", params.data()}, {"gain", params.data() + 4096}};
  }
  absl::Status Commit(uint64_t t, const PushResult& pushed, std::vector<uint16_t>& params) {
    const Decision d = Decide(pushed, 2, options_);
    return clients_[1]->Commit(t, options_.lr, d.gscale, d.skip, Views(params));
  }
  const bool other_gradients_again_;
  JobOptions job_;
  StepOptions options_;
  std::vector<std::unique_ptr<Client>> clients_;
};

// Steps 1 and 2 of TwoRanks on two servers that stay up: the params each
// rank's last step returned, and the job's fingerprint.
struct TwoRankRun {
  std::vector<uint16_t> params0, params1;
  std::vector<uint32_t> fingerprint;
};
TwoRankRun UninterruptedTwoRanks() {
  TwoRankRun run;
  TempDir dir;
  auto servers = StartServers(2, dir.path());
  ClientOptions options;
  for (const auto& s : servers) options.servers.push_back(s->address());
  TwoRanks ranks(options);
  for (int t = 1; t <= 2; ++t) ranks.StepBoth(&run.params0, &run.params1);
  auto fingerprint = Fingerprint(ranks.client(0), ranks.job());
  EXPECT_TRUE(fingerprint.ok()) << fingerprint.status();
  if (fingerprint.ok()) run.fingerprint = *std::move(fingerprint);
  return run;
}

// Step 2 of both ranks (rank 0 through Step, rank 1 through
// PushAndCommitHolding), with server 0 stopped and started again once it
// has sealed step 2 and before rank 1's push lets server 1 seal it: each
// rank's outcome.
std::pair<absl::Status, absl::Status> StepTwoAcrossARestartOfServer0(FixedPortServers& fixed, TwoRanks& ranks,
                                                                      std::vector<uint16_t>* got0,
                                                                      std::vector<uint16_t>* got1) {
  std::mutex mu;
  std::condition_variable changed;
  bool released = false;
  absl::Status rank1;
  std::thread held([&] {
    rank1 = ranks.PushAndCommitHolding(
        [&] {
          std::unique_lock<std::mutex> lock(mu);
          changed.wait(lock, [&] { return released; });
        },
        got1);
  });
  absl::Status rank0;
  std::thread stepping([&] { rank0 = ranks.Step(0, got0); });
  // Both ranks' pushes of step 2 answered on server 0 (two of step 1's): sealed.
  const std::string sealed = "\nshardopt_pushes_total{job=\"between\"} 4\n";
  bool seen = false;
  for (int i = 0; i < 400 && !seen; ++i) {
    seen = absl::StrContains(testing::GetMetrics(fixed.metrics_ports[0]), sealed);
    if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_TRUE(seen) << "server 0 did not seal step 2 in 10 s";
  EXPECT_EQ(fixed.servers[0]->Stop(SIGTERM) >> 8, 0);
  fixed.Restart(0);  // (a failure to start is reported, and the steps then fail)
  {
    std::lock_guard<std::mutex> lock(mu);
    released = true;
  }
  changed.notify_all();
  stepping.join();
  held.join();
  return {rank0, rank1};
}

// A server restarted between a Step's push and its commit has restored the
// step before, which holds no push. The Step pushes the step again, from
// the caller's gradients, and commits it, in the same call (before, it
// failed with FAILED_PRECONDITION "its push is incomplete", and the caller
// had to call it again); the run is bitwise the uninterrupted one. Rank 0's
// Step has sealed step 2 on server 0 and waits at server 1's barrier for
// rank 1 while server 0 is stopped and started again, at the job's
// checkpoint of step 1.
TEST(DurabilityTest, AStepWhoseServerRestartedBetweenItsPushAndItsCommitPushesAgainInTheSameCall) {
  std::vector<uint16_t> got0, got1;
  const TwoRankRun want = UninterruptedTwoRanks();
  if (HasFailure()) return;

  TempDir dir;
  FixedPortServers fixed(2, dir.path(), /*metrics=*/true);
  if (HasFailure()) return;
  TwoRanks ranks(fixed.Options());
  if (!ranks.StepBoth(&got0, &got1)) return;
  ASSERT_TRUE(ranks.client(0).Checkpoint().ok());  // step 1 on both: what server 0 restores
  const auto [rank0, rank1] = StepTwoAcrossARestartOfServer0(fixed, ranks, &got0, &got1);
  ASSERT_TRUE(rank0.ok()) << rank0;
  ASSERT_TRUE(rank1.ok()) << rank1;
  EXPECT_EQ(got0, want.params0);
  EXPECT_EQ(got1, want.params1);
  EXPECT_EQ(Fingerprint(ranks.client(0), ranks.job()).value(), want.fingerprint);
}

// Two ranks, two servers, no checkpoint but the drain's: server 1 is
// stopped (SIGTERM) after step 1, writing its part of it, and started
// again; it holds no complete checkpoint, so each rank's re-attach makes
// the job afresh there (or attaches to the one the other rank's made).
// Each rank's Step completes step 1 on server 0, the ranks undo what they
// made or attached to, and the server restores step 1: both ranks' step 2
// goes through, bitwise the uninterrupted run. Before, each was told that
// server 1's part of the job was lost, and to drop the job.
TEST(DurabilityTest, TwoRanksStepOnThroughADrainOfOneOfTheirServersWithNoCheckpointBefore) {
  const TwoRankRun want = UninterruptedTwoRanks();
  if (HasFailure()) return;
  TempDir dir;
  FixedPortServers fixed(2, dir.path());
  if (HasFailure()) return;
  TwoRanks ranks(fixed.Options());
  std::vector<uint16_t> got0, got1;
  if (!ranks.StepBoth(&got0, &got1)) return;
  ASSERT_EQ(fixed.servers[1]->Stop(SIGTERM) >> 8, 0);  // its part of step 1 only
  ASSERT_FALSE(fs::exists(dir.path() + "/between/step-00000000000000000001/COMMIT"));
  ASSERT_NO_FATAL_FAILURE(fixed.Restart(1));
  if (!ranks.StepBoth(&got0, &got1)) return;
  EXPECT_EQ(got0, want.params0);
  EXPECT_EQ(got1, want.params1);
  EXPECT_EQ(Fingerprint(ranks.client(0), ranks.job()).value(), want.fingerprint);
  EXPECT_TRUE(fs::exists(dir.path() + "/between/step-00000000000000000001/COMMIT"));
}

// The same, but rank 1 pushes other gradients when it pushes step 2 again
// (clipping on, so that they change the decision): rank 0's Step, whose
// first decision server 1 applied, must not commit the new one on server
// 0. It is refused, saying what to do (before this check, it committed it,
// and the job's servers held two decisions of one step).
TEST(DurabilityTest, AStepWhosePushAgainDecidesOtherwiseIsRefusedAndCommitsNothingMore) {
  TempDir dir;
  FixedPortServers fixed(2, dir.path(), /*metrics=*/true);
  if (HasFailure()) return;
  TwoRanks ranks(fixed.Options(), /*max_grad_norm=*/1e-3, /*other_gradients_again=*/true);
  std::vector<uint16_t> got0, got1;
  if (!ranks.StepBoth(&got0, &got1)) return;
  ASSERT_TRUE(ranks.client(0).Checkpoint().ok());
  const auto [rank0, rank1] = StepTwoAcrossARestartOfServer0(fixed, ranks, &got0, &got1);
  EXPECT_EQ(rank0.code(), absl::StatusCode::kFailedPrecondition) << rank0;
  EXPECT_THAT(std::string(rank0.message()), HasSubstr("the answers now decide it otherwise"));
  EXPECT_THAT(std::string(rank0.message()), HasSubstr("restore_step"));
  EXPECT_EQ(ranks.client(0).step(), 1u);  // nothing more committed by rank 0
}

// TwoRanks on two servers of fixed ports, whose clients make `max_attempts`
// attempts and wait up to 60 s at the barrier, and the uninterrupted run's
// outcome to compare with.
struct RestartsUnderAPush {
  explicit RestartsUnderAPush(int max_attempts) {
    if (::testing::Test::HasFailure()) return;
    ClientOptions options = fixed.Options();
    options.max_attempts = max_attempts;
    ranks.emplace(options, 0, false, /*barrier_timeout_ms=*/60000);
  }

  // Rank 0's Step of step 2, with server 0 stopped by `signal` and started
  // again `restarts` times while the Step's push waits at its barrier (the
  // round's Describe names rank 1 as the one it waits for; a job the server
  // restored and nobody pushed to has no round). Step 1 is checkpointed
  // first: what server 0 restores, each time. After the restarts, `then`
  // runs once rank 0's push is back at the barrier (rank 1's step, to let
  // rank 0's through; none: rank 0's is to end by itself within 30 s), and
  // this returns rank 0's Step's outcome once it has ended.
  absl::Status StepWhileServer0Restarts(int signal, int restarts, const std::function<void()>& then) {
    if (!ranks->StepBoth(&got0, &got1)) return absl::InternalError("step 1 failed");
    if (absl::Status st = ranks->client(0).Checkpoint(); !st.ok()) return st;
    const std::string server0 = fixed.servers[0]->address();  // the same after restarts
    std::atomic<bool> ended{false};
    const auto push_waits = [&] {
      for (int i = 0; i < 400 && !ended.load(); ++i) {
        v1::DescribeResponse d;
        if (testing::DescribeOn(server0, ranks->job().name, &d).ok() &&
            absl::StrContains(d.waiting_for(), "ranks {1}")) {
          return true;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(25));
      }
      return false;
    };
    absl::Status rank0;
    std::thread stepping([&] {
      rank0 = ranks->Step(0, &got0);
      ended = true;
    });
    for (int restart = 0; restart < restarts; ++restart) {
      if (!push_waits()) {
        ADD_FAILURE() << "rank 0's push was not at server 0's barrier within 10 s, before restart " << restart + 1;
        break;
      }
      const int status = fixed.servers[0]->Stop(signal);
      EXPECT_TRUE(signal == SIGKILL || status >> 8 == 0) << "the drain's exit status: " << status;
      fixed.Restart(0);
      if (fixed.servers[0] == nullptr) break;  // reported; the step then fails
    }
    if (then) {
      // Back at the barrier of the last restarted server, given the job again.
      EXPECT_TRUE(push_waits()) << "rank 0's push was not at server 0's barrier within 10 s of restart " << restarts;
      then();
    } else {
      // Rank 0's step is to end by itself; if it waits at the barrier
      // instead, rank 1's step lets it through rather than the barrier's
      // minute per attempt.
      for (int i = 0; i < 300 && !ended.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (!ended.load()) {
        ADD_FAILURE() << "rank 0's step did not end within 30 s of the last restart";
        ranks->Step(1, &got1).IgnoreError();
      }
    }
    stepping.join();
    return rank0;
  }

  void ExpectTheUninterruptedRun() {
    EXPECT_EQ(got0, want.params0);
    EXPECT_EQ(got1, want.params1);
    EXPECT_EQ(Fingerprint(ranks->client(0), ranks->job()).value(), want.fingerprint);
  }

  const TwoRankRun want = UninterruptedTwoRanks();
  TempDir dir;
  FixedPortServers fixed{2, dir.path(), /*metrics=*/true};
  std::optional<TwoRanks> ranks;
  std::vector<uint16_t> got0, got1;  // each rank's params of its last step
};

// A server restarted twice while a Step's push waits at its barrier: each
// time the push finds no job there, gives the server the job again, which
// restores it, and pushes again. The Step did that once, and failed with
// NOT_FOUND "no job" the second time (an outside probe's servers, restarted
// every few seconds); now up to max_attempts times, and the run is bitwise
// the uninterrupted one.
TEST(DurabilityTest, AStepGoesOnThroughItsServerRestartingTwiceWhileItsPushWaits) {
  // Each drain holds the waiting push for its 5 s before it cuts it, so the
  // push waits longer than the tests' usual 10 s barrier; and more attempts
  // than the default give a loaded machine's restart time (the default's
  // backoffs add up to 1.5 s).
  RestartsUnderAPush run(/*max_attempts=*/10);
  if (HasFailure()) return;
  const absl::Status rank0 =
      run.StepWhileServer0Restarts(SIGTERM, 2, [&] { EXPECT_TRUE(run.ranks->Step(1, &run.got1).ok()); });
  ASSERT_TRUE(rank0.ok()) << rank0;
  run.ExpectTheUninterruptedRun();
}

// A server that restarts more than max_attempts times within one Step's
// push: the Step gives it the job again max_attempts times, then fails with
// UNAVAILABLE saying so, and calling it again once the server stays up
// completes the step, bitwise the uninterrupted run.
TEST(DurabilityTest, AStepWhoseServerRestartsPastItsAttemptsFailsUnavailableAndGoesThroughWhenCalledAgain) {
  // Killed, not drained, for a second a restart; attempts whose backoffs
  // (3.1 s in all) outlast a restart on a loaded machine.
  RestartsUnderAPush run(/*max_attempts=*/6);
  if (HasFailure()) return;
  const absl::Status rank0 = run.StepWhileServer0Restarts(SIGKILL, 7, nullptr);
  EXPECT_EQ(rank0.code(), absl::StatusCode::kUnavailable) << rank0;
  EXPECT_THAT(std::string(rank0.message()), HasSubstr("given the job 6 times in this call")) << rank0;
  EXPECT_TRUE(run.ranks->StepBoth(&run.got0, &run.got1));
  run.ExpectTheUninterruptedRun();
}

// Two live trainers of one rank, both attached before their server
// restarted, and the job restored by a third client that only reads: what
// they learnt of the job's push clock from the earlier process reads as
// before every push of the new one, so the second to push is still refused
// (a count of pushes since the restore had it taken for a trainer started
// in place of the first, and its gradients dropped as a retry's).
TEST(DurabilityTest, TwoTrainersOfARankAttachedBeforeARestartAreStillTold) {
  const JobOptions job = DurableJob("twins", {{"w", 5000}});
  TempDir dir;
  FixedPortServers fixed(1, dir.path());
  if (HasFailure()) return;
  const ClientOptions options = fixed.Options();
  auto first = Client::Connect(options).value();
  ScriptedTrainer trainer = Train(*first, job, 2);
  auto second = Client::Connect(options).value();
  ASSERT_EQ(second->CreateOrAttach(job).value(), 2u);
  ASSERT_EQ(fixed.servers[0]->Stop(SIGTERM) >> 8, 0);  // its drain checkpoints step 2
  ASSERT_NO_FATAL_FAILURE(fixed.Restart(0));
  auto monitor = Client::Connect(options).value();
  ASSERT_EQ(monitor->CreateOrAttach(job).value(), 2u);  // restores it
  ASSERT_TRUE(trainer.Step(*first).ok());
  const std::vector<uint32_t> at_3 = Fingerprint(*monitor, job).value();
  ScriptedTrainer twin(job);
  const auto refused = twin.Step(*second);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("another trainer"));
  EXPECT_EQ(Fingerprint(*monitor, job).value(), at_3);
}

// A trainer left running while its job is dropped, whose server then
// restarts before anyone makes the job again: its call finds no job, and its
// re-attach names its life, which the drop marked on disk: the server
// answers "was dropped" and restores nothing. (Before, it restored the
// checkpoint under the next life, refused the trainer, and held a job
// nobody ran.) The new run then restores it, at the checkpoint's step, and
// goes on through another restart. Before the mark and the check, the
// dropped trainer took the job back and could step and drop it under the
// new run.
TEST(DurabilityTest, ATrainerOfADroppedJobDoesNotTakeItBackThroughARestart) {
  const JobOptions job = DurableJob("retaken", {{"w", 3000}});
  constexpr uint64_t kN = 3;
  TempDir dir;
  FixedPortServers servers(1, dir.path());
  const ClientOptions options = servers.Options();
  auto old_run = Client::Connect(options).value();
  ScriptedTrainer trainer = Train(*old_run, job, kN);
  ASSERT_TRUE(old_run->Checkpoint().ok());
  auto admin = Client::Connect(options).value();
  ASSERT_EQ(admin->CreateOrAttach(job).value(), kN);
  ASSERT_TRUE(admin->Drop().ok());
  servers.servers[0]->Stop(SIGKILL);
  servers.Restart(0);

  const auto stepped = trainer.Step(*old_run);
  EXPECT_EQ(stepped.status().code(), absl::StatusCode::kNotFound) << stepped.status();
  EXPECT_THAT(std::string(stepped.status().message()), HasSubstr("was dropped"));
  EXPECT_EQ(DescribeOn(servers.servers[0]->address(), job.name).error_code(), grpc::StatusCode::NOT_FOUND)
      << "the old trainer's re-attach restored the dropped job";
  auto new_run = Client::Connect(options).value();
  ASSERT_EQ(new_run->CreateOrAttach(job).value(), kN);  // the checkpoint, not a step of the old run's
  const auto before = Fingerprint(*new_run, job).value();
  EXPECT_EQ(old_run->Drop().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Fingerprint(*new_run, job).value(), before);
  // The new run's life is a function of the dropped one: a restart before
  // the new run checkpoints gives it back, and the new run steps on.
  servers.servers[0]->Stop(SIGKILL);
  servers.Restart(0);
  ScriptedTrainer next(job);
  const auto resumed = next.Step(*new_run);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(new_run->step(), kN + 1);
  EXPECT_EQ(trainer.Step(*old_run).status().code(), absl::StatusCode::kNotFound);
}

// A server restarted with no checkpoint of the job: the re-attach finds a
// fresh job at step 0, drops it again, and says why; every later call says
// the same, not "was dropped" (the job the client itself dropped), which
// reads as if someone had dropped the job on purpose.
TEST(DurabilityTest, AServerThatLostTheJobKeepsSayingWhyNotThatItWasDropped) {
  const JobOptions job = DurableJob("lost", {{"w", 3000}});
  const int port = testing::FreeLoopbackPort();
  const std::vector<std::string> args = {"--threads=1", absl::StrCat("--port=", port)};  // no checkpoints
  auto server = testing::ServerProcess::Start(args);
  ASSERT_NE(server, nullptr);
  ClientOptions options;
  options.servers = {server->address()};
  auto client = Client::Connect(options).value();
  ScriptedTrainer trainer = Train(*client, job, 2);
  auto other = Client::Connect(options).value();  // another trainer's client (here one that reads)
  ASSERT_EQ(other->CreateOrAttach(job).value(), 2u);
  server->Stop(SIGKILL);
  server = testing::ServerProcess::Start(args);
  ASSERT_NE(server, nullptr);
  for (int attempt = 0; attempt < 2; ++attempt) {
    const auto stepped = trainer.Step(*client);
    EXPECT_EQ(stepped.status().code(), absl::StatusCode::kFailedPrecondition) << attempt << ": " << stepped.status();
    EXPECT_THAT(std::string(stepped.status().message()), HasSubstr("has no checkpoint of it")) << attempt;
    // Nothing to restore that server's part from: the advice is to start again.
    EXPECT_THAT(std::string(stepped.status().message()), HasSubstr("its part of the job's state is lost")) << attempt;
  }
  // The other trainer's calls find the job the first one's re-attach made
  // and dropped again: they say why, where they said only "was dropped",
  // as if an admin had dropped it (an outside probe's second rank).
  const auto described = other->Describe();
  EXPECT_EQ(described.status().code(), absl::StatusCode::kNotFound) << described.status();
  EXPECT_THAT(std::string(described.status().message()),
              HasSubstr("was dropped on this server by a client that named its life while it held nothing"));
  EXPECT_THAT(std::string(described.status().message()), HasSubstr("this server's part of the job's state is lost"));
}

// The same on two servers restarted at once (with a checkpoint directory,
// but no checkpoint of the job): each re-attach makes a fresh job, and each
// is dropped again, also the one whose re-attach ends after the other's
// failure has cancelled the rest of the fan-out. Before, that one's drop
// was never sent (or its CreateJob was cut off after the server made the
// job), the server kept a job at step 0, and every later call was
// OUT_OF_RANGE "push step 1". It failed in three runs of four: four rounds.
// With tokens too: a trainer's token may drop the empty job its re-attach
// made (an admin's alone could not, and the job stayed).
TEST(DurabilityTest, EveryServerDropsTheJobItsReattachMadeAfreshAgain) {
  TempDir dir;  // never written: the job is never checkpointed
  FixedPortServers fixed(2, dir.path());
  auto& servers = fixed.servers;
  const std::string tokens = dir.path() + "/tokens";
  std::ofstream(tokens) << "trainer trainer trainer-token-0123456789 lost-\n";
  for (int round = 0; round < 6; ++round) {
    SCOPED_TRACE(round);
    ClientOptions options;
    if (round == 4) {  // the last two rounds with a trainer's token
      for (int i = 0; i < 2; ++i) {
        fixed.args[i].push_back("--tokens_file=" + tokens);
        servers[i]->Stop(SIGKILL);
        fixed.Restart(i);
      }
    }
    if (round >= 4) options.token = "trainer-token-0123456789";
    const JobOptions job = DurableJob(absl::StrCat("lost-", round), {{"w", 3000}, {"b", 3000}});
    auto client = Connect(servers, options);
    ScriptedTrainer trainer = Train(*client, job, 2);
    fixed.KillAndRestart(2);
    const auto stepped = trainer.Step(*client);
    EXPECT_EQ(stepped.status().code(), absl::StatusCode::kFailedPrecondition) << stepped.status();
    for (const auto& server : servers) {
      v1::DescribeResponse described;
      EXPECT_EQ(DescribeOn(server->address(), job.name, &described, options.token).error_code(),
                grpc::StatusCode::NOT_FOUND)
          << server->address() << " holds the job at step " << described.step();
    }
  }
}

// An attach that some servers refuse changes nothing on the others. An
// outside probe's trainers listed one server too many: the two that held
// the job refused them (ALREADY_EXISTS), but the third restored the job's
// older checkpoint and kept it, and the reshard the README describes
// (checkpoint, restart the servers, attach with the new list) then found
// it at another step than its peers, FAILED_PRECONDITION. A job such an
// attach made afresh (no checkpoint of it) stayed too, at step 0.
TEST(DurabilityTest, AnAttachSomeServersRefuseLeavesNoJobOnTheOthers) {
  const JobOptions job = DurableJob("listed", {{"w", 20000}, {"b", 9000}});
  constexpr uint64_t kN = 3;
  const auto [at_n, at_2n] = AtNAnd2N(job, kN);
  TempDir dir;
  FixedPortServers fixed(3, dir.path());
  ClientOptions two = fixed.Options();
  two.servers.resize(2);
  const ClientOptions three = fixed.Options();
  const std::string third = fixed.servers[2]->address();
  const auto holds_none = [&](const std::string& name) {
    v1::DescribeResponse described;
    const grpc::Status st = DescribeOn(third, name, &described);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << name << " is held at step " << described.step();
  };
  auto client = Client::Connect(two).value();
  ScriptedTrainer trainer = Train(*client, job, kN);
  ASSERT_TRUE(client->Checkpoint().ok());
  auto listing_three = Client::Connect(three).value();
  const auto refused = listing_three->CreateOrAttach(job);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("same servers")) << refused.status();
  holds_none(job.name);
  EXPECT_EQ(Fingerprint(*client, job).value(), at_n);
  const JobOptions unsaved = DurableJob("unsaved", {{"w", 20000}, {"b", 9000}});
  Train(*client, unsaved, 1);
  EXPECT_EQ(listing_three->CreateOrAttach(unsaved).status().code(), absl::StatusCode::kAlreadyExists);
  holds_none(unsaved.name);

  ASSERT_EQ(client->CreateOrAttach(job).value(), kN);
  for (uint64_t t = kN + 1; t <= 2 * kN; ++t) ASSERT_TRUE(trainer.Step(*client).ok());
  ASSERT_TRUE(client->Checkpoint().ok());
  fixed.KillAndRestart(2);
  auto resharded = Client::Connect(three).value();
  const auto attached = resharded->CreateOrAttach(job);
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(*attached, 2 * kN);
  EXPECT_EQ(Fingerprint(*resharded, job).value(), at_2n);
}

// A file named as a part that cannot be read (a stray, or a damaged copy)
// in a step's directory is passed over when the step's parts are counted:
// every checkpoint of the step failed DATA_LOSS on it for good (a probe),
// where a restore passes it over. The step is complete, and restores.
TEST(DurabilityTest, AnUnreadableFileAmongAStepsPartsDoesNotBlockItsCheckpoint) {
  const JobOptions job = DurableJob("stray", {{"w", 3000}});
  TempDir dir;
  std::vector<uint32_t> trained;
  {
    auto servers = StartServers(1, dir.path());
    auto client = Connect(servers);
    Train(*client, job, 2);
    trained = Fingerprint(*client, job).value();
    const std::string step = dir.path() + "/stray/step-00000000000000000002";
    std::filesystem::create_directories(step);
    std::ofstream(step + "/part-9-9.bin") << "junk!";
    const absl::Status written = client->Checkpoint();
    ASSERT_TRUE(written.ok()) << written;
    EXPECT_TRUE(std::filesystem::exists(step + "/COMMIT"));
    EXPECT_TRUE(std::filesystem::exists(step + "/part-9-9.bin"));  // left where it is
  }
  auto servers = StartServers(1, dir.path());
  auto client = Connect(servers);
  ASSERT_EQ(client->CreateOrAttach(job).value(), 2u);
  EXPECT_EQ(Fingerprint(*client, job).value(), trained);
}

// An export of a live job whose server prunes (--checkpoint_keep=1, a
// checkpoint every step): the newest step can be pruned while the export
// reads it, and the export then reads the next newest instead of failing
// with DATA_LOSS "vanished while it was read" (a probe: 2 to 3 of 40; this
// test's 80 saw it in most runs).
TEST(DurabilityTest, AnExportOfALiveJobIsNotFailedByPruning) {
  const JobOptions job = DurableJob("pruned-live", {{"w", 1 << 20}});
  TempDir dir;
  auto server = testing::ServerProcess::Start({"--threads=1", "--checkpoint_dir=" + dir.path(), "--checkpoint_keep=1"});
  ASSERT_NE(server, nullptr);
  ClientOptions every;
  every.servers = {server->address()};
  every.checkpoint_every = 1;
  auto client = Client::Connect(every).value();
  ScriptedTrainer trainer(job);
  ASSERT_EQ(client->CreateOrAttach(job).value(), 0u);
  ASSERT_TRUE(trainer.Init(*client).ok());
  ASSERT_TRUE(trainer.Step(*client).ok());
  std::atomic<bool> done{false};
  std::thread training([&] {
    while (!done) ASSERT_TRUE(trainer.Step(*client).ok());  // pruning all the while the exports read
  });
  TempDir exports;
  int failed = 0;
  std::string said;
  for (int i = 0; i < 80; ++i) {
    std::string out;
    if (RunCli(server->address(), absl::StrCat("export --checkpoint_dir=", dir.path(), " pruned-live ", exports.path(),
                                               "/", i, ".safetensors"),
               &out) != 0) {
      ++failed;
      said = out;
    }
  }
  done = true;
  training.join();
  EXPECT_EQ(failed, 0) << said;
}

// A checkpoint past the server process's file size limit (a container's
// RLIMIT_FSIZE, which fails writes as a full disk does) fails with
// RESOURCE_EXHAUSTED and the disk's reason, not INTERNAL, which reads as the
// server's bug; it leaves no part, and the server goes on (before,
// SIGXFSZ's default action killed it mid-write). Once there is room again,
// the same step's checkpoint is written, and a restart restores it bitwise.
TEST(DurabilityTest, ACheckpointPastTheFileSizeLimitFailsResourceExhaustedAndSucceedsOnceThereIsRoom) {
  const JobOptions job = DurableJob("fsize", {{"w", 60000}});
  TempDir dir;
  auto servers = StartServers(1, dir.path());
  auto client = Connect(servers);
  ScriptedTrainer trainer = Train(*client, job, 2);
  struct rlimit unlimited;
  ASSERT_EQ(prlimit(servers[0]->pid(), RLIMIT_FSIZE, nullptr, &unlimited), 0) << strerror(errno);
  const struct rlimit small = {64 << 10, unlimited.rlim_max};  // the part is about 720 KB
  ASSERT_EQ(prlimit(servers[0]->pid(), RLIMIT_FSIZE, &small, nullptr), 0) << strerror(errno);
  const std::vector<uint32_t> at_2 = Fingerprint(*client, job).value();
  const absl::Status written = client->Checkpoint();
  EXPECT_EQ(written.code(), absl::StatusCode::kResourceExhausted) << written;
  EXPECT_THAT(std::string(written.message()), AllOf(HasSubstr("cannot write"), HasSubstr("File too large")));
  const std::string step_dir = dir.path() + "/fsize/step-00000000000000000002";
  EXPECT_TRUE(!fs::exists(step_dir) || fs::is_empty(step_dir)) << "a failed part is removed";
  EXPECT_EQ(Fingerprint(*client, job).value(), at_2);  // the job unchanged
  ASSERT_EQ(prlimit(servers[0]->pid(), RLIMIT_FSIZE, &unlimited, nullptr), 0) << strerror(errno);
  ASSERT_TRUE(client->Checkpoint().ok());
  EXPECT_TRUE(fs::exists(step_dir + "/COMMIT"));
  EXPECT_TRUE(trainer.Step(*client).ok());  // still serving
  servers[0]->Stop(SIGKILL);
  servers = StartServers(1, dir.path());
  auto restored = Connect(servers);
  ASSERT_EQ(restored->CreateOrAttach(job).value(), 2u);
  EXPECT_EQ(Fingerprint(*restored, job).value(), at_2);
}

// A new run from the newest complete checkpoint (the job dropped where it is
// held, then attached again), after one server's drain had written its part
// of a newer step: the new run's checkpoint of that step is its own. Before,
// the other server's drain tiled its new part with the old run's leftover
// one into a COMMIT, and the restore loaded each server's shards from
// another run. (The drop was once the way out of "servers disagree" that a
// new trainer's attach met here; that attach now completes the torn step.)
TEST(DurabilityTest, ANewRunsCheckpointOfAStepIsNeverTiledWithAnOldRunsPart) {
  const JobOptions job = DurableJob("two-runs", {{"w", 6000}, {"b", 3000}});
  TempDir dir;
  auto servers = StartServers(2, dir.path());
  std::vector<uint32_t> old_run;
  {
    auto client = Connect(servers);
    ScriptedTrainer trainer = Train(*client, job, 2);
    ASSERT_TRUE(client->Checkpoint().ok());   // step 2, complete
    ASSERT_TRUE(trainer.Step(*client).ok());  // the old run's step 3
    old_run = Fingerprint(*client, job).value();
  }
  ASSERT_EQ(servers[1]->Stop(SIGTERM) >> 8, 0);  // its part of step 3: torn
  servers[1] = std::move(StartServers(1, dir.path())[0]);
  {
    auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(servers[0]->address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::DropJobRequest drop;
    drop.set_job(job.name);
    v1::DropJobResponse dropped;
    ASSERT_TRUE(stub->DropJob(&ctx, drop, &dropped).ok());  // the only server holding the old run
  }
  std::vector<uint32_t> new_run;
  {
    auto client = Connect(servers);
    ASSERT_EQ(client->CreateOrAttach(job).value(), 2u);
    // The new run's step 3: the same gradients at another lr.
    ScriptedTrainer trainer(job);
    const PushResult pushed = trainer.Push(*client, 3).value();
    const Decision decision = Decide(pushed, job.world_size, StepOptions{});
    std::vector<std::vector<uint16_t>> params(job.tensors.size());
    std::vector<ParamView> views;
    for (size_t i = 0; i < job.tensors.size(); ++i) {
      params[i].resize(job.tensors[i].numel);
      views.push_back({job.tensors[i].name, params[i].data()});
    }
    ASSERT_TRUE(client->Commit(3, 3e-2, decision.gscale, decision.skip, views).ok());
    new_run = Fingerprint(*client, job).value();
  }
  ASSERT_NE(new_run, old_run);
  for (const auto& server : servers) ASSERT_EQ(server->Stop(SIGTERM) >> 8, 0);  // each writes its part of step 3
  servers = StartServers(2, dir.path());
  auto client = Connect(servers);
  ASSERT_EQ(client->CreateOrAttach(job).value(), 3u);
  EXPECT_EQ(Fingerprint(*client, job).value(), new_run);
}

// Two servers on fixed ports over one checkpoint directory, holding job
// `name` at step 3, live, over a complete checkpoint of step 2.
struct LiveAt3OverACheckpointOf2 {
  explicit LiveAt3OverACheckpointOf2(const std::string& name)
      : job(DurableJob(name, {{"w", 6000}, {"b", 3000}})), fixed(2, dir.path()), client(Connect(fixed.servers)),
        trainer(Train(*client, job, 2)) {
    const absl::Status checkpointed = client->Checkpoint();
    EXPECT_TRUE(checkpointed.ok()) << checkpointed;
    const auto stepped = trainer.Step(*client);
    EXPECT_TRUE(stepped.ok()) << stepped.status();
  }
  const JobOptions job;
  TempDir dir;
  FixedPortServers fixed;
  std::unique_ptr<Client> client;
  ScriptedTrainer trainer;
};

// A server drained under a training job on two servers (a node drain, a
// pod's restart) writes its part of step 3, which its peer still holds
// live. Restarted, it restores the older complete checkpoint (step 2) and
// says that it holds its own part of step 3 (own_part_step). The trainer's
// next step checkpoints step 3 on the peer, which completes it, undoes the
// job the server restored, has it restore step 3, and goes on: the run is
// bitwise the uninterrupted one. Before, the step was refused ("restored
// step 2"), and only draining the peer too, with the trainers stopped, got
// step 3 back.
TEST(DurabilityTest, AStepTornByADrainIsCompletedOnItsPeerAndTheTrainerStepsOn) {
  LiveAt3OverACheckpointOf2 at("node-drain");
  if (HasFailure()) return;
  const JobOptions& job = at.job;
  const TempDir& dir = at.dir;
  auto& servers = at.fixed.servers;
  auto& client = at.client;
  ScriptedTrainer& trainer = at.trainer;
  const std::vector<uint32_t> at_5 = Uninterrupted(job, {5})[0];
  ASSERT_EQ(servers[1]->Stop(SIGTERM) >> 8, 0);  // its part of step 3
  ASSERT_FALSE(fs::exists(dir.path() + "/node-drain/step-00000000000000000003/COMMIT"));
  at.fixed.Restart(1);
  for (uint64_t t = 4; t <= 5; ++t) {
    const auto stepped = trainer.Step(*client);
    ASSERT_TRUE(stepped.ok()) << "step " << t << ": " << stepped.status();
  }
  EXPECT_TRUE(fs::exists(dir.path() + "/node-drain/step-00000000000000000003/COMMIT"));
  EXPECT_EQ(Fingerprint(*client, job).value(), at_5);
  for (uint64_t s : {0, 1}) {
    v1::DescribeResponse described;
    ASSERT_TRUE(DescribeOn(servers[s]->address(), job.name, &described).ok());
    EXPECT_EQ(described.step(), 5u) << servers[s]->address();
  }
}

// The same at step 0: initial values in, one of two servers drained before
// step 1 (its part of step 0) and restarted, which makes the job afresh.
// Its answer names its own part of step 0, of this trainer's life; the
// trainer's step completes step 0 on the other server, has the restarted
// one restore it, and goes on bitwise. Before, the trainer was told that
// the server's part was lost, and every retry the same (an outside probe).
TEST(DurabilityTest, AStep0TornByADrainIsCompletedOnItsPeerAndTheTrainerStepsOn) {
  const JobOptions job = DurableJob("drain-at-0", {{"w", 6000}, {"b", 3000}});
  TempDir dir;
  FixedPortServers fixed(2, dir.path());
  if (HasFailure()) return;
  const std::vector<uint32_t> at_2 = Uninterrupted(job, {2})[0];
  auto client = Client::Connect(fixed.Options()).value();
  ScriptedTrainer trainer = Train(*client, job, 0);
  ASSERT_EQ(fixed.servers[1]->Stop(SIGTERM) >> 8, 0);  // its part of step 0
  ASSERT_FALSE(fs::exists(dir.path() + "/drain-at-0/step-00000000000000000000/COMMIT"));
  ASSERT_NO_FATAL_FAILURE(fixed.Restart(1));
  for (uint64_t t = 1; t <= 2; ++t) {
    const auto stepped = trainer.Step(*client);
    ASSERT_TRUE(stepped.ok()) << "step " << t << ": " << stepped.status();
  }
  EXPECT_TRUE(fs::exists(dir.path() + "/drain-at-0/step-00000000000000000000/COMMIT"));
  EXPECT_EQ(Fingerprint(*client, job).value(), at_2);
}

// A drain that lands between a step's push and its commit: the round is
// sealed on both servers, SIGTERM reaches server 1, and the commit then
// comes. Server 1 applies it before it takes the step for its checkpoint,
// as server 0 does, so its part is of step 3, the trainer's step; restarted,
// it is brought back to step 3 by the next step, and the run is bitwise the
// uninterrupted one. Before, the draining server refused the commit, server
// 0 applied it, and server 1's part of step 2 could never be completed (an
// outside probe's drains during commits lost the job in most runs).
TEST(DurabilityTest, ADrainBetweenAStepsPushAndCommitAppliesTheCommitFirst) {
  const JobOptions job = DurableJob("drain-at-commit", {{"w", 6000}, {"b", 3000}});
  TempDir dir;
  FixedPortServers fixed(2, dir.path());
  if (HasFailure()) return;
  const std::vector<uint32_t> at_4 = Uninterrupted(job, {4})[0];
  auto client = Client::Connect(fixed.Options()).value();
  ScriptedTrainer trainer = Train(*client, job, 2);
  bool signalled = false;
  const auto stepped = trainer.Step(*client, [&](ScriptedTrainer::Phase phase) {
    if (phase != ScriptedTrainer::Phase::kCommit || signalled) return;
    signalled = true;
    ASSERT_EQ(kill(fixed.servers[1]->pid(), SIGTERM), 0);  // the drain begins; the commit comes
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  });
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  ASSERT_EQ(client->step(), 3u);
  EXPECT_EQ(fixed.servers[1]->Stop(SIGTERM) >> 8, 0);  // its part of step 3
  ASSERT_NO_FATAL_FAILURE(fixed.Restart(1));
  const auto next = trainer.Step(*client);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(Fingerprint(*client, job).value(), at_4);
}

// The peer a step ahead of the drained part: server 1 drained at step 2
// and stayed down while the trainer's push and commit of step 3 went
// through on server 0 only. Restarted, server 1 cannot be brought to step
// 2 by a checkpoint on server 0 (which is at 3); the trainer's next step
// asks it to restore its own part of step 2 alone (own_part_step), then
// pushes and commits step 3 again: server 0 answers from what it kept,
// server 1 applies it, and the run is bitwise the uninterrupted one.
// Before, the step was refused, and the job was lost (an outside probe's
// chaos runs).
TEST(DurabilityTest, AServerDrainedAStepBehindItsPeerRestoresItsOwnPartAndCatchesUp) {
  const JobOptions job = DurableJob("peer-ahead", {{"w", 6000}, {"b", 3000}});
  TempDir dir;
  FixedPortServers fixed(2, dir.path());
  if (HasFailure()) return;
  const auto want = Uninterrupted(job, {3, 4});
  ClientOptions options = fixed.Options();
  options.max_attempts = 2;  // the down server's calls fail sooner
  auto client = Client::Connect(options).value();
  ScriptedTrainer trainer = Train(*client, job, 2);
  ASSERT_EQ(fixed.servers[1]->Stop(SIGTERM) >> 8, 0);  // its part of step 2, torn
  ASSERT_FALSE(trainer.Push(*client, 3).ok());        // server 0 alone seals step 3
  std::vector<std::vector<uint16_t>> params(job.tensors.size());
  std::vector<ParamView> views;
  for (size_t i = 0; i < job.tensors.size(); ++i) {
    params[i].resize(job.tensors[i].numel);
    views.push_back({job.tensors[i].name, params[i].data()});
  }
  ASSERT_FALSE(client->Commit(3, 1e-2, 1.0f, false, views).ok());  // applied on server 0 only
  v1::DescribeResponse described;
  ASSERT_TRUE(DescribeOn(fixed.servers[0]->address(), job.name, &described).ok());
  ASSERT_EQ(described.step(), 3u);
  ASSERT_NO_FATAL_FAILURE(fixed.Restart(1));
  const auto again = trainer.Step(*client);  // step 3, on server 1 for the first time
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Fingerprint(*client, job).value(), want[0]);
  const auto next = trainer.Step(*client);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(Fingerprint(*client, job).value(), want[1]);
}

// A node drain that restarts a server and its trainer: the new trainer's
// CreateOrAttach finds server 1 at step 2 (restored) with its own part of
// step 3 on disk, and server 0 at step 3 live. It completes step 3 on
// server 0, undoes server 1's restore, asks again, attaches at step 3, and
// steps on bitwise. Before, it was refused: "servers disagree on the step".
TEST(DurabilityTest, ANewTrainerCompletesAStepTornByADrainAndAttachesAtIt) {
  LiveAt3OverACheckpointOf2 at("node-drain-attach");
  if (HasFailure()) return;
  const JobOptions& job = at.job;
  auto& servers = at.fixed.servers;
  const std::vector<uint32_t> at_4 = Uninterrupted(job, {4})[0];
  ASSERT_EQ(servers[1]->Stop(SIGTERM) >> 8, 0);  // its part of step 3
  at.client.reset();                             // the trainer went with the node
  at.fixed.Restart(1);
  auto client = Client::Connect(at.fixed.Options()).value();
  const auto attached = client->CreateOrAttach(job);
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(*attached, 3u);
  EXPECT_TRUE(fs::exists(at.dir.path() + "/node-drain-attach/step-00000000000000000003/COMMIT"));
  ScriptedTrainer trainer(job);
  const auto stepped = trainer.Step(*client);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_EQ(Fingerprint(*client, job).value(), at_4);
}

// A server killed and restarted restores an older checkpoint than the step
// its peer holds live. The trainer's re-attach is refused; then each later
// call of that trainer says that the server lost steps and how to go on,
// where the server's own answer was OUT_OF_RANGE "push step 3" (going back
// on one server only). Nothing moves on either server meanwhile.
TEST(DurabilityTest, AServerThatRestoredAnOlderStepThanItsPeersIsCalledBehindByEveryLaterCall) {
  LiveAt3OverACheckpointOf2 at("behind");
  if (HasFailure()) return;
  const JobOptions& job = at.job;
  auto& servers = at.fixed.servers;
  auto& client = at.client;
  ScriptedTrainer& trainer = at.trainer;
  servers[1]->Stop(SIGKILL);
  at.fixed.Restart(1);
  const auto refused = trainer.Step(*client);  // server 1 restores step 2
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              AllOf(HasSubstr("restored step 2"), HasSubstr("drop the job on every server (shardopt")));
  for (int call = 0; call < 3; ++call) {
    const auto stepped = trainer.Step(*client);
    EXPECT_EQ(stepped.status().code(), absl::StatusCode::kFailedPrecondition) << stepped.status();
    EXPECT_THAT(std::string(stepped.status().message()),
                AllOf(HasSubstr(servers[1]->address()), HasSubstr("is at step 2"), HasSubstr("lost steps"),
                      HasSubstr("restart every server"), Not(HasSubstr("push step")),
                      // Where every server restored the same checkpoint, the trainers alone restart:
                      // the advice to restart every server read as if they always disagreed.
                      HasSubstr("if every server of the job is at that step"),
                      HasSubstr("restart the trainers, which resume from it")));
  }
  for (uint64_t s : {0, 1}) {
    v1::DescribeResponse described;
    ASSERT_TRUE(DescribeOn(servers[s]->address(), job.name, &described).ok());
    EXPECT_EQ(described.step(), s == 0 ? 3u : 2u) << servers[s]->address();
  }
}

// A restore onto another placement streams the old parts' runs into the
// new state as they are read: the server's peak memory is its state and the
// read buffers, not also a copy of its new part and a whole old one (which
// took 2.5 times the state where the state alone was to be charged).
TEST(DurabilityTest, ARestoreOntoAnotherPlacementHoldsNoCopyOfTheState) {
  constexpr uint64_t kN = uint64_t{8} << 20;  // 96 MiB of state; each old part holds half
  const JobOptions job = DurableJob("reshard-memory", {{"w", kN}});
  TempDir dir;
  std::vector<uint32_t> trained;
  {
    auto servers = StartServers(2, dir.path());
    auto client = Connect(servers);
    Train(*client, job, 1);
    ASSERT_TRUE(client->Checkpoint().ok());
    trained = Fingerprint(*client, job).value();
  }
  auto one = StartServers(1, dir.path());
  auto client = Connect(one);
  ASSERT_EQ(client->CreateOrAttach(job).value(), 1u);
  const uint64_t rss = testing::RssBytes(one[0]->pid()), peak = testing::PeakRssBytes(one[0]->pid());
  ASSERT_GT(rss, kN * 12);  // the state is in
  EXPECT_LT(peak, rss + (uint64_t{64} << 20)) << "peak " << peak << " B against " << rss << " B after the restore";
  EXPECT_EQ(Fingerprint(*client, job).value(), trained);
}

std::string StepDir(const std::string& root, const std::string& job, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%020d", step);
  return root + "/" + job + "/" + name;
}

std::string OnlyPart(const std::string& step_dir) {
  for (const auto& e : fs::directory_iterator(step_dir)) {
    if (e.path().filename().string().rfind("part-", 0) == 0) return e.path().string();
  }
  ADD_FAILURE() << "no part in " << step_dir;
  return "";
}

void FlipByte(const std::string& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  if (offset < 0) f.seekg(offset, std::ios::end); else f.seekg(offset);
  const std::streamoff at = f.tellg();
  char c;
  f.read(&c, 1);
  c ^= 0x40;
  f.seekp(at);
  f.write(&c, 1);
}

TEST(DurabilityTest, BadCheckpointsAreRefusedClearlyLoadNothingAndTheServerServesOtherJobs) {
  TempDir dir;
  const std::vector<std::string> cases = {"data",    "crc",  "manifest", "padding", "truncated",
                                         "version", "torn", "config"};
  {
    auto servers = StartServers(1, dir.path());
    for (const std::string& name : cases) {
      auto client = Connect(servers);
      const JobOptions job = DurableJob(name, {{"w", 2000}});
      ScriptedTrainer trainer = Train(*client, job, 3);
      ASSERT_TRUE(client->Checkpoint().ok());
      for (int t = 0; t < 3; ++t) ASSERT_TRUE(trainer.Step(*client).ok());
      ASSERT_TRUE(client->Checkpoint().ok());
    }
  }
  FlipByte(OnlyPart(StepDir(dir.path(), "data", 6)), -100);
  FlipByte(OnlyPart(StepDir(dir.path(), "crc", 6)), -2);  // the data's crc32c, which COMMIT records too
  FlipByte(OnlyPart(StepDir(dir.path(), "manifest", 6)), 30);
  FlipByte(OnlyPart(StepDir(dir.path(), "padding", 6)), 4095);  // the frame's zeros before the data at 4096
  fs::resize_file(OnlyPart(StepDir(dir.path(), "truncated", 6)), 5000);
  {
    std::fstream f(OnlyPart(StepDir(dir.path(), "version", 6)), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.put(3);  // a version from a later build
  }
  fs::remove(StepDir(dir.path(), "torn", 6) + "/COMMIT");

  auto servers = StartServers(1, dir.path());
  auto good = Connect(servers);
  const JobOptions good_job = DurableJob("good", {{"w", 100}});
  ScriptedTrainer good_trainer = Train(*good, good_job, 1);

  struct Want {
    std::string job;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Want> wants = {
      {"data", absl::StatusCode::kDataLoss, "data checksum mismatch"},
      {"crc", absl::StatusCode::kDataLoss, "data crc32c"},
      {"manifest", absl::StatusCode::kDataLoss, "manifest checksum mismatch"},
      {"padding", absl::StatusCode::kDataLoss, "padding between its manifest and its data is not zeros"},
      {"truncated", absl::StatusCode::kDataLoss, "truncated"},
      {"version", absl::StatusCode::kFailedPrecondition, "format version 3; this build reads versions 1 to 2"},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(w.job);
    auto client = Connect(servers);
    auto attached = client->CreateOrAttach(DurableJob(w.job, {{"w", 2000}}));
    EXPECT_EQ(attached.status().code(), w.code);
    EXPECT_THAT(std::string(attached.status().message()), HasSubstr(w.message));
    // Nothing was loaded: the job is not on the server.
    EXPECT_EQ(DescribeOn(servers[0]->address(), w.job).error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_TRUE(good_trainer.Step(*good).ok());
  }
  {
    auto client = Connect(servers);
    auto other = DurableJob("config", {{"w", 2001}});
    auto attached = client->CreateOrAttach(other);
    EXPECT_EQ(attached.status().code(), absl::StatusCode::kFailedPrecondition);
    // Which side each value is, on one line.
    const std::string message(attached.status().message());
    EXPECT_THAT(message, HasSubstr("another configuration (this call's -> the checkpoint's: modified: "
                                   "tensors[0].numel: 2001 -> 2000)"));
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    // A value at proto3's default (weight decay 0) is shown too, not as
    // "deleted" with the other side's alone.
    auto undecayed = DurableJob("config", {{"w", 2000}});
    undecayed.groups[0].weight_decay = 0;
    const std::string zero(Connect(servers)->CreateOrAttach(undecayed).status().message());
    EXPECT_THAT(zero, HasSubstr("modified: groups[0].weight_decay: 0 -> 0.01")) << zero;
  }
  {
    // Torn: the newest has no COMMIT, so the one before it is loaded; named, it is refused.
    auto client = Connect(servers);
    JobOptions named = DurableJob("torn", {{"w", 2000}});
    named.restore_step = 6;
    auto refused = client->CreateOrAttach(named);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("torn (no COMMIT marker"));
    EXPECT_EQ(client->CreateOrAttach(DurableJob("torn", {{"w", 2000}})).value(), 3u);
  }
  EXPECT_TRUE(good_trainer.Step(*good).ok());
}

// A part damaged on one server only: that server refuses the restore
// (DATA_LOSS, naming the part), while the job's other server, whose own
// part is whole, has restored it and holds it (each server reads only the
// parts of its shards). As the docs say, the operator moves the damaged
// step away and drops the job where a server holds it; the next attach
// then restores the step before on both, where without the drop it finds
// the servers at two steps.
TEST(DurabilityTest, ADamagedPartOnOneServerIsRefusedThereAndTheStepBeforeRestoresOnBoth) {
  TempDir dir;
  const JobOptions job = DurableJob("damaged", {{"w", 2000}, {"u", 3000}});
  {
    auto servers = StartServers(2, dir.path());
    auto client = Connect(servers);
    ScriptedTrainer trainer = Train(*client, job, 3);
    ASSERT_TRUE(client->Checkpoint().ok());
    for (int t = 0; t < 3; ++t) ASSERT_TRUE(trainer.Step(*client).ok());
    ASSERT_TRUE(client->Checkpoint().ok());
  }
  std::vector<std::string> parts;
  for (const auto& e : fs::directory_iterator(StepDir(dir.path(), "damaged", 6))) {
    if (e.path().filename().string().rfind("part-", 0) == 0) parts.push_back(e.path().string());
  }
  ASSERT_EQ(parts.size(), 2u);
  std::sort(parts.begin(), parts.end());
  FlipByte(parts[0], -100);

  auto servers = StartServers(2, dir.path());
  auto step_held = [&](int s) -> std::optional<uint64_t> {
    v1::DescribeResponse described;
    if (!DescribeOn(servers[s]->address(), "damaged", &described).ok()) return std::nullopt;
    return described.step();
  };
  auto client = Connect(servers);
  auto refused = client->CreateOrAttach(job);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(refused.status().message()), AllOf(HasSubstr(parts[0]), HasSubstr("data checksum mismatch")));
  // At most the server whose part is whole (server 1: part-0-0.bin is server
  // 0's): the client cancels its call once server 0's fails, and a call
  // cancelled before it reached server 1 restored nothing there (a run under
  // load saw that). A restore already begun there goes on, though, and may
  // land after the client has returned (a CI run saw it 5 ms later): it is
  // looked for during a second.
  std::vector<int> holding;
  for (const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
       holding.empty() && std::chrono::steady_clock::now() < give_up;
       std::this_thread::sleep_for(std::chrono::milliseconds(20))) {
    for (int s : {0, 1}) {
      if (const std::optional<uint64_t> held = step_held(s)) {
        EXPECT_EQ(*held, 6u);
        holding.push_back(s);
      }
    }
  }
  EXPECT_LE(holding.size(), 1u);
  for (int s : holding) EXPECT_EQ(s, 1);

  fs::rename(StepDir(dir.path(), "damaged", 6), dir.path() + "/damaged-step-6-set-aside");
  for (int s : holding) {
    auto drop = Connect(servers);  // the operator's `shardopt drop`
    v1::DropJobRequest req;
    req.set_job("damaged");
    v1::DropJobResponse unused;
    grpc::ClientContext ctx;
    auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(servers[s]->address(), grpc::InsecureChannelCredentials()));
    ASSERT_TRUE(stub->DropJob(&ctx, req, &unused).ok());
  }
  EXPECT_EQ(client->CreateOrAttach(job).value(), 3u);
  EXPECT_EQ(step_held(0), std::optional<uint64_t>(3));
  EXPECT_EQ(step_held(1), std::optional<uint64_t>(3));
}

// Format version 1 (no padding), as a build before version 2 wrote it
// (tests/data/checkpoint-format-v1: DurableJob "format-v1" on two servers,
// three steps of the scripted trainer), still restores bitwise: onto the
// same two servers (each streams its own part through the buffers) and
// onto one (the other placement's path), then steps on as an uninterrupted
// run does.
TEST(DurabilityTest, AFormatVersion1CheckpointRestoresBitwise) {
  const JobOptions job = DurableJob("format-v1", {{"w", 3000}, {"b", 1000}});
  const auto [at_3, at_6] = AtNAnd2N(job, 3);
  for (int count : {2, 1}) {
    SCOPED_TRACE(count);
    TempDir dir;
    fs::copy(std::string(SHARDOPT_SOURCE_DIR) + "/tests/data/checkpoint-format-v1", dir.path(),
             fs::copy_options::recursive);
    auto servers = StartServers(count, dir.path());
    auto client = Connect(servers);
    ASSERT_EQ(client->CreateOrAttach(job).value(), 3u);
    EXPECT_EQ(Fingerprint(*client, job).value(), at_3);
    ScriptedTrainer trainer(job);
    for (int t = 0; t < 3; ++t) ASSERT_TRUE(trainer.Step(*client).ok());
    EXPECT_EQ(Fingerprint(*client, job).value(), at_6);
  }
}

TEST(DurabilityTest, ExportWritesMastersTorchReadsBitwiseAndImportStartsAJobFromThem) {
  const JobOptions job = DurableJob("export", {{"w", 3000}, {"b", 17}});
  TempDir dir;
  TempDir expected;
  auto servers = StartServers(1, dir.path());
  auto client = Connect(servers);
  Train(*client, job, 5);
  ASSERT_TRUE(client->Checkpoint().ok());
  std::map<std::string, std::vector<uint32_t>> masters;
  for (const TensorOptions& t : job.tensors) {
    std::vector<uint32_t>& bits = masters[t.name];
    bits.resize(t.numel);
    ASSERT_TRUE(client->Read(t.name, StateToRead::kMaster, 0, t.numel, bits.data()).ok());
    std::ofstream(expected.path() + "/" + t.name + ".f32", std::ios::binary)
        .write(reinterpret_cast<const char*>(bits.data()), static_cast<std::streamsize>(bits.size() * 4));
  }
  for (const std::string dtype : {"fp32", "bf16"}) {
    SCOPED_TRACE(dtype);
    const std::string out = expected.path() + "/export-" + dtype + ".safetensors";
    ASSERT_EQ(std::system((std::string(SHARDOPT_CLI_BINARY) + " export --checkpoint_dir=" + dir.path() +
                           " --dtype=" + dtype + " export " + out).c_str()),
              0);
    ASSERT_EQ(std::system((std::string(SHARDOPT_EXPORT_PYTHON) + " " + SHARDOPT_EXPORT_CHECK + " " + out + " " +
                           expected.path() + " " + dtype + " 5").c_str()),
              0);
  }
  // An OUT in the checkpoint directory, here a file of the very checkpoint
  // export reads, is refused and the file stays as it was: it used to be
  // replaced (exit 0), and neither export nor a restore could read that
  // checkpoint again.
  std::string part;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir.path())) {
    if (entry.is_regular_file() && entry.path().parent_path().filename().string().rfind("step-", 0) == 0) {
      part = entry.path().string();
      break;
    }
  }
  ASSERT_FALSE(part.empty());
  const std::string part_bytes = testing::ReadText(part);
  const std::string cli_export = std::string(SHARDOPT_CLI_BINARY) + " export --checkpoint_dir=" + dir.path() + " export ";
  EXPECT_EQ(WEXITSTATUS(std::system((cli_export + part + " 2>" + expected.path() + "/refused").c_str())), 1);
  EXPECT_THAT(testing::ReadText(expected.path() + "/refused"),
              HasSubstr("lies in the checkpoint directory " + dir.path() + ", whose files the servers"));
  EXPECT_EQ(testing::ReadText(part), part_bytes);
  // So is one anywhere else in it: the directory's id, which an outside
  // probe's export replaced (exit 0) so that no server would start on the
  // directory again, and a new file beside it.
  const std::string id = dir.path() + "/" + checkpoint::kDirectoryIdName;
  const std::string id_bytes = testing::ReadText(id);
  EXPECT_EQ(WEXITSTATUS(std::system((cli_export + id + " 2>/dev/null").c_str())), 1);
  EXPECT_EQ(testing::ReadText(id), id_bytes);
  EXPECT_EQ(WEXITSTATUS(std::system((cli_export + dir.path() + "/new.safetensors 2>/dev/null").c_str())), 1);
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/new.safetensors"));
  // So is a relative OUT there, whose first part does not exist yet.
  const std::string job_dir = std::filesystem::path(part).parent_path().parent_path().string();
  EXPECT_EQ(WEXITSTATUS(std::system(("cd " + job_dir + " && " + cli_export + "new.safetensors 2>/dev/null").c_str())), 1);
  EXPECT_FALSE(std::filesystem::exists(job_dir + "/new.safetensors"));
  // So is one that reaches the directory by another path that is no
  // symlink: a bind mount of it (in a mount namespace of the test's own, as
  // unshare's mapped root). An outside probe's export over the id file
  // through such an alias exited 0, and no server started on the directory.
  const std::string alias = expected.path() + "/alias";
  std::filesystem::create_directory(alias);
  const std::string through_alias = "unshare -rm sh -c 'mount --bind " + dir.path() + " " + alias + " && " +
                                    std::string(SHARDOPT_CLI_BINARY) + " export --checkpoint_dir=" + dir.path() +
                                    " export " + alias + "/" + checkpoint::kDirectoryIdName + "' 2>" +
                                    expected.path() + "/aliased";
  EXPECT_EQ(WEXITSTATUS(std::system(through_alias.c_str())), 1) << testing::ReadText(expected.path() + "/aliased");
  EXPECT_THAT(testing::ReadText(expected.path() + "/aliased"), HasSubstr("lies in the checkpoint directory"));
  EXPECT_EQ(testing::ReadText(id), id_bytes);
  // Under a file-size limit the write fails with EFBIG, said and cleaned
  // up; SIGXFSZ used to kill the CLI with nothing said and its temporary
  // file left behind.
  const std::string limited = expected.path() + "/limited";
  std::filesystem::create_directory(limited);
  const int status = std::system(
      ("ulimit -f 4; " + cli_export + limited + "/out.safetensors 2>" + expected.path() + "/too-large").c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  EXPECT_THAT(testing::ReadText(expected.path() + "/too-large"), HasSubstr("File too large"));
  EXPECT_TRUE(std::filesystem::is_empty(limited)) << "a temporary file was left behind";

  JobOptions imported = job;
  imported.name = "imported";
  ASSERT_EQ(client->CreateOrAttach(imported).value(), 0u);
  ASSERT_TRUE(client->InitFromSafetensors(expected.path() + "/export-fp32.safetensors").ok());
  for (const TensorOptions& t : job.tensors) {
    std::vector<uint32_t> bits(t.numel);
    ASSERT_TRUE(client->Read(t.name, StateToRead::kMaster, 0, t.numel, bits.data()).ok());
    EXPECT_EQ(bits, masters[t.name]) << t.name;
  }
  // A file that does not fit the job changes nothing and says why.
  JobOptions bigger = DurableJob("bigger", {{"w", 3001}, {"b", 17}});
  ASSERT_EQ(client->CreateOrAttach(bigger).value(), 0u);
  const absl::Status st = client->InitFromSafetensors(expected.path() + "/export-fp32.safetensors");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("tensor 'w' has 12000 bytes of F32; the job's has 3001 elements"));
  // A value the servers would refuse names the file too (it named only the
  // tensor), and nothing is sent.
  std::vector<SafetensorsTensor> tensors = ReadSafetensors(expected.path() + "/export-fp32.safetensors").value();
  for (SafetensorsTensor& t : tensors) {
    const float nan = std::nanf("");
    if (t.name == "w") t.data.replace(4 * 7, 4, reinterpret_cast<const char*>(&nan), 4);
  }
  const std::string with_nan = dir.path() + "/nan.safetensors";
  ASSERT_TRUE(WriteSafetensors(with_nan, tensors, {}).ok());
  JobOptions fresh = job;
  fresh.name = "imported-nan";
  ASSERT_EQ(client->CreateOrAttach(fresh).value(), 0u);
  const absl::Status nan = client->InitFromSafetensors(with_nan);
  EXPECT_EQ(nan.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(nan.message()), HasSubstr(with_nan + ": initial master of tensor 'w' element 7 is not finite"));
  EXPECT_EQ(client->Describe().value()[0].uninitialized_tensors, job.tensors.size());
  // A job with shapes refuses a file in another shape of the same size (a
  // transposed weight), and takes a 1-D one, as every export was before
  // jobs had shapes.
  JobOptions shaped = job;
  shaped.name = "imported-shaped";
  for (TensorOptions& t : shaped.tensors) {
    if (t.name == "w") t.shape = {60, 50};
  }
  ASSERT_EQ(client->CreateOrAttach(shaped).value(), 0u);
  std::vector<SafetensorsTensor> transposed = ReadSafetensors(expected.path() + "/export-fp32.safetensors").value();
  for (SafetensorsTensor& t : transposed) {
    if (t.name == "w") t.shape = {50, 60};
  }
  ASSERT_TRUE(WriteSafetensors(dir.path() + "/transposed.safetensors", transposed, {}).ok());
  const absl::Status other_shape = client->InitFromSafetensors(dir.path() + "/transposed.safetensors");
  EXPECT_EQ(other_shape.code(), absl::StatusCode::kInvalidArgument) << other_shape;
  EXPECT_THAT(std::string(other_shape.message()), HasSubstr("tensor 'w' has shape (50, 60); the job's is (60, 50)"));
  EXPECT_EQ(client->Describe().value()[0].uninitialized_tensors, job.tensors.size());
  EXPECT_TRUE(client->InitFromSafetensors(expected.path() + "/export-fp32.safetensors").ok());
}

// A CLI call no server answers in time names the server, and says that a
// drop or checkpoint may or may not have taken effect: it printed only
// "DEADLINE_EXCEEDED: Deadline Exceeded". A checkpoint without STEP, which
// first asks the job's step, says when that question went unanswered that
// no checkpoint was asked for (it said nothing of the checkpoint). (A
// socket that listens and never speaks: the connection is made, the call
// never answered.)
TEST(DurabilityTest, TheCliNamesAServerThatDoesNotAnswerAndATlsFileItCannotUse) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  TempDir dir;
  const std::string server = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  const auto unanswered = [&](const std::string& call) {
    const int status = std::system(absl::StrCat(SHARDOPT_CLI_BINARY, " --server=", server, " --timeout_s=1 ", call,
                                                " 2>", dir.path(), "/said").c_str());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << call << ": " << status;
    const std::string said = testing::ReadText(dir.path() + "/said");
    EXPECT_THAT(said, HasSubstr("DEADLINE_EXCEEDED: " + server + ": ")) << call;
    return said;
  };
  EXPECT_THAT(unanswered("drop j"), HasSubstr("whether the call took effect is unknown"));
  EXPECT_THAT(unanswered("checkpoint j 5"), HasSubstr("whether the call took effect is unknown"));
  const std::string step_asked = unanswered("checkpoint j");
  EXPECT_THAT(step_asked, HasSubstr("no checkpoint was asked for"));
  EXPECT_THAT(step_asked, Not(HasSubstr("took effect is unknown")));
  // Past gRPC's 20 s for one connection attempt: the CLI gave up at 20 s
  // with UNAVAILABLE ("the server is down"), whatever --timeout_s said (a
  // probe); the whole --timeout_s is the call's.
  const auto began = std::chrono::steady_clock::now();
  const int status = std::system(absl::StrCat(SHARDOPT_CLI_BINARY, " --server=", server,
                                              " --timeout_s=21 describe j 2>", dir.path(), "/said").c_str());
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  EXPECT_THAT(testing::ReadText(dir.path() + "/said"), HasSubstr("DEADLINE_EXCEEDED: " + server + ": "));
  EXPECT_GE(waited, 20.9);
  EXPECT_LT(waited, 30);
  close(listener);
  // A TLS file the CLI cannot use is named by its path too, not only its
  // role ("the CA file is not PEM text").
  std::ofstream(dir.path() + "/ca.der") << "not pem";
  const int refused = std::system(absl::StrCat(SHARDOPT_CLI_BINARY, " --server=", server, " --tls_ca=", dir.path(),
                                               "/ca.der describe j 2>", dir.path(), "/tls").c_str());
  EXPECT_TRUE(WIFEXITED(refused) && WEXITSTATUS(refused) == 1) << refused;
  EXPECT_THAT(testing::ReadText(dir.path() + "/tls"),
              HasSubstr("the CA file is not PEM text (no '-----BEGIN' line) (--tls_ca=" + dir.path() + "/ca.der)"));
}

// The CLI's checkpoint, as an operator takes one before rolling the
// servers: each server writes its part, the last marks the step complete,
// a server at another step refuses, and a restart restores the step.
TEST(DurabilityTest, TheCliCheckpointsEachServersPartAndTheLastCompletesIt) {
  const JobOptions job = DurableJob("by-cli", {{"w", 3000}, {"u", 2000}});
  TempDir dir;
  std::vector<uint32_t> trained;
  {
    auto servers = StartServers(2, dir.path());
    auto client = Connect(servers);
    Train(*client, job, 3);
    trained = Fingerprint(*client, job).value();
    const auto cli = [&](int s, const std::string& args, std::string* out) {
      return RunCli(servers[s]->address(), "checkpoint " + args, out);
    };
    std::string out;
    EXPECT_NE(cli(0, "by-cli 2", &out), 0) << out;  // not the step the server holds
    EXPECT_THAT(out, HasSubstr("FAILED_PRECONDITION"));
    ASSERT_EQ(cli(0, "by-cli", &out), 0) << out;  // the step it holds: 3
    EXPECT_THAT(out, AllOf(HasSubstr("\"step\": \"3\""), HasSubstr("\"complete\": false")));
    ASSERT_EQ(cli(1, "by-cli 3", &out), 0) << out;
    EXPECT_THAT(out, HasSubstr("\"complete\": true"));
  }
  auto servers = StartServers(2, dir.path());
  auto client = Connect(servers);
  ASSERT_EQ(client->CreateOrAttach(job).value(), 3u);
  EXPECT_EQ(Fingerprint(*client, job).value(), trained);
}

// `read` without an OFFSET prints the server's own shard of the tensor,
// wherever it starts: the default of 0 used to be OUT_OF_RANGE on every
// server but the one holding the tensor's start. Each value is the state's
// float, bit for bit (%.9g round-trips a float).
TEST(DurabilityTest, TheCliReadsEachServersShardWithoutAnOffset) {
  const JobOptions job = DurableJob("read-by-cli", {{"w", 9000}});
  TempDir dir;
  auto servers = StartServers(2, dir.path());
  auto client = Connect(servers);
  Train(*client, job, 2);
  int shards_of_w = 0;
  for (const ShardPlacement& shard : PlaceTensors(job.tensors, 2)) {
    if (shard.tensor != "w") continue;
    ++shards_of_w;
    SCOPED_TRACE(shard.server);
    std::vector<float> held(shard.length);
    ASSERT_TRUE(client->Read("w", StateToRead::kExpAvg, shard.offset, shard.length, held.data()).ok());
    std::string out;
    ASSERT_EQ(RunCli(servers[shard.server]->address(), "read read-by-cli w exp_avg", &out), 0) << out;
    const std::vector<std::string> lines = absl::StrSplit(absl::StripSuffix(out, "\n"), '\n');
    ASSERT_EQ(lines.size(), shard.length);
    for (size_t i = 0; i < lines.size(); ++i) {
      ASSERT_TRUE(SameBits(std::strtof(lines[i].c_str(), nullptr), held[i]))
          << "element " << shard.offset + i << ": " << lines[i];
    }
  }
  ASSERT_EQ(shards_of_w, 2);  // w lies on both servers
  // An OFFSET given is the tensor's element, as before.
  std::string out;
  EXPECT_NE(RunCli(servers[1]->address(), "read read-by-cli w master 0", &out), 0);
  EXPECT_THAT(out, HasSubstr("OUT_OF_RANGE"));
}

// A `read` while a trainer steps the job prints one step's state, or
// refuses: it printed chunk after chunk as they came, each of its own step
// (a probe saw 15 steps in one read), and exited 0. Every element here has
// the same value at any step, so a read of one step prints one value.
// Reads go on until two have printed (at most 30): a trainer stepping back
// to back leaves few gaps a read fits in, and all three tries of five reads
// in a row were refused in one run of twenty-two.
TEST(DurabilityTest, TheCliReadsOneStepsStateWhileATrainerSteps) {
  constexpr uint64_t kN = uint64_t{1} << 21;
  TempDir dir;
  auto servers = StartServers(1, dir.path());
  auto client = Connect(servers);
  JobOptions job;
  job.name = "read-while-stepping";
  job.groups = {GroupOptions{}};
  job.tensors = {{"w", kN, 0, ParamType::kFp32}};
  ASSERT_TRUE(client->CreateOrAttach(job).ok());
  ASSERT_TRUE(client->InitFp32("w", std::vector<float>(kN, 0.5f).data()).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> stepped{0};
  std::thread trainer([&] {  // the client's only user until joined
    const std::vector<float> grad(kN, 1.0f);
    std::vector<float> params(kN);
    for (int t = 0; t < 2000 && !stop; ++t) {
      if (!client->Step({{"w", grad.data()}}, StepOptions{}, {{"w", params.data()}}).ok()) break;
      ++stepped;
    }
  });
  int consistent = 0;
  for (int i = 0; i < 30 && consistent < 2; ++i) {
    std::string out;
    const int status = RunCli(servers[0]->address(), "read read-while-stepping w master", &out);
    if (status != 0) {
      EXPECT_THAT(out, HasSubstr("changed step during each of 3 reads"));
      continue;
    }
    const std::vector<std::string> lines = absl::StrSplit(absl::StripSuffix(out, "\n"), '\n');
    ASSERT_EQ(lines.size(), kN);
    const std::set<std::string> values(lines.begin(), lines.end());
    EXPECT_EQ(values.size(), 1u) << "one read printed " << values.size() << " steps' values";
    ++consistent;
  }
  const int stepped_while_read = stepped;
  stop = true;
  trainer.join();
  EXPECT_GT(consistent, 0);
  EXPECT_GT(stepped_while_read, 5);
}

}  // namespace
}  // namespace shardopt
