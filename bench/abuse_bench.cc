// shardopt-bench abuse: the security review's attacks, each for a bounded
// time, against one real server process with a memory budget (in a memory
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
#include <sstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/benches.h"
#include "bench/common.h"
#include "client/wire.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "shardopt/client.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace shardopt::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kAttackerToken[] = "attacker-token-0123456789abcdef";
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
    const std::string procs = cgroup.dir.empty() ? "" : cgroup.dir + "/cgroup.procs";
    const std::string log = scratch + "/server.log";
    pid_ = fork();
    if (pid_ == 0) {
      if (!procs.empty()) std::ofstream(procs) << getpid();
      if (freopen(log.c_str(), "w", stderr) == nullptr) _exit(126);
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
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

// What the attacker was answered, by gRPC code name.
class Answers {
 public:
  void Add(const grpc::Status& st) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[st.ok() ? "OK" : CodeName(st.error_code())];
    ++calls_;
  }
  nlohmann::json Json() const {
    std::lock_guard<std::mutex> lock(mu_);
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [code, n] : counts_) j[code] = n;
    return j;
  }
  uint64_t calls() const {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }

 private:
  static std::string CodeName(grpc::StatusCode c) {
    switch (c) {
      case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
      case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
      case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
      case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
      case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
      case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
      case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
      case grpc::StatusCode::CANCELLED: return "CANCELLED";
      case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
      default: return absl::StrCat("code ", static_cast<int>(c));
    }
  }
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> counts_;
  uint64_t calls_ = 0;
};

// The attacker's raw calls, each with its token and a deadline.
class Attacker {
 public:
  explicit Attacker(const std::string& address)
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        stub_(v1::Optimizer::NewStub(channel_)) {}
  std::unique_ptr<grpc::ClientContext> Context(int seconds = 10) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->AddMetadata("authorization", absl::StrCat("Bearer ", kAttackerToken));
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
    return ctx;
  }
  v1::Optimizer::Stub& stub() { return *stub_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Optimizer::Stub> stub_;
};

v1::CreateJobRequest CreateRequest(const std::string& name, uint32_t world, uint64_t tensors, uint64_t numel) {
  v1::CreateJobRequest r;
  r.set_job(name);
  r.set_world_size(world);
  v1::Group* g = r.add_groups();
  g->set_beta1(0.9);
  g->set_beta2(0.999);
  g->set_eps(1e-8f);
  for (uint64_t i = 0; i < tensors; ++i) {
    v1::TensorSpec* t = r.add_tensors();
    t->set_name(absl::StrCat("t", i));
    t->set_numel(numel);
  }
  return r;
}

// Runs `attack` on `threads` threads until `until`, each calling it in a loop.
void Loop(int threads, Clock::time_point until, const std::function<void(int)>& attack) {
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      while (Clock::now() < until) attack(t);
    });
  }
  for (auto& th : pool) th.join();
}

// Gives job `name` (one tensor "t0" of `numel`) its initial values, so that
// pushes to it get past their first checks.
void InitJob(Attacker& a, const std::string& name, uint64_t numel) {
  auto ctx = a.Context();
  v1::InitResponse resp;
  auto w = a.stub().Init(ctx.get(), &resp);
  v1::InitChunk c;
  c.set_job(name);
  c.set_tensor("t0");
  c.set_dtype(v1::FP32);
  c.set_kind(v1::MASTER);
  const std::vector<float> values(numel, 1.0f);
  c.set_data(values.data(), values.size() * 4);
  w->Write(c);
  w->WritesDone();
  w->Finish();
}

// The six attacks of the review. Each runs until `until`.
void NoGradFlood(Attacker& a, Answers& answers, Clock::time_point until) {
  // A push stream whose chunks name 60,000 tensors the job lacks, 100
  // characters each (6 MB a message): each is refused at its first name.
  v1::CreateJobResponse created;
  answers.Add(a.stub().CreateJob(a.Context().get(), CreateRequest("attacker/nograd", 1, 1, 8), &created));
  InitJob(a, "attacker/nograd", 8);
  v1::GradChunk names;
  names.set_job("attacker/nograd");
  names.set_step(1);
  for (int i = 0; i < 60000; ++i) names.add_no_grad(absl::StrCat(i, std::string(94, 'x')).substr(0, 100));
  Loop(1, until, [&](int) {
    auto ctx = a.Context(30);
    v1::PushResponse resp;
    auto w = a.stub().Push(ctx.get(), &resp);
    for (int m = 0; m < 20 && w->Write(names); ++m) {
    }
    w->WritesDone();
    answers.Add(w->Finish());
  });
}

