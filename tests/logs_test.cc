// The server's log as an operator reads it, from real server processes:
// every line has a timestamp, a level and an event; the lines an operator
// needs are there (start, job created and attached, a refusal with its code
// and job, checkpoint begin and end with bytes and seconds, drain, restore,
// drop); refusals a client repeats are rate-limited; no token ever appears.
#include <signal.h>
#include <unistd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <arpa/inet.h>

#include <cerrno>
#include <cstring>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "shardopt/client.h"
#include "tests/testing/client_helpers.h"
#include "tests/testing/generic_unary.h"
#include "tests/testing/reference.h"
#include "tests/testing/server_process.h"

namespace shardopt {
namespace {

using testing::ServerProcess;

JobOptions OneTensor4k(const std::string& name) { return testing::OneTensorJob(name, 4096); }
std::unique_ptr<Client> Connect(const std::string& address, const std::string& token) {
  return testing::ConnectOnce(address, token);
}

constexpr char kToken[] = "secret-token-never-logged-0123";

std::vector<nlohmann::json> JsonLines(const std::string& log) {
  std::vector<nlohmann::json> lines;
  for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(j.is_discarded()) << "not JSON: " << line;
    if (j.is_discarded()) continue;
    EXPECT_TRUE(j.contains("ts") && j.contains("level") && j.contains("event")) << line;
    lines.push_back(std::move(j));
  }
  return lines;
}

std::vector<nlohmann::json> Events(const std::vector<nlohmann::json>& lines, const std::string& event) {
  std::vector<nlohmann::json> out;
  for (const auto& j : lines) {
    if (j.value("event", "") == event) out.push_back(j);
  }
  return out;
}

// A TCP connection to 127.0.0.1:port that sends nothing yet (-1 if
// refused).
int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

class LogsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/shardopt-logs-XXXXXX";
    dir_ = mkdtemp(tmpl);
    std::ofstream(dir_ + "/tokens") << "alice trainer " << kToken << " team/\n";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::vector<std::string> Flags() const {
    return {"--log_format=json", "--tokens_file=" + dir_ + "/tokens", "--checkpoint_dir=" + dir_ + "/ckpt"};
  }
  std::string dir_;
  std::mt19937_64 rng_{std::random_device{}()};
};

// gRPC's own lines (here: the port is taken) come through the server's log:
// with --log_format=json, every line of stderr is JSON.
TEST_F(LogsTest, GrpcsOwnLinesAreTheServersJsonLines) {
  auto first = ServerProcess::Start();
  std::string log;
  EXPECT_EQ(testing::ServerExitCode({"--log_format=json", absl::StrCat("--port=", first->port())}, &log), 1);
  const std::vector<nlohmann::json> lines = JsonLines(log);
  EXPECT_FALSE(Events(lines, "grpc").empty()) << log;
  const std::vector<nlohmann::json> failed = Events(lines, "start_failed");
  ASSERT_EQ(failed.size(), 1u) << log;
  // The reason is in the server's own line too, not only in gRPC's.
  EXPECT_EQ(failed[0].value("error", ""), absl::StrCat("cannot listen on 127.0.0.1:", first->port(),
                                                       ": Address already in use")) << log;
}

// An ephemeral port on an address that is not this machine's: gRPC's line
// says why, and the server's own line now does too (it said only "cannot
// listen on 10.255.255.1:0", an outside probe found).
TEST_F(LogsTest, AStartOnAnAddressNotThisMachinesSaysWhy) {
  std::string log;
  EXPECT_EQ(testing::ServerExitCode({"--log_format=json", "--host=10.255.255.1", "--insecure", "--port=0"}, &log), 1);
  const std::vector<nlohmann::json> failed = Events(JsonLines(log), "start_failed");
  ASSERT_EQ(failed.size(), 1u) << log;
  EXPECT_EQ(failed[0].value("error", ""), "cannot listen on 10.255.255.1:0: Cannot assign requested address") << log;
}

