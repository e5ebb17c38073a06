// Loading a complete checkpoint (format.h's LoadInto and LoadWholeJob): the
// same placement's part streamed as it lies on disk, or another placement's
// state gathered from the parts that cover it.
#include <cstring>
#include <filesystem>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "checkpoint/catalog.h"
#include "checkpoint/files.h"
#include "checkpoint/format.h"

namespace shardopt::checkpoint {

namespace {

// The manifest a load of `spec` from `committed` answers with: the job's
// step and last commit, and, where a part has this very placement, that
// part's sections, its sealed push's sums and its job's life (which are per
// server; on another placement the trainers attach anew, to a new life).
v1::PartManifest LoadedManifest(const Committed& committed, const v1::CreateJobRequest& spec, const PartHead* same) {
  v1::PartManifest m;
  *m.mutable_spec() = spec;
  m.set_step(committed.marker.step());
  *m.mutable_applied() = committed.parts.front().manifest.applied();
  if (same != nullptr) {
    m.set_sealed_step(same->manifest.sealed_step());
    m.set_sealed_sum_squares(same->manifest.sealed_sum_squares());
    m.set_sealed_nonfinite(same->manifest.sealed_nonfinite());
    m.set_incarnation(same->manifest.incarnation());
    m.set_array_alignment(same->manifest.array_alignment());  // the data is the part's as it lies
    *m.mutable_shards() = same->manifest.shards();
  }
  return m;
}

const PartHead* SamePlacement(const Committed& committed, const v1::CreateJobRequest& spec) {
  for (const PartHead& p : committed.parts) {
    if (SameShards(p.manifest.spec(), spec)) return &p;
  }
  return nullptr;
}

// Where `spec`'s placement comes from in a complete checkpoint of another
// placement: its manifest, and for each of the checkpoint's parts the runs
// of its data that land in the placement's data, read from no data at all.
struct Plan {
  struct Run {
    uint64_t from = 0;   // in the source part's data
    uint64_t to = 0;     // in the placement's data
    uint64_t bytes = 0;  // whole elements
  };
  v1::PartManifest manifest;
  std::vector<std::vector<Run>> runs;  // [committed.parts' index], sorted by `from`, disjoint
};

absl::StatusOr<Plan> PlanPlacement(const Committed& committed, const v1::CreateJobRequest& spec) {
  Plan plan;
  plan.manifest = LoadedManifest(committed, spec, nullptr);
  v1::PartManifest& m = plan.manifest;
  for (const v1::ShardRange& s : spec.shards()) {
    const int t = TensorIndex(spec, s.tensor());
    v1::ShardSection* section = m.add_shards();
    section->set_dtype(spec.groups(spec.tensors(t).group()).precision() == v1::PRECISION_BF16 ? v1::BF16 : v1::FP32);
  }
  const std::vector<uint64_t> to_sections = SectionOffsets(m);
  std::vector<uint64_t> filled(spec.shards_size(), 0);
  std::vector<bool> step_known(spec.shards_size(), false);
  plan.runs.resize(committed.parts.size());
  for (size_t pi = 0; pi < committed.parts.size(); ++pi) {
    const PartHead& p = committed.parts[pi];
    const v1::PartManifest& src = p.manifest;
    const std::vector<uint64_t> from_sections = SectionOffsets(src);
    for (int ss = 0; ss < src.shards_size(); ++ss) {
      const v1::ShardRange& from = src.spec().shards(ss);
      for (int ds = 0; ds < spec.shards_size(); ++ds) {
        const v1::ShardRange& to = spec.shards(ds);
        const uint64_t begin = std::max(from.offset(), to.offset());
        const uint64_t end = std::min(from.offset() + from.length(), to.offset() + to.length());
        if (from.tensor() != to.tensor() || begin >= end) continue;
        if (src.shards(ss).dtype() != m.shards(ds).dtype()) {
          return absl::DataLossError(absl::StrCat(p.path, " holds tensor '", from.tensor(), "' as ",
                                                  v1::DType_Name(src.shards(ss).dtype()), ", its group asks for ",
                                                  v1::DType_Name(m.shards(ds).dtype())));
        }
        if (step_known[ds] && m.shards(ds).adam_step() != src.shards(ss).adam_step()) {
          return absl::DataLossError(absl::StrCat(p.path, ": tensor '", from.tensor(), "' has Adam step ",
                                                  src.shards(ss).adam_step(), " here and ", m.shards(ds).adam_step(),
                                                  " in another part"));
        }
        m.mutable_shards(ds)->set_adam_step(src.shards(ss).adam_step());
        step_known[ds] = true;
        const uint64_t esize = ElementBytes(src.shards(ss).dtype());
        for (Array a : kArrays) {
          plan.runs[pi].push_back({ArrayOffset(from_sections, src, ss, a) + (begin - from.offset()) * esize,
                                   ArrayOffset(to_sections, m, ds, a) + (begin - to.offset()) * esize,
                                   (end - begin) * esize});
        }
        filled[ds] += end - begin;
      }
    }
    std::sort(plan.runs[pi].begin(), plan.runs[pi].end(),
              [](const Plan::Run& a, const Plan::Run& b) { return a.from < b.from; });
  }
  for (int ds = 0; ds < spec.shards_size(); ++ds) {
    if (filled[ds] != spec.shards(ds).length()) {
      return absl::DataLossError(absl::StrCat(committed.dir, ": the parts do not cover tensor '",
                                              spec.shards(ds).tensor(), "' from element ", spec.shards(ds).offset()));
    }
  }
  return plan;
}

// Streams each part that the plan reads from, whole, so that its checksum
// is checked, and hands `sink` the bytes of its runs at their places in the
// placement's data: nothing but the reads' buffers is held, whatever the
// parts' sizes.
absl::Status StreamPlan(const Committed& committed, const Plan& plan, const DataSink& sink) {
  for (size_t pi = 0; pi < committed.parts.size(); ++pi) {
    const std::vector<Plan::Run>& runs = plan.runs[pi];
    if (runs.empty()) continue;
    size_t first = 0;  // the first run that does not end before the piece
    SHARDOPT_RETURN_IF_ERROR(
        StreamPartData(committed.parts[pi], [&](uint64_t at, const char* bytes, size_t n) -> absl::Status {
          while (first < runs.size() && runs[first].from + runs[first].bytes <= at) ++first;
          for (size_t r = first; r < runs.size() && runs[r].from < at + n; ++r) {
            const uint64_t begin = std::max(at, runs[r].from), end = std::min(at + n, runs[r].from + runs[r].bytes);
            SHARDOPT_RETURN_IF_ERROR(sink(runs[r].to + (begin - runs[r].from), bytes + (begin - at), end - begin));
          }
          return absl::OkStatus();
        }));
  }
  return absl::OkStatus();
}

// Whose value a restore's configuration differences show first.
constexpr absl::string_view kAskedAndSaved = "this call's -> the checkpoint's";

// The asked job against every part, not the first alone: parts may differ
// in whether they give shapes (servers whose jobs were made by clients that
// did and did not), and each compares shapes only where both give them.
absl::Status SameJobAsEveryPart(const v1::CreateJobRequest& spec, const Committed& committed) {
  for (const PartHead& part : committed.parts) {
    SHARDOPT_RETURN_IF_ERROR(SameJob(spec, part.manifest.spec(), committed.dir, kAskedAndSaved));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// The state of `spec`'s placement from the complete checkpoint `committed`.
absl::StatusOr<Part> LoadCommitted(const Committed& committed, const v1::CreateJobRequest& spec) {
  SHARDOPT_RETURN_IF_ERROR(SameJobAsEveryPart(spec, committed));
  Part out;
  if (const PartHead* same = SamePlacement(committed, spec)) {
    out.manifest = LoadedManifest(committed, spec, same);
    SHARDOPT_ASSIGN_OR_RETURN(out.data, ReadPartData(*same));
    return out;
  }
  SHARDOPT_ASSIGN_OR_RETURN(Plan plan, PlanPlacement(committed, spec));
  out.data.resize(SectionOffsets(plan.manifest).back());
  SHARDOPT_RETURN_IF_ERROR(StreamPlan(committed, plan, [&](uint64_t offset, const char* bytes, size_t n) {
    std::memcpy(out.data.data() + offset, bytes, n);
    return absl::OkStatus();
  }));
  out.manifest = std::move(plan.manifest);
  return out;
}

}  // namespace

namespace {

absl::StatusOr<v1::PartManifest> StreamSame(const Committed& committed, const v1::CreateJobRequest& spec,
                                            const PartHead& same,
                                            const std::function<absl::Status(const v1::PartManifest&)>& begin,
                                            const DataSink& sink, const DirectDestination& direct) {
  v1::PartManifest manifest = LoadedManifest(committed, spec, &same);
  SHARDOPT_RETURN_IF_ERROR(begin(manifest));
  SHARDOPT_RETURN_IF_ERROR(StreamPartData(same, sink, direct));
  return manifest;
}

}  // namespace

absl::StatusOr<v1::PartManifest> LoadOwnPart(const std::string& root, const v1::CreateJobRequest& spec, uint64_t step,
                                             uint64_t life, const std::function<absl::Status(const v1::PartManifest&)>& begin,
                                             const DataSink& sink, const DirectDestination& direct) {
  Committed own;
  own.dir = StepDirectory(root, spec.job(), step);
  const std::string path = absl::StrCat(own.dir, "/", PartName(spec));
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat("no part of this server's placement of step ", step, " (", path, ")"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto head, ReadPartHead(path));
  if (head.manifest.incarnation() != life || head.manifest.step() != step || !SameShards(head.manifest.spec(), spec)) {
    return absl::NotFoundError(absl::StrCat(path, " is not this placement's part of step ", step, " of life ", life,
                                            " (another run's, or another placement's)"));
  }
  own.marker.set_step(step);
  own.parts.push_back(std::move(head));
  SHARDOPT_RETURN_IF_ERROR(SameJobAsEveryPart(spec, own));
  return StreamSame(own, spec, own.parts.front(), begin, sink, direct);
}

absl::StatusOr<v1::PartManifest> LoadInto(const std::string& root, const v1::CreateJobRequest& spec, uint64_t step,
                                          const Log& log,
                                          const std::function<absl::Status(const v1::PartManifest&)>& begin,
                                          const DataSink& sink, const DirectDestination& direct) {
  SHARDOPT_ASSIGN_OR_RETURN(auto committed, FindCommitted(root, spec.job(), step, log));
  SHARDOPT_RETURN_IF_ERROR(SameJobAsEveryPart(spec, committed));
  // The same placement, as on a plain restart: the part's data is the answer
  // as it lies on disk, streamed.
  if (const PartHead* same = SamePlacement(committed, spec)) return StreamSame(committed, spec, *same, begin, sink, direct);
  SHARDOPT_ASSIGN_OR_RETURN(Plan plan, PlanPlacement(committed, spec));
  SHARDOPT_RETURN_IF_ERROR(begin(plan.manifest));
  SHARDOPT_RETURN_IF_ERROR(StreamPlan(committed, plan, sink));
  return plan.manifest;
}

absl::StatusOr<WholeJob> LoadWholeJob(const std::string& root, const std::string& job, uint64_t step,
                                      const Log& log) {
  // Found once: a second look for the newest could find another step (one
  // completed meanwhile), and would say again why it passed over a torn one.
  SHARDOPT_ASSIGN_OR_RETURN(auto committed, FindCommitted(root, job, step, log));
  WholeJob out;
  out.step = committed.marker.step();
  out.spec = committed.parts.front().manifest.spec();
  out.spec.clear_shards();
  // Each tensor's shape from any part that gives one (see SameJobAsEveryPart).
  for (const PartHead& part : committed.parts) {
    const v1::CreateJobRequest& theirs = part.manifest.spec();
    for (int i = 0; i < out.spec.tensors_size() && i < theirs.tensors_size(); ++i) {
      if (out.spec.tensors(i).shape_size() == 0) *out.spec.mutable_tensors(i)->mutable_shape() = theirs.tensors(i).shape();
    }
  }
  for (const v1::TensorSpec& t : out.spec.tensors()) {
    v1::ShardRange* s = out.spec.add_shards();
    s->set_tensor(t.name());
    s->set_offset(0);
    s->set_length(t.numel());
  }
  SHARDOPT_ASSIGN_OR_RETURN(out.part, LoadCommitted(committed, out.spec));
  return out;
}

}  // namespace shardopt::checkpoint