void BarrierTracking(Attacker& a, Answers& answers, Clock::time_point until) {
  // world_size 65536, 2000 one-element tensors; ranks push one element each
  // and wait at the barrier, listing the rest as no_grad.
  v1::CreateJobResponse created;
  answers.Add(a.stub().CreateJob(a.Context().get(), CreateRequest("attacker/wide", 65536, 2000, 1), &created));
  for (int i = 0; i < 2000; ++i) {
    auto ctx = a.Context();
    v1::InitResponse resp;
    auto w = a.stub().Init(ctx.get(), &resp);
    v1::InitChunk c;
    c.set_job("attacker/wide");
    c.set_tensor(absl::StrCat("t", i));
    c.set_dtype(v1::FP32);
    c.set_kind(v1::MASTER);
    const float one = 1;
    c.set_data(&one, 4);
    w->Write(c);
    w->WritesDone();
    w->Finish();
  }
  // Each rank finishes its push and then goes away: a finished rank stays in
  // the round until its barrier deadline, with its tracking.
  std::atomic<uint32_t> next_rank{0};
  Loop(16, until, [&](int) {
    const uint32_t rank = next_rank++ % 65536;
    auto ctx = a.Context(1);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    v1::PushResponse resp;
    auto w = a.stub().Push(ctx.get(), &resp);
    v1::GradChunk c;
    c.set_job("attacker/wide");
    c.set_step(1);
    c.set_rank(rank);
    c.set_tensor("t0");
    c.set_dtype(v1::BF16);
    const uint16_t g = 0x3f80;
    c.set_data(&g, 2);
    for (int i = 1; i < 2000; ++i) c.add_no_grad(absl::StrCat("t", i));
    w->Write(c);
    w->WritesDone();
    answers.Add(w->Finish());
  });
}

void MemoryFill(Attacker& a, Answers& answers, Clock::time_point until, std::vector<std::string>* made) {
  // One tensor of 1.2e9 elements, then jobs of 16M params until refused.
  v1::CreateJobResponse created;
  answers.Add(a.stub().CreateJob(a.Context().get(), CreateRequest("attacker/huge", 1, 1, 1200000000), &created));
  for (int i = 0; Clock::now() < until; ++i) {
    const std::string name = absl::StrCat("attacker/fill", i);
    const grpc::Status st = a.stub().CreateJob(a.Context().get(), CreateRequest(name, 1, 1, 16 << 20), &created);
    answers.Add(st);
    if (!st.ok()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    made->push_back(name);
    // Touch the master so its pages are real.
    auto ctx = a.Context(60);
    v1::InitResponse resp;
    auto w = a.stub().Init(ctx.get(), &resp);
    std::vector<float> values(1 << 20, 0.5f);
    v1::InitChunk c;
    c.set_job(name);
    c.set_tensor("t0");
    c.set_dtype(v1::FP32);
    c.set_kind(v1::MASTER);
    for (uint64_t off = 0; off < (16 << 20) && Clock::now() < until; off += 1 << 20) {
      c.set_offset(off);
      c.set_data(values.data(), values.size() * 4);
      if (!w->Write(c)) break;
    }
    w->WritesDone();
    answers.Add(w->Finish());
  }
}

void HeldStreams(Attacker& a, Answers& answers, Clock::time_point until) {
  // Push and Init streams opened and never finished, as many as it can.
  struct Held {
    std::unique_ptr<grpc::ClientContext> ctx;
    v1::PushResponse push;
    v1::InitResponse init;
    std::unique_ptr<grpc::ClientWriter<v1::GradChunk>> pusher;
    std::unique_ptr<grpc::ClientWriter<v1::InitChunk>> initer;
  };
  std::vector<std::unique_ptr<Held>> held;
  for (int i = 0; i < 1500 && Clock::now() < until; ++i) {
    auto h = std::make_unique<Held>();
    h->ctx = a.Context();
    h->ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(1));
    if (i % 2 == 0) {
      h->pusher = a.stub().Push(h->ctx.get(), &h->push);
    } else {
      h->initer = a.stub().Init(h->ctx.get(), &h->init);
    }
    held.push_back(std::move(h));
  }
  std::this_thread::sleep_until(until);
  // The streams past the caps were refused at once; the ones held are
  // cancelled half a second later. Newest first: those are the refused.
  std::thread cancel([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    for (auto& h : held) h->ctx->TryCancel();
  });
  for (auto it = held.rbegin(); it != held.rend(); ++it) {
    answers.Add((*it)->pusher ? (*it)->pusher->Finish() : (*it)->initer->Finish());
  }
  cancel.join();
}

