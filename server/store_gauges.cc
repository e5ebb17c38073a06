#include "server/store_gauges.h"

#include "absl/strings/str_cat.h"
#include "kernels/gpu.h"
#include "tools/flags.h"

namespace shardopt {

std::vector<metrics::Gauge> StoreGauges(JobStore& store, const Backend& backend, const std::string& device,
                                        uint32_t open_streams, const Authenticator* auth) {
  std::vector<metrics::Gauge> g;
  g.push_back({"shardopt_build_info", {{"version", Version()}, {"device", device}}, 1});
  const std::vector<std::string> jobs = store.JobNames();
  g.push_back({"shardopt_jobs", {}, static_cast<double>(jobs.size())});
  g.push_back({"shardopt_open_streams", {}, static_cast<double>(open_streams)});
  g.push_back({"shardopt_memory_budget_bytes", {}, static_cast<double>(store.budget()->limit())});
  g.push_back({"shardopt_memory_used_bytes", {}, static_cast<double>(store.budget()->used())});
  if (auto memory = CudaDeviceMemory(backend); memory.ok()) {
    g.push_back({"shardopt_device_memory_bytes", {{"state", "free"}}, static_cast<double>(memory->free)});
    g.push_back({"shardopt_device_memory_bytes", {{"state", "total"}}, static_cast<double>(memory->total)});
  }
  for (const std::string& job : jobs) {
    v1::DescribeRequest req;
    req.set_job(job);
    req.set_max_tensors(1);  // the sizes, not the tensors
    auto d = store.Describe(req);
    if (!d.ok()) continue;  // dropped meanwhile
    g.push_back({"shardopt_job_state_bytes", {{"job", job}}, static_cast<double>(d->state_bytes())});
    g.push_back({"shardopt_job_staging_bytes", {{"job", job}}, static_cast<double>(d->staging_bytes())});
    g.push_back({"shardopt_job_step", {{"job", job}}, static_cast<double>(d->step())});
  }
  for (const auto& [tenant, bytes] : store.TenantBytes()) {
    // Jobs made without tokens (or by the store itself) have no tenant.
    if (!tenant.empty()) g.push_back({"shardopt_tenant_job_bytes", {{"tenant", tenant}}, static_cast<double>(bytes)});
  }
  if (auth != nullptr) {
    for (const auto& [tenant, bytes] : auth->MaxMemory()) {
      g.push_back({"shardopt_tenant_max_memory_bytes", {{"tenant", tenant}}, static_cast<double>(bytes)});
    }
  }
  return g;
}

}  // namespace shardopt
