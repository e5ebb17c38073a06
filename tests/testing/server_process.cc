#include "tests/testing/server_process.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tools/spawn.h"

namespace shardopt::testing {

int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::string GetMetrics(int port, bool ipv6) {
  sockaddr_storage address{};
  socklen_t length;
  if (ipv6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&address);
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_loopback;
    a->sin6_port = htons(port);
    length = sizeof *a;
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&address);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a->sin_port = htons(port);
    length = sizeof *a;
  }
  const int fd = socket(address.ss_family, SOCK_STREAM, 0);
  std::string text;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), length) == 0) {
    const std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    send(fd, request.data(), request.size(), 0);
    char buf[4096];
    for (ssize_t n; (n = recv(fd, buf, sizeof buf, 0)) > 0;) text.append(buf, n);
  }
  close(fd);
  return text;
}

double MetricValue(int port, const std::string& series) {
  const std::string text = GetMetrics(port);
  const std::string line = "\n" + series + " ";
  const size_t at = text.find(line);
  return at == std::string::npos ? -1 : std::atof(text.c_str() + at + line.size());
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

namespace {

// A "<key> <n> kB" line of /proc/<pid>/status, in bytes.
uint64_t StatusBytes(pid_t pid, const std::string& key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string word;
  while (in >> word) {
    if (word == key) {
      uint64_t kib = 0;
      in >> kib;
      return kib << 10;
    }
  }
  return 0;
}

}  // namespace

uint64_t RssBytes(pid_t pid) { return StatusBytes(pid, "VmRSS:"); }
uint64_t PeakRssBytes(pid_t pid) { return StatusBytes(pid, "VmHWM:"); }

pid_t SpawnProcess(std::vector<std::string> argv, const std::string& stderr_path) {
  SpawnOptions options;
  options.stderr_path = stderr_path;
  return Spawn(std::move(argv), options);
}

std::optional<int> WaitProcess(pid_t pid, std::chrono::milliseconds timeout) {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    if (std::chrono::steady_clock::now() >= give_up) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string ServerBinary() {
  const char* binary = std::getenv("SHARDOPT_TEST_SERVER_BINARY");
  return binary != nullptr && *binary != '\0' ? binary : SHARDOPT_SERVER_BINARY;
}

std::string ServerDevice() {
  const char* device = std::getenv("SHARDOPT_TEST_DEVICE");
  return device != nullptr && *device != '\0' ? device : "cpu";
}

std::unique_ptr<ServerProcess> ServerProcess::Start(const std::vector<std::string>& args) {
  return Launch(args, false);
}

std::unique_ptr<ServerProcess> ServerProcess::StartLogged(const std::vector<std::string>& args) {
  return Launch(args, true);
}

std::string ServerProcess::log() const { return ReadText(log_path_); }

std::unique_ptr<ServerProcess> ServerProcess::Launch(const std::vector<std::string>& args, bool logged) {
  auto proc = std::unique_ptr<ServerProcess>(new ServerProcess);
  char tmpl[] = "/tmp/shardopt-test-XXXXXX";
  proc->dir_ = mkdtemp(tmpl);
  if (logged) proc->log_path_ = proc->dir_ + "/server.log";
  const std::string port_file = proc->dir_ + "/port";
  // Later flags win, so `args` may override the port.
  std::vector<std::string> argv_s = {ServerBinary(), "--host=127.0.0.1", "--port=0", "--port_file=" + port_file,
                                     "--device=" + ServerDevice()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  proc->pid_ = SpawnProcess(argv_s, proc->log_path_);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < give_up) {
    std::ifstream in(port_file);
    if (in >> proc->port_ && proc->port_ > 0) return proc;
    int status;
    if (waitpid(proc->pid_, &status, WNOHANG) == proc->pid_) {
      proc->pid_ = -1;
      ADD_FAILURE() << "shardopt-server exited during start-up";
      return nullptr;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ADD_FAILURE() << "shardopt-server did not listen within 20 s";
  return nullptr;
}

int ServerExitCode(const std::vector<std::string>& args, std::string* log) {
  std::vector<std::string> argv = {ServerBinary(), "--host=127.0.0.1", "--port=0", "--device=" + ServerDevice()};
  argv.insert(argv.end(), args.begin(), args.end());
  char tmpl[] = "/tmp/shardopt-exit-XXXXXX";
  const std::string log_path = log == nullptr ? "" : std::string(mkdtemp(tmpl)) + "/stderr";
  const auto read_log = [&] {
    if (log == nullptr) return;
    *log = ReadText(log_path);
    std::filesystem::remove_all(std::filesystem::path(log_path).parent_path());
  };
  const pid_t pid = SpawnProcess(argv, log_path);
  const auto status = WaitProcess(pid, std::chrono::seconds(20));
  if (!status) {
    kill(pid, SIGKILL);
    WaitProcess(pid, std::chrono::seconds(20));
    read_log();
    return -1;
  }
  read_log();
  return WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
}

std::string ServerProcess::address() const { return absl::StrCat("127.0.0.1:", port_); }

int ServerProcess::Stop(int signal) {
  if (pid_ <= 0) return 0;
  kill(pid_, signal);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return status;
}

ServerProcess::~ServerProcess() {
  Stop(SIGKILL);
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

}  // namespace shardopt::testing
