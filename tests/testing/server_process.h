// A real shardopt-server process on 127.0.0.1 with an ephemeral port, for
// integration and fault tests.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace shardopt::testing {

// A loopback port nobody listens on now (bound, read and released), for a
// server flag that takes a fixed port.
int FreeLoopbackPort();

// The answer to GET /metrics on loopback (127.0.0.1, or ::1 with `ipv6`),
// headers and all; empty if nothing answers there.
std::string GetMetrics(int port, bool ipv6 = false);
// The value of one series in GetMetrics(port), named whole with its labels
// (`shardopt_open_streams`, `shardopt_refusals_total{method="Read",code="CANCELLED"}`);
// -1 where the server has no such series.
double MetricValue(int port, const std::string& series);

// A file's whole text (a process's log, a certificate); empty if unreadable.
std::string ReadText(const std::string& path);

// A process's resident set now (VmRSS) and its peak so far (VmHWM), in
// bytes; 0 if /proc does not say.
uint64_t RssBytes(pid_t pid);
uint64_t PeakRssBytes(pid_t pid);

// Forks and execs argv[0] (tools/spawn.h); the child is killed when the
// calling thread exits. Its stderr goes to `stderr_path` if given, else it
// is the caller's.
pid_t SpawnProcess(std::vector<std::string> argv, const std::string& stderr_path = "");
// The child's wait status once it has exited, or nullopt after `timeout`.
std::optional<int> WaitProcess(pid_t pid, std::chrono::milliseconds timeout);

// The server these tests start: shardopt-server from this build and
// --device=cpu, unless SHARDOPT_TEST_SERVER_BINARY and SHARDOPT_TEST_DEVICE
// name others. The GPU machine's check (tests/gpu/device_check.sh) runs the
// integration tests against a bundled server on --device=cuda that way.
std::string ServerBinary();
std::string ServerDevice();

// The exit code of shardopt-server run on loopback with ServerDevice() and then
// `args` (later flags win), or -1 if it is still running after 20 s (then
// killed) or died of a signal: for flags that must stop it at start-up.
// With `log`, what it wrote to stderr.
int ServerExitCode(const std::vector<std::string>& args, std::string* log = nullptr);

class ServerProcess {
 public:
  // Starts ServerBinary() with ServerDevice() plus `args`, and waits until it
  // listens.
  // The server is killed when the calling thread exits.
  static std::unique_ptr<ServerProcess> Start(const std::vector<std::string>& args = {});
  // The same, with the server's stderr (its log) kept for log().
  static std::unique_ptr<ServerProcess> StartLogged(const std::vector<std::string>& args);
  // What the server has logged so far (StartLogged only).
  std::string log() const;
  ~ServerProcess();  // SIGKILL if still running

  std::string address() const;
  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  // Sends `signal` and waits for the process; returns its wait status.
  int Stop(int signal);

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  std::string dir_;
  std::string log_path_;
  static std::unique_ptr<ServerProcess> Launch(const std::vector<std::string>& args, bool logged);
};

}  // namespace shardopt::testing