void Amplification(Attacker& a, Answers& answers, Clock::time_point until) {
  // CreateJob of 600K one-element tensors (6.5 MB): refused by the cap.
  const v1::CreateJobRequest wide = CreateRequest("attacker/amplify", 1, 600000, 1);
  Loop(1, until, [&](int) {
    v1::CreateJobResponse created;
    answers.Add(a.stub().CreateJob(a.Context(30).get(), wide, &created));
  });
}

void TruncatedStreams(Attacker& a, Answers& answers, Clock::time_point until) {
  // Init streams with an unparseable message after a good one: raw bytes,
  // so that no serializer tidies them up.
  grpc::GenericStub generic(a.channel());
  v1::CreateJobResponse created;
  answers.Add(a.stub().CreateJob(a.Context().get(), CreateRequest("attacker/cut", 1, 1, 8), &created));
  v1::InitChunk c;
  c.set_job("attacker/cut");
  c.set_tensor("t0");
  c.set_dtype(v1::FP32);
  c.set_kind(v1::MASTER);
  const float four[4] = {1, 2, 3, 4};
  c.set_data(four, sizeof four);
  const std::string good = c.SerializeAsString();
  const std::string garbage("\x0a\xff\xff\xff\xff\x0f", 6);  // a length past the message's end
  Loop(1, until, [&](int) {
    auto ctx = a.Context();
    wire::Stream stream(&generic, ctx.get(), "/shardopt.v1.Optimizer/Init");
    for (const std::string* m : {&good, &garbage}) {
      grpc::Slice slice(*m);
      stream.Write(grpc::ByteBuffer(&slice, 1));
    }
    stream.WritesDone();
    answers.Add(stream.Finish());
  });
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
  std::vector<std::string> filled;
  const std::vector<std::pair<std::string, std::function<void(Attacker&, Answers&, Clock::time_point)>>> plan = {
      {"no_grad_flood", NoGradFlood},
      {"barrier_tracking", BarrierTracking},
      {"memory_fill", [&](Attacker& a, Answers& n, Clock::time_point u) { MemoryFill(a, n, u, &filled); }},
      {"held_streams", HeldStreams},
      {"amplification", Amplification},
      {"truncated_streams", TruncatedStreams},
  };
  for (const auto& [name, attack] : plan) {
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
    attack(attacker, answers, until);
    std::this_thread::sleep_until(until);
    done = true;
    stepper.join();
    sampler.join();
    const double median = Median(steps);
    const double server_cpu = CpuSeconds(server.pid()) - cpu_before, bench_cpu = CpuSeconds(getpid()) - self_before;
    attacks.push_back({{"attack", name},
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
    for (const std::string& job : {std::string("attacker/nograd"), std::string("attacker/wide"),
                                   std::string("attacker/cut")}) {
      filled.push_back(job);
    }
    for (const std::string& job : filled) {
      grpc::ClientContext ctx;
      ctx.AddMetadata("authorization", absl::StrCat("Bearer ", kAdminToken));
      v1::DropJobRequest req;
      req.set_job(job);
      v1::DropJobResponse resp;
      admin->DropJob(&ctx, req, &resp);
    }
    filled.clear();
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
