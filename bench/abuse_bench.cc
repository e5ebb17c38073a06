// shardopt-bench abuse: the security review's attacks (abuse_attacks.h),
// each for a bounded time, against one real server process with a memory budget (in a memory
// cgroup of its own where the machine lets us make one), while a victim job
// of another client steps. Reports, per attack, the server's peak RSS
// against its budget, its peak thread count, the victim's median step time
// against its quiet figure, and what the attacker was answered.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/abuse_attacks.h"
#include "bench/benches.h"
#include "bench/common.h"
#include "grpcpp/grpcpp.h"
#include "shardopt/client.h"
#include "shardopt/v1/optimizer.grpc.pb.h"
#include "tools/spawn.h"

namespace shardopt::bench {
namespace {

using Clock = AbuseClock;

constexpr char kVictimToken[] = "victim-token-0123456789abcdef";
constexpr char kAdminToken[] = "admin-token-0123456789abcdef";

// "VmRSS:" or "Threads:" of a process's status, in bytes or as a count.
uint64_t StatusField(pid_t pid, const std::string& key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string k;
  while (in >> k) {
    uint64_t v = 0;
    if (k == key && (in >> v)) return key == "Threads:" ? v : v << 10;
  }
  return 0;
}

// CPU seconds (user + system) a process has used, from /proc/PID/stat.
double CpuSeconds(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  std::getline(in, line);
  // The fields after the command name, which is in parentheses and may hold spaces.
  std::istringstream rest(line.substr(line.rfind(')') + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int i = 3; i <= 15 && (rest >> field); ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
}

// A memory cgroup (v1 or v2) under this process's own, limited to `bytes`;
// empty with the reason when the machine does not let us make one.
struct Cgroup {
  std::string dir;     // where cgroup.procs is
  std::string reason;  // why there is none
  ~Cgroup() {
    if (!dir.empty()) rmdir(dir.c_str());
  }
};

std::unique_ptr<Cgroup> MakeCgroup(uint64_t bytes) {
  auto cg = std::make_unique<Cgroup>();
  std::ifstream in("/proc/self/cgroup");
  std::string line, base, file;
  while (std::getline(in, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty() && std::filesystem::exists("/sys/fs/cgroup/cgroup.controllers")) {
      base = "/sys/fs/cgroup" + (path == "/" ? "" : path);
      file = "memory.max";
    } else if (absl::StrCat(",", controllers, ",").find(",memory,") != std::string::npos) {
      base = "/sys/fs/cgroup/memory" + (path == "/" ? "" : path);
      file = "memory.limit_in_bytes";
      break;
    }
  }
  if (base.empty()) {
    cg->reason = "no memory cgroup controller found in /proc/self/cgroup";
    return cg;
  }
  const std::string dir = absl::StrCat(base, "/shardopt-abuse-", getpid());
  if (mkdir(dir.c_str(), 0755) != 0) {
    cg->reason = absl::StrCat("cannot make ", dir, ": ", strerror(errno));
    return cg;
  }
  std::ofstream(absl::StrCat(dir, "/", file)) << bytes;
  cg->dir = dir;
  return cg;
}

// The server under attack: its own process, joined to the cgroup before it
// execs, so that its default limit and its OOM fate are the cgroup's.
class Server {
 public:
  Server(const std::string& binary, const std::vector<std::string>& flags, const Cgroup& cgroup,
         const std::string& scratch) {
    const std::string port_file = scratch + "/port";
    std::vector<std::string> argv = {binary, "--host=127.0.0.1", "--port=0", "--device=cpu",
                                     "--port_file=" + port_file};
    argv.insert(argv.end(), flags.begin(), flags.end());
    SpawnOptions spawn;
    spawn.stderr_path = scratch + "/server.log";
    if (!cgroup.dir.empty()) spawn.cgroup_procs = cgroup.dir + "/cgroup.procs";
    pid_ = Spawn(argv, spawn);
    for (int i = 0; i < 200 && port_ == 0 && alive(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::ifstream(port_file) >> port_;
    }
  }
  ~Server() {
    if (alive()) kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  bool alive() const { return pid_ > 0 && kill(pid_, 0) == 0 && !Reaped(); }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  pid_t pid() const { return pid_; }
  int port() const { return port_; }

 private:
  bool Reaped() const {
    int status;
    return waitpid(pid_, &status, WNOHANG) == pid_;
  }
  pid_t pid_ = -1;
  int port_ = 0;
};

std::unique_ptr<Client> Connect(const std::string& address, const std::string& token, uint32_t rank = 0) {
  ClientOptions o;
  o.servers = {address};
  o.token = token;
  o.rank = rank;
  o.max_attempts = 1;
  o.rpc_timeout_ms = 30000;
  auto c = Client::Connect(o);
  return c.ok() ? *std::move(c) : nullptr;
}

JobOptions Job(const std::string& name, uint32_t world, const std::vector<std::pair<std::string, uint64_t>>& tensors) {
  JobOptions job;
  job.name = name;
  job.world_size = world;
  job.groups = {GroupOptions{}};
  for (const auto& [n, numel] : tensors) job.tensors.push_back({n, numel, 0});
  job.barrier_timeout_ms = 60000;
  return job;
}

// The victim: one client's job of 256K params, stepping in a loop.
class Victim {
 public:
  explicit Victim(const std::string& address) : client_(Connect(address, kVictimToken)) {
    const JobOptions job = Job("victim/job", 1, {{"w", kParams}});
    if (client_ == nullptr || !client_->CreateOrAttach(job).ok()) return;
    std::vector<float> init(kParams, 0.25f);
    ok_ = client_->InitFp32("w", init.data()).ok();
    grads_.resize(kParams);
    FillGradients(grads_.data(), kParams);
    params_.resize(kParams);
  }
  bool ok() const { return ok_; }
  // One step's seconds, or a negative number if it failed.
  double Step() {
    const auto t0 = Clock::now();
    StepOptions options;
    auto r = client_->Step({{"w", grads_.data()}}, options, {{"w", params_.data()}});
    return r.ok() ? std::chrono::duration<double>(Clock::now() - t0).count() : -1;
  }

 private:
  static constexpr uint64_t kParams = 256 << 10;
  std::unique_ptr<Client> client_;
  std::vector<uint16_t> grads_, params_;
  bool ok_ = false;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

absl::StatusOr<nlohmann::json> AbuseBench(const AbuseArgs& args) {
  char tmpl[] = "/tmp/shardopt-abuse-XXXXXX";
  const std::string scratch = mkdtemp(tmpl);
  std::ofstream(scratch + "/tokens") << "attacker trainer " << kAttackerToken << " attacker/\n"
                                     << "victim trainer " << kVictimToken << " victim/\n"
                                     << "admin admin " << kAdminToken << "\n";
  // The cgroup's limit leaves the server's headroom above its budget.
  const uint64_t cgroup_bytes = args.memory_limit + args.memory_limit / 4 + (uint64_t{128} << 20);
  auto cgroup = MakeCgroup(cgroup_bytes);
  Server server(args.server_binary,
                {absl::StrCat("--memory_limit=", args.memory_limit), "--tokens_file=" + scratch + "/tokens",
                 "--max_streams=1024", "--max_streams_per_client=256", "--idle_stream_timeout_ms=10000",
                 "--barrier_timeout_ms=5000"},
                *cgroup, scratch);
  if (server.port() == 0) {
    return absl::UnavailableError(absl::StrCat("the server did not start; see ", scratch, "/server.log"));
  }
  Victim victim(server.address());
  if (!victim.ok()) return absl::UnavailableError("the victim job could not be made");
  std::vector<double> quiet;
  for (int i = 0; i < 3; ++i) victim.Step();  // warm up
  for (int i = 0; i < 20; ++i) quiet.push_back(victim.Step());
  const double quiet_median = Median(quiet);

  nlohmann::json attacks = nlohmann::json::array();
  for (const Attack& attack : Attacks()) {
    Attacker attacker(server.address());
    Answers answers;
    const uint64_t rss_before = StatusField(server.pid(), "VmRSS:");
    const double cpu_before = CpuSeconds(server.pid()), self_before = CpuSeconds(getpid());
    std::atomic<bool> done{false};
    uint64_t peak_rss = 0, peak_threads = 0;
    std::thread sampler([&] {
      while (!done) {
        peak_rss = std::max(peak_rss, StatusField(server.pid(), "VmRSS:"));
        peak_threads = std::max(peak_threads, StatusField(server.pid(), "Threads:"));
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
    std::vector<double> steps;
    uint64_t failed_steps = 0;
    std::thread stepper([&] {
      while (!done) {
        const double s = victim.Step();
        if (s < 0) {
          ++failed_steps;
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        } else {
          steps.push_back(s);
        }
      }
    });
    const auto until = Clock::now() + std::chrono::seconds(args.seconds);
    attack.run(attacker, answers, until);
    std::this_thread::sleep_until(until);
    done = true;
    stepper.join();
    sampler.join();
    const double median = Median(steps);
    const double server_cpu = CpuSeconds(server.pid()) - cpu_before, bench_cpu = CpuSeconds(getpid()) - self_before;
    attacks.push_back({{"attack", attack.name},
                       {"attacker_calls", answers.calls()},
                       {"answers", answers.Json()},
                       {"server_alive", server.alive()},
                       {"rss_before_bytes", rss_before},
                       {"peak_rss_bytes", peak_rss},
                       {"budget_bytes", args.memory_limit},
                       {"rss_within_budget", peak_rss <= args.memory_limit},
                       {"peak_threads", peak_threads},
                       // Where the 2 cores went: the server's share, and the
                       // bench's own (attacker and victim clients).
                       {"server_cpu_seconds", server_cpu},
                       {"bench_cpu_seconds", bench_cpu},
                       {"victim_steps", steps.size()},
                       {"victim_failed_steps", failed_steps},
                       {"victim_median_step_seconds", median},
                       {"victim_ratio_to_quiet", quiet_median > 0 ? median / quiet_median : 0},
                       {"victim_within_2x", median > 0 && median <= 2 * quiet_median}});
    if (!server.alive()) break;
    // Leave the next attack a server as the last one found it.
    auto admin = v1::Optimizer::NewStub(grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
    for (const std::string& job : attacker.jobs()) {
      grpc::ClientContext ctx;
      ctx.AddMetadata("authorization", absl::StrCat("Bearer ", kAdminToken));
      v1::DropJobRequest req;
      req.set_job(job);
      v1::DropJobResponse resp;
      admin->DropJob(&ctx, req, &resp);
    }
  }
  std::filesystem::remove_all(scratch);
  return nlohmann::json{{"bench", "abuse"},
                        {"seconds_per_attack", args.seconds},
                        {"memory_limit_bytes", args.memory_limit},
                        {"cgroup", cgroup->dir.empty() ? nlohmann::json(absl::StrCat("none: ", cgroup->reason))
                                                       : nlohmann::json(absl::StrCat(cgroup->dir, " limited to ",
                                                                                     cgroup_bytes, " bytes"))},
                        {"victim_quiet_median_step_seconds", quiet_median},
                        {"attacks", attacks}};
}

}  // namespace shardopt::bench
