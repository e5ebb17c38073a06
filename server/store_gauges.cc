#include "server/store_gauges.h"

#include "absl/strings/str_cat.h"
#include "kernels/gpu.h"
#include "server/open_files.h"
#include "tools/flags.h"

namespace shardopt {

std::vector<metrics::Gauge> StoreGauges(JobStore& store, const Backend& backend, const std::string& device,
                                        uint32_t open_streams, const Authenticator* auth) {
  std::vector<metrics::Gauge> g;
  g.push_back({"shardopt_build_info", {{"version", Version()}, {"device", device}}, 1});
  // Every job as ListJobs summarizes it, page after page: sizes and step,
  // without Describe's groups and tensors.
  std::vector<v1::JobSummary> jobs;
  v1::ListJobsRequest pages;
  for (;;) {
    v1::ListJobsResponse page = store.ListJobs(pages, [](const std::string&) { return true; });
    for (v1::JobSummary& job : *page.mutable_jobs()) jobs.push_back(std::move(job));
    if (!page.more() || jobs.empty()) break;
    pages.set_after(jobs.back().job());
  }
  g.push_back({"shardopt_jobs", {}, static_cast<double>(jobs.size())});
  g.push_back({"shardopt_open_streams", {}, static_cast<double>(open_streams)});
  g.push_back({"process_open_fds", {}, static_cast<double>(OpenFiles())});
  g.push_back({"process_max_fds", {}, static_cast<double>(OpenFileLimit())});
  g.push_back({"shardopt_memory_budget_bytes", {}, static_cast<double>(store.budget()->limit())});
  g.push_back({"shardopt_memory_used_bytes", {}, static_cast<double>(store.budget()->used())});
  if (auto memory = CudaDeviceMemory(backend); memory.ok()) {
    g.push_back({"shardopt_device_memory_bytes", {{"state", "free"}}, static_cast<double>(memory->free)});
    g.push_back({"shardopt_device_memory_bytes", {{"state", "total"}}, static_cast<double>(memory->total)});
  }
  for (const v1::JobSummary& job : jobs) {
    g.push_back({"shardopt_job_state_bytes", {{"job", job.job()}}, static_cast<double>(job.state_bytes())});
    g.push_back({"shardopt_job_staging_bytes", {{"job", job.job()}}, static_cast<double>(job.staging_bytes())});
    g.push_back({"shardopt_job_step", {{"job", job.job()}}, static_cast<double>(job.step())});
  }
  for (const auto& [tenant, bytes] : store.TenantBytes()) {
    g.push_back({"shardopt_tenant_job_bytes", {{"tenant", tenant}}, static_cast<double>(bytes)});
  }
  if (auth != nullptr) {
    for (const auto& [tenant, bytes] : auth->MaxMemory()) {
      g.push_back({"shardopt_tenant_max_memory_bytes", {{"tenant", tenant}}, static_cast<double>(bytes)});
    }
  }
  return g;
}

}  // namespace shardopt
