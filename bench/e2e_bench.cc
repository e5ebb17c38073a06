// `shardopt-bench e2e`: whole steps through a real server and client, against
// the ceilings of moving the same bytes (docs/design.md, section 10.2):
// 2 B/param each way, through a tuned bare gRPC echo and a plain TCP echo.
// Server, client and echoes share one process, so each pays for the same two
// cores.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "bench/benches.h"
#include "bench/common.h"
#include "bench/echo.h"
#include "server/device.h"
#include "server/job_store.h"
#include "server/service.h"
#include "shardopt/client.h"
#include "rpc/grpc_edge.h"

namespace shardopt::bench {

namespace {
constexpr uint64_t kBytesPerParam = 2;  // bf16 gradients up, bf16 params down
// The echoes are the ceilings, so they move the bytes in the messages that
// moved them fastest here: 1 MiB (0.10 s for 64M params, against 0.12 s
// at 256 KiB and 0.12-0.15 s at 2 and 4 MiB).
constexpr uint64_t kEchoChunkBytes = uint64_t{1} << 20;
}  // namespace

absl::StatusOr<nlohmann::json> E2eBench(const E2eArgs& args) {
  TuneAllocatorForStreaming();  // the process holds the echoes too, not only the client
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);  // as the server does (server/main.cc)

  // S servers and W worker clients, all in this process: one step is every
  // worker pushing the whole model (split over the servers) and reading it
  // back, as in plain parameter-server aggregation.
  const std::string device = args.cuda_device < 0 ? "cpu" : absl::StrCat("cuda:", args.cuda_device);
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<std::unique_ptr<JobStore>> stores;
  std::vector<std::unique_ptr<RunningServer>> running;
  ClientOptions client_options;
  if (args.chunk_bytes > 0) client_options.chunk_bytes = args.chunk_bytes;  // else the client's choice
  for (uint64_t s = 0; s < args.servers; ++s) {
    auto backend = MakeBackend(device, static_cast<int>(args.threads));
    if (!backend.ok()) return backend.status();
    backends.push_back(*std::move(backend));
    stores.push_back(std::make_unique<JobStore>(backends.back().get()));
    ServerOptions server_options;
    server_options.address = "127.0.0.1:0";
    auto server = StartServer(stores.back().get(), server_options);
    if (!server.ok()) return server.status();
    client_options.servers.push_back(absl::StrCat("127.0.0.1:", (*server)->port));
    running.push_back(*std::move(server));
  }
  JobOptions job;
  job.name = "bench";
  job.world_size = static_cast<uint32_t>(args.workers);
  job.groups = {GroupOptions{}};
  for (uint64_t i = 0; i < args.tensors; ++i) {
    const uint64_t numel = args.params / args.tensors + (i + 1 == args.tensors ? args.params % args.tensors : 0);
    job.tensors.push_back({absl::StrCat("t", i), numel});
  }
  std::vector<std::unique_ptr<Client>> clients;
  for (uint64_t w = 0; w < args.workers; ++w) {
    client_options.rank = static_cast<uint32_t>(w);
    auto client = Client::Connect(client_options);
    if (!client.ok()) return client.status();
    if (auto st = (*client)->CreateOrAttach(job); !st.ok()) return st.status();
    clients.push_back(*std::move(client));
  }
  auto& client = clients.front();

  const uint64_t bytes = args.params * kBytesPerParam;
  std::vector<uint16_t> grads(args.params);
  std::vector<uint16_t> bf16_params(args.params);
  FillGradients(grads.data(), grads.size());
  std::vector<GradView> grad_views;
  std::vector<ParamView> param_views;
  uint64_t offset = 0;
  for (const TensorOptions& t : job.tensors) {
    grad_views.push_back({t.name, grads.data() + offset});
    param_views.push_back({t.name, bf16_params.data() + offset});
    if (auto st = client->InitBf16(t.name, bf16_params.data() + offset); !st.ok()) return st;
    offset += t.numel;
  }

  auto grpc_echo = GrpcEcho::Start();
  if (!grpc_echo.ok()) return grpc_echo.status();
  auto tcp_echo = TcpEcho::Start();
  if (!tcp_echo.ok()) return tcp_echo.status();
  const char* src = reinterpret_cast<const char*>(grads.data());
  std::vector<char> grpc_dst(bytes), tcp_dst(bytes), relay_dst(bytes);

