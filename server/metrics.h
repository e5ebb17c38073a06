// The server's metrics, in Prometheus's text exposition format (version
// 0.0.4): counters and histograms recorded where things happen, gauges read
// at scrape time. Debian has no Prometheus client library for C++, and the
// format is small. No network here: server/metrics_http.h serves it.
//
// One registry per process, as in Prometheus's own client libraries: the
// protocol core, the reactors and the service record into it without each
// carrying a pointer. Every family is declared in metrics.cc's table, so a
// name recorded here is one documented there (and in the README).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace shardopt::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

// A gauge's value at scrape time.
struct Gauge {
  std::string name;
  Labels labels;
  double value = 0;
};

// One counter series, to add to without a lock or a lookup: what a stream
// records per message holds one (Registry::Series).
class Counter {
 public:
  void Add(double by) {
    double v = value_.load(std::memory_order_relaxed);
    while (!value_.compare_exchange_weak(v, v + by, std::memory_order_relaxed)) {
    }
  }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Registry {
 public:
  static Registry& Default();

  // The counter series of `name` and `labels`, created at 0 if new. It lives
  // as long as the registry: never ask for a series labelled with a job,
  // which ForgetJob removes.
  Counter* Series(absl::string_view name, const Labels& labels) ABSL_LOCKS_EXCLUDED(mu_);

  // Adds to a counter (a family of type counter in the table).
  void Increment(absl::string_view name, const Labels& labels, double by = 1) ABSL_LOCKS_EXCLUDED(mu_);
  // Records one observation of a histogram.
  void Observe(absl::string_view name, const Labels& labels, double value) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops every series labelled job=`job`: a dropped job's series would
  // otherwise stay forever.
  void ForgetJob(const std::string& job) ABSL_LOCKS_EXCLUDED(mu_);

  // Where the gauges come from at each scrape (main sets it once).
  void SetGauges(std::function<std::vector<Gauge>()> gauges) ABSL_LOCKS_EXCLUDED(mu_);
  // A gauge series set where something happens rather than read at scrape
  // time (a start time); ForgetJob removes those labelled with the job.
  void SetGauge(absl::string_view name, const Labels& labels, double value) ABSL_LOCKS_EXCLUDED(mu_);
  // The whole exposition: every family's HELP and TYPE, then its series.
  std::string Render() const ABSL_LOCKS_EXCLUDED(mu_);

  // A counter's value, 0 if never incremented; for tests.
  double CounterValue(absl::string_view name, const Labels& labels) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Histogram {
    std::vector<uint64_t> buckets;  // per upper bound, not cumulative
    uint64_t count = 0;
    double sum = 0;
  };
  mutable absl::Mutex mu_;
  // By family, then by the rendered label set.
  std::map<std::string, std::map<std::string, Counter>> counters_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::map<std::string, Histogram>> histograms_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::map<std::string, double>> set_gauges_ ABSL_GUARDED_BY(mu_);
  std::function<std::vector<Gauge>()> gauges_ ABSL_GUARDED_BY(mu_);
};

// {a="x",b="y"}, values escaped as the format asks; empty for no labels.
std::string RenderLabels(const Labels& labels);

}  // namespace shardopt::metrics
