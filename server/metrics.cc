#include "server/metrics.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/shortest_number.h"

namespace shardopt::metrics {
namespace {

enum class Type { kCounter, kGauge, kHistogram };

struct Family {
  const char* name;
  Type type;
  const char* help;
  std::vector<double> buckets;  // histograms only: upper bounds
};

// Seconds from 1 ms to a minute: a step's phases on a small job are
// milliseconds, a large job's or a checkpoint's seconds.
const std::vector<double> kSeconds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
// A checkpoint part of a server's whole state: the manifests budget up to
// about 100 s (CPU) and 250 s (GPU) for one.
const std::vector<double> kCheckpointSeconds = {0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600};

// Every family the server exports. Names follow Prometheus's conventions:
// shardopt_ prefix, base units, _total for counters.
const std::vector<Family>& Families() {
  static const auto* families = new std::vector<Family>{
      {"shardopt_build_info", Type::kGauge, "Always 1; the labels say the version and the device.", {}},
      // Prometheus's own name for it, as its client libraries export it.
      {"process_start_time_seconds", Type::kGauge, "When the server started, in seconds since the Unix epoch.", {}},
      {"process_open_fds", Type::kGauge, "File descriptors open now: each connection holds one.", {}},
      {"process_max_fds", Type::kGauge, "The open-file limit (RLIMIT_NOFILE's soft one, raised to the hard one at start).", {}},
      {"shardopt_jobs", Type::kGauge, "Jobs held by this server.", {}},
      {"shardopt_open_streams", Type::kGauge, "Push, Init, Commit and Read streams open now.", {}},
      {"shardopt_memory_budget_bytes", Type::kGauge, "The server's memory budget (--memory_limit).", {}},
      {"shardopt_memory_used_bytes", Type::kGauge, "Bytes charged against the memory budget now.", {}},
      {"shardopt_job_state_bytes", Type::kGauge, "A job's master, m and v on this server.", {}},
      {"shardopt_job_staging_bytes", Type::kGauge, "A job's running sum, params out and window cap on this server.", {}},
      {"shardopt_job_step", Type::kGauge, "A job's last step done.", {}},
      {"shardopt_tenant_job_bytes", Type::kGauge,
       "What the jobs a caller made hold on this server (state, staging and bookkeeping, as its max_memory counts "
       "them), by tenant: the tokens file's name (with --tokens_file only).",
       {}},
      {"shardopt_tenant_max_memory_bytes", Type::kGauge,
       "A token's cap on what the jobs it makes may hold on this server (max_memory in the tokens file), by tenant.",
       {}},
      {"shardopt_job_created_timestamp_seconds", Type::kGauge,
       "When this server made or restored the job (its per-job counters start then), seconds since the Unix epoch.",
       {}},
      {"shardopt_tls_certificate_expiry_timestamp_seconds", Type::kGauge,
       "When the certificate new connections get (--tls_cert's first) expires, seconds since the Unix epoch; "
       "TLS only.",
       {}},
      {"shardopt_device_memory_bytes", Type::kGauge, "CUDA device memory, by state=free|total (CUDA backend only).", {}},
      {"shardopt_received_bytes_total", Type::kCounter, "Bytes of Push and Init messages received, by method.", {}},
      {"shardopt_sent_bytes_total", Type::kCounter, "Bytes of Commit params and Read state sent, by method.", {}},
      {"shardopt_pushes_total", Type::kCounter, "Push streams answered OK, by job.", {}},
      {"shardopt_commits_total", Type::kCounter, "Steps applied (or skipped) by a commit, by job.", {}},
      {"shardopt_skipped_steps_total", Type::kCounter, "Steps committed with skip (nonfinite gradients), by job.", {}},
      {"shardopt_refusals_total", Type::kCounter, "Calls answered with an error, by method and gRPC code.", {}},
      {"shardopt_checkpoint_bytes_total", Type::kCounter, "Bytes of checkpoint parts, by direction=write|restore.", {}},
      {"shardopt_checkpoints_total", Type::kCounter, "Checkpoints of a job this server finished (its part written, or the step complete already), by job.", {}},
      {"shardopt_checkpoint_failures_total", Type::kCounter,
       "Checkpoints of a job that began on this server and failed (a Checkpoint call's or the drain's), by job.", {}},
      {"shardopt_push_wait_seconds", Type::kHistogram,
       "Per step, the first rank's push ending to the barrier's seal: the wait for the slowest rank.", kSeconds},
      {"shardopt_apply_seconds", Type::kHistogram, "Per step, AdamW over every piece.", kSeconds},
      {"shardopt_params_stream_seconds", Type::kHistogram,
       "Per step, the first commit's params streamed, from its start to its last chunk.", kSeconds},
      {"shardopt_checkpoint_seconds", Type::kHistogram, "One checkpoint part, by direction=write|restore.",
       kCheckpointSeconds},
  };
  return *families;
}

const Family* Find(absl::string_view name) {
  for (const Family& f : Families()) {
    if (name == f.name) return &f;
  }
  return nullptr;
}

std::string Escape(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  // Every bit: 6 digits would turn a byte counter past a million into a
  // staircase for rate(), and %.17g would turn le="0.1" into
  // le="0.10000000000000001", renaming the buckets' series.
  return ShortestNumber(v);
}

// `rendered` ({...} or empty) with one more label.
std::string WithLabel(const std::string& rendered, const std::string& key, const std::string& value) {
  const std::string more = absl::StrCat(key, "=\"", value, "\"");
  if (rendered.empty()) return absl::StrCat("{", more, "}");
  return absl::StrCat(rendered.substr(0, rendered.size() - 1), ",", more, "}");
}

}  // namespace

std::string RenderLabels(const Labels& labels) {
  if (labels.empty()) return "";
  std::string out = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", labels[i].first, "=\"", Escape(labels[i].second), "\"");
  }
  return out + "}";
}