  StepOptions step_options;
  uint64_t phased_step = 0;
  Decision decision;
  // Every worker sends the same gradient: the bytes on the wire are what
  // counts here, not their values.
  auto step_all = [&]() -> absl::Status {
    std::vector<absl::Status> results(clients.size());
    std::vector<std::thread> threads;
    for (size_t w = 1; w < clients.size(); ++w) {
      threads.emplace_back([&, w] { results[w] = clients[w]->Step(grad_views, step_options, {}).status(); });
    }
    results[0] = client->Step(grad_views, step_options, param_views).status();
    for (auto& t : threads) t.join();
    for (const absl::Status& st : results) {
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  };
  std::vector<double> cpu;
  auto best = BestOfInterleaved(
      args.steps, {
                  step_all,
                  // The same step again in its phases, which run back to back,
                  // to show where a step's time goes.
                  // With one worker only: with more, a lone push waits at the barrier.
                  [&] {
                    if (clients.size() > 1) return absl::OkStatus();
                    phased_step = client->step() + 1;
                    auto push = client->Push(phased_step, grad_views);
                    if (!push.ok()) return push.status();
                    decision = Decide(*push, job.world_size, step_options);
                    return absl::OkStatus();
                  },
                  [&] {
                    if (clients.size() > 1) return absl::OkStatus();
                    return client->Commit(phased_step, step_options.lr, decision.gscale, decision.skip,
                                             param_views);
                  },
                  [&] { return (*grpc_echo)->Run(src, grpc_dst.data(), bytes, kEchoChunkBytes); },
                  [&] { return (*tcp_echo)->Run(src, tcp_dst.data(), bytes, kEchoChunkBytes); },
                  [&] { return (*grpc_echo)->Relay(src, relay_dst.data(), bytes, kEchoChunkBytes); },
              },
      &cpu);
  if (!best.ok()) return best.status();
  if (std::memcmp(grpc_dst.data(), src, bytes) != 0 || std::memcmp(tcp_dst.data(), src, bytes) != 0 ||
      std::memcmp(relay_dst.data(), src, bytes) != 0) {
    return absl::DataLossError("an echo returned different bytes");
  }
  const double step_seconds = (*best)[0];
  const double echo_seconds = (*best)[3];
  const double tcp_seconds = (*best)[4];
  const double relay_seconds = (*best)[5];
  const double n = static_cast<double>(args.params);
  // The step's ceiling on one machine whose cores both move the bytes and
  // run the update: the echo of the same bytes, then the kernel over the
  // same elements (each worker's bytes, every server's update).
  auto kernel = KernelBench({args.params, args.threads, args.cuda_device, std::max<uint64_t>(args.steps, 3)});
  if (!kernel.ok()) return kernel.status();
  const double kernel_seconds = (*kernel)["update_seconds"].get<double>();
  const double ceiling = echo_seconds * static_cast<double>(args.workers) + kernel_seconds;
  // A step cannot overlap its two directions as the echo does: no param
  // goes out before every gradient is in. The relay moves the same bytes in
  // that order, so this ceiling is one the protocol can reach.
  const double sequential_ceiling = relay_seconds * static_cast<double>(args.workers) + kernel_seconds;
  // Server 0's phases of the last step (a phased one when W = 1).
  auto phases = stores.front()->LastStepPhases(job.name);
  if (!phases.ok()) return phases.status();
  return nlohmann::json{
      {"benchmark", "e2e"},
      {"device", backends.front()->Describe()},
      {"servers", args.servers},
      {"workers", args.workers},
      {"params", args.params},
      {"tensors", args.tensors},
      {"chunk_bytes", client->chunk_bytes()},
      {"echo_chunk_bytes", kEchoChunkBytes},
      {"bytes_each_way", bytes},
      {"steps", args.steps},
      {"step_seconds", step_seconds},
      {"push_seconds", clients.size() > 1 ? nlohmann::json() : nlohmann::json((*best)[1])},
      {"commit_seconds", clients.size() > 1 ? nlohmann::json() : nlohmann::json((*best)[2])},
      // CPU time of the whole process (client, server, gRPC) in the same
      // runs: on 2 cores, what the step costs beyond moving its bytes.
      {"cpu_seconds",
       {{"step", cpu[0]},
        {"push", clients.size() > 1 ? nlohmann::json() : nlohmann::json(cpu[1])},
        {"commit", clients.size() > 1 ? nlohmann::json() : nlohmann::json(cpu[2])},
        {"echo", cpu[3]},
        {"relay", cpu[5]}}},
      // Every worker's gradient up and params down, over all links.
      {"wire_bytes_per_step", bytes * 2 * args.workers},
      {"wire_bytes_per_second", static_cast<double>(bytes * 2 * args.workers) / step_seconds},
      {"echo_seconds", echo_seconds},
      {"tcp_echo_seconds", tcp_seconds},
      {"params_per_second", n / step_seconds},
      {"echo_params_per_second", n / echo_seconds},
      {"tcp_echo_params_per_second", n / tcp_seconds},
      // The echoes move one worker's bytes; a step moves every worker's.
      {"fraction_of_echo", echo_seconds * static_cast<double>(args.workers) / step_seconds},
      {"fraction_of_tcp", tcp_seconds * static_cast<double>(args.workers) / step_seconds},
      {"kernel_seconds", kernel_seconds},
      {"serial_ceiling_seconds", ceiling},
      {"fraction_of_serial_ceiling", ceiling / step_seconds},
      {"relay_seconds", relay_seconds},
      {"sequential_ceiling_seconds", sequential_ceiling},
      {"fraction_of_sequential_ceiling", sequential_ceiling / step_seconds},
      {"server_phases_seconds",
       {{"push", phases->push},
        {"reduce_in_push", phases->reduce},
        {"barrier", phases->barrier},
        {"norm", phases->norm},
        {"apply", phases->apply},
        {"params_streamed", phases->params}}},
  };
}

}  // namespace shardopt::bench