// Protobuf's own lines (here: a request whose job name is not UTF-8, which
// any client can send) come through the server's log too, as JSON, and at
// most a few a second: before, each request wrote a raw line to stderr.
TEST_F(LogsTest, ProtobufsOwnLinesAreTheServersJsonLinesAndRateLimited) {
  auto server = ServerProcess::StartLogged({"--log_format=json"});
  ASSERT_NE(server, nullptr);
  const std::string not_utf8("\x0a\x02\xff\xfe", 4);  // DescribeRequest.job
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(testing::GenericUnary(server->address(), "/shardopt.v1.Optimizer/Describe", not_utf8).first.error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  server->Stop(SIGTERM);
  const std::vector<nlohmann::json> lines = JsonLines(server->log());
  const std::vector<nlohmann::json> protobuf = Events(lines, "protobuf");
  ASSERT_FALSE(protobuf.empty()) << server->log();
  EXPECT_THAT(protobuf[0].value("message", ""), ::testing::HasSubstr("invalid UTF-8"));
  EXPECT_LE(protobuf.size(), 5 * (static_cast<size_t>(seconds) + 2)) << server->log();
}

// The method label of shardopt_refusals_total is one of the service's:
// a caller naming 50 methods that do not exist adds one series, "unknown"
// (it used to add 50, never removed, and a log line each past the rate
// limit), and so does one of a service linked into the server but not
// served (reflection's, without --reflection: it was labelled
// "ServerReflectionInfo"); and health checks answered NOT_FOUND, or a Watch
// ended by its client, are not refusals.
TEST_F(LogsTest, RefusalsOfMethodsThatDoNotExistShareOneLabel) {
  const int port = testing::FreeLoopbackPort();
  auto server = ServerProcess::StartLogged({absl::StrCat("--metrics_port=", port), "--log_format=json"});
  ASSERT_NE(server, nullptr);
  for (int i = 0; i < 50; ++i) {
    const grpc::Status st =
        testing::GenericUnary(server->address(), absl::StrCat("/shardopt.v1.Optimizer/M", i), "").first;
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNIMPLEMENTED);
    // The path tried, to the caller and in the log (gRPC's answer was empty).
    EXPECT_EQ(st.error_message(), absl::StrCat("this server serves no method '/shardopt.v1.Optimizer/M", i, "'"));
  }
  EXPECT_EQ(testing::GenericUnary(server->address(), "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "")
                .first.error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  const std::string nope("\x0a\x04nope", 6);  // HealthCheckRequest{service: "nope"}
  EXPECT_EQ(testing::GenericUnary(server->address(), "/grpc.health.v1.Health/Check", nope).first.error_code(),
            grpc::StatusCode::NOT_FOUND);
  const std::string metrics = testing::GetMetrics(port);
  EXPECT_THAT(metrics, ::testing::HasSubstr("\nshardopt_refusals_total{method=\"unknown\",code=\"UNIMPLEMENTED\"} 51\n"));
  EXPECT_THAT(metrics, ::testing::Not(::testing::HasSubstr("method=\"M")));
  EXPECT_THAT(metrics, ::testing::Not(::testing::HasSubstr("method=\"ServerReflectionInfo\"")));
  EXPECT_THAT(metrics, ::testing::Not(::testing::HasSubstr("method=\"Check\"")));
  server->Stop(SIGTERM);
  size_t refused = 0;
  for (const nlohmann::json& line : Events(JsonLines(server->log()), "refused")) {
    ++refused;
    EXPECT_EQ(line.value("method", ""), "unknown") << line;
    EXPECT_THAT(line.value("message", ""), ::testing::StartsWith("this server serves no method '/")) << line;
    EXPECT_THAT(line.value("peer", ""), ::testing::StartsWith("ipv4:127.0.0.1:")) << line;  // who was refused
  }
  EXPECT_LE(refused, 10u) << server->log();  // rate-limited as one method
}

// A refused unary call of the service (here a Describe of a job the server
// does not hold) names its caller too: a synchronous call's context has no
// peer yet when its interceptor is made, so its line said peer="".
TEST_F(LogsTest, ARefusedUnaryCallNamesItsPeer) {
  auto server = ServerProcess::StartLogged({"--log_format=json"});
  ASSERT_NE(server, nullptr);
  const std::string nope("\x0a\x04nope", 6);  // DescribeRequest{job: "nope"}
  EXPECT_EQ(testing::GenericUnary(server->address(), "/shardopt.v1.Optimizer/Describe", nope).first.error_code(),
            grpc::StatusCode::NOT_FOUND);
  server->Stop(SIGTERM);
  const std::vector<nlohmann::json> refused = Events(JsonLines(server->log()), "refused");
  ASSERT_EQ(refused.size(), 1u) << server->log();
  EXPECT_EQ(refused[0].value("method", ""), "Describe");
  EXPECT_THAT(refused[0].value("peer", ""), ::testing::StartsWith("ipv4:127.0.0.1:")) << refused[0];
}

// A stream gRPC cuts (a message over --max_message_bytes) is logged with
// its caller's address too: the peer is taken as the call begins, where a
// cancelled call's context said "unknown" by the time its status went out.
TEST_F(LogsTest, ARefusedLineOfACutStreamNamesItsPeer) {
  auto server = ServerProcess::StartLogged({"--log_format=json", "--max_message_bytes=131072"});
  ASSERT_NE(server, nullptr);
  const auto cut = testing::GenericUnary(server->address(), "/shardopt.v1.Optimizer/Push", std::string(200000, 'x'));
  EXPECT_FALSE(cut.first.ok());
  server->Stop(SIGTERM);
  const std::vector<nlohmann::json> refused = Events(JsonLines(server->log()), "refused");
  ASSERT_FALSE(refused.empty()) << server->log();
  for (const nlohmann::json& line : refused) {
    EXPECT_THAT(line.value("peer", ""), ::testing::StartsWith("ipv4:127.0.0.1:")) << line;
  }
}

// gRPC refuses a compressed message itself (UNIMPLEMENTED, README
// "Errors"): a unary call refused so never reaches the server's handlers,
// but a Push stream's handler has begun and sees only that its stream
// ended, which it counts and logs as CANCELLED, as the README says.
TEST_F(LogsTest, ACompressedMessageIsCountedOnlyWhereAStreamsHandlerHadBegun) {
  const int port = testing::FreeLoopbackPort();
  auto server = ServerProcess::StartLogged({absl::StrCat("--metrics_port=", port), "--log_format=json"});
  ASSERT_NE(server, nullptr);
  const std::string job("\x0a\x04nope", 6);  // DescribeRequest.job, GradChunk.job
  for (const char* method : {"Describe", "Push"}) {
    const grpc::Status refused = testing::GenericUnary(server->address(), absl::StrCat("/shardopt.v1.Optimizer/", method),
                                                       job, GRPC_COMPRESS_GZIP)
                                     .first;
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNIMPLEMENTED) << method << ": " << refused.error_message();
  }
  // The handler counts its end after gRPC has answered the caller.
  const std::string pushes = "shardopt_refusals_total{method=\"Push\",code=\"CANCELLED\"}";
  for (int i = 0; i < 50 && testing::MetricValue(port, pushes) < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(testing::MetricValue(port, pushes), 1);
  // Describe's series of every code stay at 0 (those the alerts watch are
  // there from the start), and no other method's moved.
  for (const absl::string_view line : absl::StrSplit(testing::GetMetrics(port), '\n')) {
    if (!absl::StartsWith(line, "shardopt_refusals_total{") || absl::StartsWith(line, pushes + " ")) continue;
    EXPECT_TRUE(absl::EndsWith(line, "} 0")) << line;
  }
  server->Stop(SIGTERM);
  const std::vector<nlohmann::json> refused = Events(JsonLines(server->log()), "refused");
  ASSERT_EQ(refused.size(), 1u) << server->log();
  EXPECT_EQ(refused[0].value("method", ""), "Push");
  EXPECT_EQ(refused[0].value("code", ""), "CANCELLED");
}

// The counters the README's alerts watch are there from the start, at 0:
// an alert on their increase sees a series on a server that has written no
// checkpoint, and the rate of a series that first appeared at 1 would miss
// the first refusal or skipped step.
TEST_F(LogsTest, TheCountersTheAlertsWatchStartAtZero) {
  const int port = testing::FreeLoopbackPort();
  const std::string checkpoints = dir_ + "/ckpt";
  auto server = ServerProcess::Start({absl::StrCat("--metrics_port=", port), "--checkpoint_dir=" + checkpoints});
  std::string metrics = testing::GetMetrics(port);
  EXPECT_THAT(metrics, ::testing::HasSubstr("\nshardopt_checkpoint_bytes_total{direction=\"write\"} 0\n"));
  EXPECT_THAT(metrics, ::testing::HasSubstr("\nshardopt_checkpoint_bytes_total{direction=\"restore\"} 0\n"));
  for (const char* method : {"CreateJob", "Init", "Push", "Commit", "Read", "Describe", "DropJob", "Checkpoint"}) {
    for (const char* code : {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAUTHENTICATED", "PERMISSION_DENIED"}) {
      EXPECT_THAT(metrics, ::testing::HasSubstr(absl::StrCat("\nshardopt_refusals_total{method=\"", method,
                                                             "\",code=\"", code, "\"} 0\n")));
    }
  }
  auto client = Connect(server->address(), "");
  ASSERT_TRUE(client->CreateOrAttach(OneTensor4k("fresh")).ok());
  metrics = testing::GetMetrics(port);
  for (const char* family : {"shardopt_skipped_steps_total", "shardopt_checkpoints_total",
                             "shardopt_checkpoint_failures_total"}) {
    EXPECT_THAT(metrics, ::testing::HasSubstr(absl::StrCat("\n", family, "{job=\"fresh\"} 0\n")));
  }
  // And when the server started and the job was made, which the alerts use
  // to see an event before a series' first scrape.
  EXPECT_THAT(metrics, ::testing::HasSubstr("\nprocess_start_time_seconds 1"));
  EXPECT_THAT(metrics, ::testing::HasSubstr("\nshardopt_job_created_timestamp_seconds{job=\"fresh\"} 1"));
  // A checkpoint written counts in one, and one that fails in the other
  // (here its job's directory is a file).
  const std::vector<float> values = testing::RandomFloats(rng_, 4096, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", values.data()).ok());
  ASSERT_TRUE(client->Checkpoint().ok());
  std::filesystem::remove_all(checkpoints + "/fresh");
  std::ofstream(checkpoints + "/fresh") << "not a directory";
  EXPECT_FALSE(client->Checkpoint().ok());
  metrics = testing::GetMetrics(port);
  EXPECT_THAT(metrics, ::testing::HasSubstr("\nshardopt_checkpoints_total{job=\"fresh\"} 1\n"));
  EXPECT_THAT(metrics, ::testing::HasSubstr("\nshardopt_checkpoint_failures_total{job=\"fresh\"} 1\n"));
}

// A checkpoint that fails at the SIGTERM drain is scraped before the server
// exits: it answers /metrics until one scrape after the drain (at most
// --drain_failure_wait_seconds), so that ShardoptCheckpointFailed sees
// the failure. The process used to exit within milliseconds of it, and
// Prometheus never saw the counter move (a probe lost four steps so).
TEST_F(LogsTest, ACheckpointThatFailsAtTheDrainIsScrapedBeforeTheServerExits) {
  const int port = testing::FreeLoopbackPort();
  const std::string checkpoints = dir_ + "/ckpt";
  auto server = ServerProcess::StartLogged({absl::StrCat("--metrics_port=", port), "--checkpoint_dir=" + checkpoints,
                                            "--log_format=json", "--drain_failure_wait_seconds=60"});
  ASSERT_NE(server, nullptr);
  auto client = Connect(server->address(), "");
  ASSERT_TRUE(client->CreateOrAttach(OneTensor4k("drained")).ok());
  const std::vector<float> values = testing::RandomFloats(rng_, 4096, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", values.data()).ok());
  std::ofstream(checkpoints + "/drained") << "not a directory";  // the drain's checkpoint fails
  const auto t0 = std::chrono::steady_clock::now();
  std::future<int> stopped = std::async(std::launch::async, [&] { return server->Stop(SIGTERM); });
  std::string metrics;
  while (metrics.find("\nshardopt_checkpoint_failures_total{job=\"drained\"} 1\n") == std::string::npos &&
         std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    metrics = testing::GetMetrics(port);
  }
  EXPECT_THAT(metrics, ::testing::HasSubstr("\nshardopt_checkpoint_failures_total{job=\"drained\"} 1\n"));
  // That scrape ends the wait, well before the 60 s given.
  ASSERT_EQ(stopped.wait_for(std::chrono::seconds(20)), std::future_status::ready);
  const int status = stopped.get();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  const std::vector<nlohmann::json> lines = JsonLines(server->log());
  ASSERT_EQ(Events(lines, "drain_failed_wait").size(), 1u) << server->log();
  EXPECT_EQ(Events(lines, "drain_failed_wait")[0].value("scraped", ""), "true");
}

// A server with nowhere to write its jobs says, when it stops, which ones
// it lets go: they ended with the process in silence (an operator's probe).
// One line per job, so that a name with a comma in it reads as one.
TEST_F(LogsTest, AStopWithoutACheckpointDirNamesTheJobsItDiscards) {
  auto server = ServerProcess::StartLogged({"--log_format=json"});
  ASSERT_NE(server, nullptr);
  auto client = Connect(server->address(), "");
  for (int i = 0; i < 18; ++i) {
    ASSERT_TRUE(client->CreateOrAttach(OneTensor4k(absl::StrCat("kept,nowhere-", 10 + i))).ok());
  }
  const int status = server->Stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  const std::vector<nlohmann::json> discarded = Events(JsonLines(server->log()), "job_discarded");
  ASSERT_EQ(discarded.size(), 17u) << server->log();
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(discarded[i].value("job", ""), absl::StrCat("kept,nowhere-", 10 + i));
    EXPECT_EQ(discarded[i].value("level", ""), "warning");
  }
  EXPECT_EQ(discarded[16].value("more", ""), "2");
}

// The drain checkpoints a job only once every shard has its initial values;
// one still waiting for them is named as discarded, where it was skipped
// in silence under a drain line saying that every job is checkpointed (an
// operator's probe).
TEST_F(LogsTest, TheDrainNamesAJobItDoesNotCheckpointForWantOfInitialValues) {
  const std::string checkpoints = dir_ + "/ckpt";
  auto server = ServerProcess::StartLogged({"--checkpoint_dir=" + checkpoints, "--log_format=json"});
  ASSERT_NE(server, nullptr);
  auto client = Connect(server->address(), "");
  ASSERT_TRUE(client->CreateOrAttach(OneTensor4k("kept")).ok());
  const std::vector<float> values = testing::RandomFloats(rng_, 4096, -1, 1);
  ASSERT_TRUE(client->InitFp32("w", values.data()).ok());
  auto waiting = Connect(server->address(), "");
  ASSERT_TRUE(waiting->CreateOrAttach(OneTensor4k("uninitialized")).ok());
  const int status = server->Stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  const std::vector<nlohmann::json> lines = JsonLines(server->log());
  const std::vector<nlohmann::json> discarded = Events(lines, "job_discarded");
  ASSERT_EQ(discarded.size(), 1u) << server->log();
  EXPECT_EQ(discarded[0].value("job", ""), "uninitialized");
  EXPECT_THAT(discarded[0].value("why", ""), ::testing::HasSubstr("initial values"));
  const std::vector<nlohmann::json> written = Events(lines, "checkpoint_end");
  ASSERT_EQ(written.size(), 1u) << server->log();
  EXPECT_EQ(written[0].value("job", ""), "kept");
}

// Connections that send nothing (a port scan, a stuck client) hold up no
// scrape: each was given two seconds in turn, so five delayed one by ten.
TEST_F(LogsTest, AScrapeIsAnsweredWhileOtherConnectionsSendNothing) {
  const int port = testing::FreeLoopbackPort();
  auto server = ServerProcess::Start({absl::StrCat("--metrics_port=", port)});
  std::vector<int> idle;
  for (int i = 0; i < 5; ++i) {
    const int fd = ConnectLoopback(port);
    ASSERT_GE(fd, 0);
    idle.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // accepted, each waiting for its request
  const auto start = std::chrono::steady_clock::now();
  const std::string metrics = testing::GetMetrics(port);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_THAT(metrics, ::testing::HasSubstr("\nshardopt_jobs 0\n"));
  EXPECT_LT(seconds, 1.0);
  // HEAD, as some probes ask: the headers alone.
  const std::string head = "HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(send(idle[0], head.data(), head.size(), 0), static_cast<ssize_t>(head.size()));
  char buf[512];
  const ssize_t n = recv(idle[0], buf, sizeof buf, MSG_WAITALL);
  ASSERT_GT(n, 0);
  const std::string answer(buf, static_cast<size_t>(n));
  EXPECT_THAT(answer, ::testing::StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_EQ(answer.substr(answer.find("\r\n\r\n") + 4), "");
  // Another method on the path is 405 with what is allowed; another path 404.
  for (const auto& [request, status] : {std::pair<std::string, std::string>{"POST /metrics HTTP/1.1\r\n\r\n", "405"},
                                        {"GET /other HTTP/1.1\r\n\r\n", "404"}}) {
    ASSERT_EQ(send(idle[1 + (status == "404")], request.data(), request.size(), 0),
              static_cast<ssize_t>(request.size()));
    const ssize_t got = recv(idle[1 + (status == "404")], buf, sizeof buf, MSG_WAITALL);
    ASSERT_GT(got, 0);
    const std::string reply(buf, static_cast<size_t>(got));
    EXPECT_THAT(reply, ::testing::StartsWith("HTTP/1.1 " + status + " ")) << request;
    if (status == "405") {
      EXPECT_THAT(reply, ::testing::HasSubstr("\r\nAllow: GET, HEAD\r\n"));
    }
  }
  for (int fd : idle) close(fd);
}

// Clients that ask for the metrics and read nothing hold up no other
// scrape: answers were written whole, one at a time, each given five
// seconds, so an outside probe's one such client delayed every scrape by
// 5 s and ten made Prometheus's scrape fail (with an answer larger than
// the sockets' buffers, as a server of a few thousand jobs gives).
TEST_F(LogsTest, AScrapeIsAnsweredWhileOtherClientsAskAndReadNothing) {
  const int port = testing::FreeLoopbackPort();
  auto server = ServerProcess::Start({absl::StrCat("--metrics_port=", port), "--staging_window_bytes=131072"});
  ASSERT_NE(server, nullptr);
  constexpr int kJobs = 8000;  // about 9 MB of metrics with these names: more than a socket takes
  auto client = Connect(server->address(), "");
  for (int i = 0; i < kJobs; ++i) {
    JobOptions job = OneTensor4k(absl::StrCat(std::string(180, 'j'), i));
    job.tensors[0].numel = 1;
    ASSERT_TRUE(client->CreateOrAttach(job).ok()) << i;
  }
  std::vector<int> stuck;
  std::vector<std::chrono::steady_clock::time_point> asked;  // when each of `stuck` asked
  // A client that asks for the metrics and reads nothing, its socket's
  // buffer small.
  const auto ask_and_read_nothing = [&] {
    const std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    const int small = 4096;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(send(fd, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
    stuck.push_back(fd);
    asked.push_back(std::chrono::steady_clock::now());
  };
  for (int i = 0; i < 3; ++i) ask_and_read_nothing();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // each asked, its answer stuck in its socket
  const auto start = std::chrono::steady_clock::now();
  const std::string metrics = testing::GetMetrics(port);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_THAT(metrics, ::testing::HasSubstr(absl::StrCat("\nshardopt_jobs ", kJobs, "\n")));
  EXPECT_GT(metrics.size(), 4u << 20);
  // Each stuck client used to hold the scrape for its 5 s write timeout
  // (9.8 s for these three); rendering takes about 0.2 s, more on a loaded
  // machine.
  EXPECT_LT(seconds, 4.0);
  // Each such client makes the server hold what its socket does not take
  // of its answer until taken (or 5 s pass): 64 MiB in all at most, the
  // oldest reset past it. Fifty of them would otherwise hold 100-300 MB.
  const size_t first_of_fifty = stuck.size();
  for (int i = 0; i < 50; ++i) {
    ask_and_read_nothing();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Those of the fifty the server let go of before their 5 s: it reset
  // them, past its cap. Without the cap none goes before 5 s. The 5 s run
  // from the answer's rendering, and the answers are rendered in turn,
  // 0.1-0.2 s each here and more on a loaded machine, so each reset is
  // timed from when its answer began to come, not from the asking: from
  // the last look that found the socket established with nothing to read.
  // (Timed from the asking, only the first few counted once rendering took
  // 0.5 s, and a run beside a compiler saw none.) A reset within 4.8 s of
  // that look counts. The cap is reached only while the server renders
  // more than its 64 MiB in 5 s: about 7 of these 9 MB answers, one each
  // 0.7 s or faster.
  int dropped = 0;
  const size_t fifty = stuck.size() - first_of_fifty;
  // Each client's last look with nothing to read, its asking until a look;
  // fixed once its answer comes. Settled: reset, or 4.8 s past that look.
  std::vector<std::chrono::steady_clock::time_point> quiet(asked.begin() + first_of_fifty, asked.end());
  std::vector<bool> answering(fifty, false), settled(fifty, false);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (bool all = false; !all && std::chrono::steady_clock::now() < give_up;) {
    all = true;
    for (size_t i = 0; i < fifty; ++i) {
      if (settled[i]) continue;
      const int fd = stuck[first_of_fifty + i];
      const auto now = std::chrono::steady_clock::now();
      tcp_info info{};
      socklen_t length = sizeof info;
      const bool reset = getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &length) == 0 && info.tcpi_state != TCP_ESTABLISHED;
      const bool young = now - quiet[i] < std::chrono::milliseconds(4800);
      if (reset && young) ++dropped;
      if (!reset && !answering[i]) {
        pollfd p{fd, POLLIN, 0};
        answering[i] = poll(&p, 1, 0) == 1;
        if (!answering[i]) quiet[i] = now;
      }
      settled[i] = reset || (answering[i] && !young);
      all = all && settled[i];
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::printf("of %zu clients that asked for %zu bytes and read nothing, the server let go of %d\n", fifty,
              metrics.size(), dropped);
  EXPECT_GE(dropped, 3);
  EXPECT_THAT(testing::GetMetrics(port), ::testing::HasSubstr(absl::StrCat("\nshardopt_jobs ", kJobs, "\n")));
  for (int fd : stuck) close(fd);
}

TEST_F(LogsTest, TheLinesAnOperatorNeedsAreThereAndNoTokenIs) {
  // Some flags in a --flagfile, as a pod's ConfigMap gives them.
  std::ofstream(dir_ + "/flags.txt") << "--checkpoint_keep=3\n--max_streams=77\n";
  std::vector<std::string> flags = Flags();
  flags.push_back("--flagfile=" + dir_ + "/flags.txt");
  auto server = ServerProcess::StartLogged(flags);
  ASSERT_NE(server, nullptr);
  {
    auto client = Connect(server->address(), kToken);
    ASSERT_TRUE(client->CreateOrAttach(OneTensor4k("team/job")).ok());
    ASSERT_TRUE(Connect(server->address(), kToken)->CreateOrAttach(OneTensor4k("team/job")).ok());  // attaches
    auto init = testing::RandomFloats(rng_, 4096, -1, 1);
    ASSERT_TRUE(client->InitFp32("w", init.data()).ok());
    ASSERT_TRUE(client->Checkpoint().ok());
    // One step, so that the drain's checkpoint is a new one.
    auto g = testing::RandomBf16(rng_, 4096, 1.0f);
    std::vector<uint16_t> params(4096);
    ASSERT_TRUE(client->Step({{"w", g.data()}}, StepOptions{}, {{"w", params.data()}}).ok());
    // Refusals: a wrong token, and another prefix.
    EXPECT_FALSE(Connect(server->address(), "wrong-token-0123456789")->CreateOrAttach(OneTensor4k("team/x")).ok());
    EXPECT_FALSE(client->CreateOrAttach(OneTensor4k("other/job")).ok());
  }
  ASSERT_TRUE(WIFEXITED(server->Stop(SIGTERM)));  // drains and checkpoints
  const std::string log = server->log();
  EXPECT_THAT(log, ::testing::Not(::testing::HasSubstr(kToken)));
  EXPECT_THAT(log, ::testing::Not(::testing::HasSubstr("wrong-token")));
  const auto lines = JsonLines(log);

  const auto started = Events(lines, "started");
  ASSERT_EQ(started.size(), 1u) << log;
  for (const char* key : {"version", "address", "device", "memory_limit_bytes", "tokens", "flags"}) {
    EXPECT_TRUE(started[0].contains(key)) << key;
  }
  EXPECT_EQ(started[0]["level"], "info");
  // The flags in effect, those of the flagfile too.
  for (const std::string flag : {"--checkpoint_keep=3", "--max_streams=77", "--log_format=json"}) {
    EXPECT_THAT(started[0]["flags"].get<std::string>(), ::testing::HasSubstr(flag));
  }
  const auto created = Events(lines, "job_created");
  ASSERT_EQ(created.size(), 1u) << log;
  EXPECT_EQ(created[0]["job"], "team/job");
  ASSERT_EQ(Events(lines, "job_attached").size(), 1u) << log;
  const auto refused = Events(lines, "refused");
  ASSERT_GE(refused.size(), 2u) << log;
  bool unauthenticated = false, denied = false;
  for (const auto& r : refused) {
    EXPECT_EQ(r["level"], "warning");
    unauthenticated |= r["code"] == "UNAUTHENTICATED" && r["method"] == "CreateJob";
    denied |= r["code"] == "PERMISSION_DENIED" && r["message"].get<std::string>().find("other/job") != std::string::npos;
  }
  EXPECT_TRUE(unauthenticated) << log;
  EXPECT_TRUE(denied) << log;
  // Two checkpoints: the client's, and the drain's at SIGTERM.
  const auto ends = Events(lines, "checkpoint_end");
  ASSERT_EQ(ends.size(), 2u) << log;
  EXPECT_EQ(Events(lines, "checkpoint_begin").size(), 2u);
  for (const auto& e : ends) {
    EXPECT_EQ(e["job"], "team/job");
    EXPECT_GT(std::stoull(e["bytes"].get<std::string>()), 4096u * 12);
    EXPECT_GE(std::stod(e["seconds"].get<std::string>()), 0.0);
  }
  ASSERT_EQ(Events(lines, "drain").size(), 1u);
  ASSERT_EQ(Events(lines, "stopping").size(), 1u);
  const auto exits = Events(lines, "exit");  // the last line says how the process ends
  ASSERT_EQ(exits.size(), 1u);
  EXPECT_EQ(exits[0].value("code", ""), "0");
  EXPECT_EQ(lines.back().value("event", ""), "exit");

  // Restarted on the same directory: the restore is logged; then a drop.
  auto again = ServerProcess::StartLogged(Flags());
  ASSERT_NE(again, nullptr);
  {
    auto client = Connect(again->address(), kToken);
    ASSERT_TRUE(client->CreateOrAttach(OneTensor4k("team/job")).ok());
  }
  again->Stop(SIGKILL);
  const auto restored = Events(JsonLines(again->log()), "job_restored");
  ASSERT_EQ(restored.size(), 1u) << again->log();
  EXPECT_EQ(restored[0]["job"], "team/job");
  EXPECT_TRUE(restored[0].contains("seconds") && restored[0].contains("bytes"));
}

// A client that repeats a refused call cannot flood the log: at most a few
// lines a second per method and code, and the next line says how many were
// held back. Text lines: timestamp, level, event, key=value.
TEST_F(LogsTest, RepeatedRefusalsAreRateLimitedAndTextLinesHaveTheirShape) {
  auto server = ServerProcess::StartLogged({"--log_format=text"});
  ASSERT_NE(server, nullptr);
  auto client = Connect(server->address(), "");
  ASSERT_TRUE(client->CreateOrAttach(OneTensor4k("job")).ok());
  JobOptions other = OneTensor4k("job");
  other.tensors[0].numel = 8;  // the same name, another shape: ALREADY_EXISTS
  auto conflicting = Connect(server->address(), "");
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 200; ++i) EXPECT_FALSE(conflicting->CreateOrAttach(other).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_FALSE(conflicting->CreateOrAttach(other).ok());
  // A last burst, some of it still held back when the server stops.
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(conflicting->CreateOrAttach(other).ok());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // A job name a client chose, with a terminal escape, a tab and a newline in it.
  ASSERT_TRUE(Connect(server->address(), "")->CreateOrAttach(OneTensor4k("red\x1b[31m\tjob\nfake")).ok());
  server->Stop(SIGTERM);
  const std::string log = server->log();
  EXPECT_EQ(log.find('\x1b'), std::string::npos) << "a raw escape byte in the log";
  EXPECT_NE(log.find(R"(job="red\x1b[31m\x09job\x0afake")"), std::string::npos) << log;
  const std::regex shape(R"(^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (info|warning|error) +[a-z_]+( [a-z_]+=("([^"\\]|\\.)*"|\S+))*$)");
  int refused = 0;
  bool suppressed = false;
  uint64_t counted = 0;  // lines logged plus lines said to be held back
  const std::regex held(R"( suppressed=(\d+))");
  for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    const std::string text(line);
    EXPECT_TRUE(std::regex_match(text, shape)) << line;
    if (text.find("ALREADY_EXISTS") == std::string::npos) continue;
    std::smatch n;
    if (text.find(" refused ") != std::string::npos) {
      ++refused;
      ++counted;
      suppressed |= std::regex_search(text, n, held);
    }
    if (std::regex_search(text, n, held)) counted += std::stoull(n[1]);
  }
  EXPECT_GE(refused, 2);
  // At most 5 a second (and one per second boundary), of 221 refusals.
  EXPECT_LE(refused, 5 * (static_cast<int>(seconds) + 2)) << log;
  EXPECT_LT(refused, 221) << log;
  EXPECT_TRUE(suppressed) << log;
  // Every refusal is counted: those still held back at the end are said at exit.
  EXPECT_EQ(counted, 221u) << log;
}


// The server raises its open-file limit to the hard one at start (a
// process started under systemd's soft 1024, here 256) and says so in its
// `started` line, and /metrics exports its open descriptors against it,
// each connection holding one: a server at its limit had every checkpoint
// refused, "Too many open files", while idle connections held the rest (an
// outside probe), and nothing showed it coming.
TEST_F(LogsTest, TheServerRaisesItsOpenFileLimitAndExportsItsOpenFiles) {
  rlimit limit;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  ASSERT_GT(limit.rlim_max, rlim_t{512}) << "the hard limit leaves nothing to raise";
  const rlimit lowered{256, limit.rlim_max};
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  const int port = testing::FreeLoopbackPort();
  auto server = ServerProcess::StartLogged({"--log_format=json", absl::StrCat("--metrics_port=", port)});
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &limit), 0);  // the server inherited the lowered one
  ASSERT_NE(server, nullptr);
  const std::vector<nlohmann::json> started = Events(JsonLines(server->log()), "started");
  ASSERT_EQ(started.size(), 1u) << server->log();
  EXPECT_EQ(started[0].value("max_open_files", ""), absl::StrCat(limit.rlim_max));
  EXPECT_EQ(testing::MetricValue(port, "process_max_fds"), static_cast<double>(limit.rlim_max));
  const double before = testing::MetricValue(port, "process_open_fds");
  EXPECT_GT(before, 0);
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) {
    idle.push_back(ConnectLoopback(server->port()));
    ASSERT_GE(idle.back(), 0);
  }
  double open = before;
  for (int i = 0; i < 100 && open < before + 20; ++i) {  // accepted in the server's time
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    open = testing::MetricValue(port, "process_open_fds");
  }
  EXPECT_GE(open, before + 20);
  for (const int fd : idle) close(fd);
}


// A burst of connections past the open-file limit leaves gRPC 1.51's
// listener accepting nothing for good (grpc/grpc#20418), while the health
// port and /metrics go on: an outside probe's server stayed deaf, its
// health SERVING, so nothing would restart it. The server now sees gRPC's
// "Failed accept4: Too many open files", logs accept_failed and answers
// NOT_SERVING, so that Kubernetes' liveness probe replaces it.
TEST_F(LogsTest, AListenerThatRanOutOfDescriptorsIsReportedNotServing) {
  const int health_port = testing::FreeLoopbackPort();
  auto server = ServerProcess::StartLogged({"--log_format=json", absl::StrCat("--health_port=", health_port)});
  ASSERT_NE(server, nullptr);
  const std::string health = absl::StrCat("127.0.0.1:", health_port);
  const std::string serving("\x08\x01", 2), not_serving("\x08\x02", 2);
  ASSERT_EQ(testing::GenericUnary(health, "/grpc.health.v1.Health/Check", "").second, serving);
  // The server's limit cut to a few descriptors more than it holds.
  const auto open_now = static_cast<rlim_t>(std::distance(
      std::filesystem::directory_iterator("/proc/" + std::to_string(server->pid()) + "/fd"), {}));
  const rlimit tight{open_now + 8, open_now + 8};
  ASSERT_EQ(prlimit(server->pid(), RLIMIT_NOFILE, &tight, nullptr), 0) << std::strerror(errno);
  std::vector<int> flood;
  for (int i = 0; i < 40; ++i) {
    const int fd = ConnectLoopback(server->port());  // the kernel completes it; gRPC's accept fails
    if (fd >= 0) flood.push_back(fd);
  }
  for (int i = 0; i < 100 && !absl::StrContains(server->log(), "Failed accept4"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_THAT(server->log(), ::testing::HasSubstr("Failed accept4: Too many open files"));
  // Freed again, as the probe's were: the health port, a listener of its
  // own, accepts the checks, and the main port stays deaf.
  for (const int fd : flood) close(fd);
  std::string answer;
  for (int i = 0; i < 30 && answer != not_serving; ++i) {  // the main loop looks once a second
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    answer = testing::GenericUnary(health, "/grpc.health.v1.Health/Check", "").second;
  }
  EXPECT_EQ(answer, not_serving);
  const std::vector<nlohmann::json> failed = Events(JsonLines(server->log()), "accept_failed");
  ASSERT_EQ(failed.size(), 1u) << server->log();
  EXPECT_EQ(failed[0].value("health", ""), "NOT_SERVING");
}

}  // namespace
// A start that fails logs why and still ends with `exit`, so that an alert
// on exit lines sees a crash-looping pod.
// Flags that do nothing without another are told at start (they were taken
// silently): an operator who set --checkpoint_keep expects pruning.
TEST_F(LogsTest, FlagsThatDoNothingHereAreSaidToBeIgnored) {
  auto server = ServerProcess::StartLogged(
      {"--checkpoint_keep=3", "--tls_reload_seconds=5", "--drain_failure_wait_seconds=5"});
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(WIFEXITED(server->Stop(SIGTERM)));
  const std::string log = server->log();
  EXPECT_THAT(log, ::testing::HasSubstr("flag_ignored flag=--checkpoint_keep"));
  EXPECT_THAT(log, ::testing::HasSubstr("flag_ignored flag=--tls_reload_seconds"));
  EXPECT_THAT(log, ::testing::HasSubstr("flag_ignored flag=--drain_failure_wait_seconds"));
}

TEST_F(LogsTest, AFailedStartEndsWithAnExitLine) {
  std::string log;
  ASSERT_EQ(testing::ServerExitCode({"--log_format=json", "--checkpoint_dir=/proc/self/no-such-dir"}, &log), 1);
  const auto lines = JsonLines(log);
  ASSERT_EQ(Events(lines, "start_failed").size(), 1u) << log;
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.back().value("event", ""), "exit") << log;
  EXPECT_EQ(lines.back().value("code", ""), "1") << log;
}

}  // namespace shardopt