Registry& Registry::Default() {
  static auto* registry = new Registry;
  return *registry;
}

Counter* Registry::Series(absl::string_view name, const Labels& labels) {
  absl::MutexLock lock(&mu_);
  return &counters_[std::string(name)][RenderLabels(labels)];  // map nodes do not move
}

void Registry::Increment(absl::string_view name, const Labels& labels, double by) { Series(name, labels)->Add(by); }

void Registry::Observe(absl::string_view name, const Labels& labels, double value) {
  const Family* f = Find(name);
  if (f == nullptr) return;
  absl::MutexLock lock(&mu_);
  Histogram& h = histograms_[std::string(name)][RenderLabels(labels)];
  h.buckets.resize(f->buckets.size());
  for (size_t i = 0; i < f->buckets.size(); ++i) {
    if (value <= f->buckets[i]) {
      ++h.buckets[i];
      break;
    }
  }
  ++h.count;
  h.sum += value;
}

void Registry::ForgetJob(const std::string& job) {
  const std::string needle = absl::StrCat("job=\"", Escape(job), "\"");
  absl::MutexLock lock(&mu_);
  const auto forget = [&](auto& families) {
    for (auto& [name, series] : families) {
      for (auto it = series.begin(); it != series.end();) {
        it = it->first.find(needle) != std::string::npos ? series.erase(it) : std::next(it);
      }
    }
  };
  forget(counters_);
  forget(histograms_);
  forget(set_gauges_);
}

void Registry::SetGauge(absl::string_view name, const Labels& labels, double value) {
  absl::MutexLock lock(&mu_);
  set_gauges_[std::string(name)][RenderLabels(labels)] = value;
}

void Registry::SetGauges(std::function<std::vector<Gauge>()> gauges) {
  absl::MutexLock lock(&mu_);
  gauges_ = std::move(gauges);
}

double Registry::CounterValue(absl::string_view name, const Labels& labels) const {
  absl::MutexLock lock(&mu_);
  auto f = counters_.find(std::string(name));
  if (f == counters_.end()) return 0;
  auto s = f->second.find(RenderLabels(labels));
  return s == f->second.end() ? 0 : s->second.value();
}

std::string Registry::Render() const {
  std::function<std::vector<Gauge>()> source;
  {
    absl::MutexLock lock(&mu_);
    source = gauges_;
  }
  // Outside the lock: the gauges read the store, which records into us.
  const std::vector<Gauge> gauges = source ? source() : std::vector<Gauge>{};
  absl::MutexLock lock(&mu_);
  std::string out;
  for (const Family& f : Families()) {
    absl::StrAppend(&out, "# HELP ", f.name, " ", f.help, "\n# TYPE ", f.name, " ",
                    f.type == Type::kCounter ? "counter" : f.type == Type::kGauge ? "gauge" : "histogram", "\n");
    if (f.type == Type::kGauge) {
      for (const Gauge& g : gauges) {
        if (g.name == f.name) absl::StrAppend(&out, f.name, RenderLabels(g.labels), " ", Number(g.value), "\n");
      }
      if (auto it = set_gauges_.find(f.name); it != set_gauges_.end()) {
        for (const auto& [labels, v] : it->second) absl::StrAppend(&out, f.name, labels, " ", Number(v), "\n");
      }
    } else if (f.type == Type::kCounter) {
      if (auto it = counters_.find(f.name); it != counters_.end()) {
        for (const auto& [labels, c] : it->second) absl::StrAppend(&out, f.name, labels, " ", Number(c.value()), "\n");
      }
    } else if (auto it = histograms_.find(f.name); it != histograms_.end()) {
      for (const auto& [labels, h] : it->second) {
        uint64_t cumulative = 0;
        for (size_t i = 0; i < f.buckets.size(); ++i) {
          cumulative += h.buckets[i];
          absl::StrAppend(&out, f.name, "_bucket", WithLabel(labels, "le", Number(f.buckets[i])), " ", cumulative, "\n");
        }
        absl::StrAppend(&out, f.name, "_bucket", WithLabel(labels, "le", "+Inf"), " ", h.count, "\n");
        absl::StrAppend(&out, f.name, "_sum", labels, " ", Number(h.sum), "\n");
        absl::StrAppend(&out, f.name, "_count", labels, " ", h.count, "\n");
      }
    }
  }
  return out;
}

}  // namespace shardopt::metrics
