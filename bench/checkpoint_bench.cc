// `shardopt-bench checkpoint`: a one-server job's checkpoint written and
// restored through JobStore, next to the disk's own sequential write and read
// bandwidth measured in the same run on the same directory. Both sides fsync
// what they write, and both read with the file's pages dropped from the page
// cache first (posix_fadvise DONTNEED after the fsync), so the reads are the
// disk's and not memory's.
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/benches.h"
#include "bench/common.h"
#include "kernels/cpu/cpu_backend.h"
#include "checkpoint/format.h"
#include "server/job_store.h"

namespace shardopt::bench {

namespace {

namespace fs = std::filesystem;

// Drops every file's cached pages under `dir`; they are clean after the
// fsync, so the kernel can let them go without root.
void DropCache(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (!e.is_regular_file()) continue;
    const int fd = open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  }
}

absl::Status WriteDisk(const std::string& path, const std::vector<char>& buffer, uint64_t bytes) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot create ", path));
  for (uint64_t done = 0; done < bytes;) {
    const ssize_t n = write(fd, buffer.data(), std::min<uint64_t>(buffer.size(), bytes - done));
    if (n <= 0) {
      close(fd);
      return absl::InternalError(absl::StrCat("cannot write ", path));
    }
    done += static_cast<uint64_t>(n);
  }
  const bool synced = fsync(fd) == 0;
  close(fd);
  return synced ? absl::OkStatus() : absl::InternalError(absl::StrCat("cannot fsync ", path));
}

absl::Status ReadDisk(const std::string& path, std::vector<char>& buffer) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot open ", path));
  while (read(fd, buffer.data(), buffer.size()) > 0) {
  }
  close(fd);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<nlohmann::json> CheckpointBench(const CheckpointArgs& args) {
  const std::string& dir = args.dir;
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));

  auto backend = MakeCpuBackend({});
  JobStoreOptions options;
  options.checkpoint_dir = dir + "/ckpt";
  options.checkpoint_log = [](const std::string&) {};
  v1::CreateJobRequest job;
  job.set_job("bench");
  job.set_world_size(1);
  v1::Group* group = job.add_groups();
  group->set_beta1(0.9);
  group->set_beta2(0.999);
  group->set_eps(1e-8f);
  v1::TensorSpec* tensor = job.add_tensors();
  tensor->set_name("w");
  tensor->set_numel(args.elements);
  JobStore store(backend.get(), options);
  if (auto r = store.CreateJob(job); !r.ok()) return r.status();
  std::vector<uint16_t> values(std::min<uint64_t>(args.elements, uint64_t{1} << 20));
  FillGradients(values.data(), values.size());
  v1::InitChunk chunk;
  chunk.set_job("bench");
  chunk.set_tensor("w");
  chunk.set_dtype(v1::BF16);
  for (uint64_t off = 0; off < args.elements; off += values.size()) {
    chunk.set_offset(off);
    chunk.set_data(values.data(), std::min<uint64_t>(values.size(), args.elements - off) * 2);
    if (auto st = store.Init(chunk); !st.ok()) return st;
  }

  v1::CheckpointRequest request;
  request.set_job("bench");
  uint64_t part_bytes = 0;
  std::vector<char> buffer(8 << 20, 'x');
  const std::string disk_file = dir + "/sequential";
  auto best = BestOfInterleaved(
      args.reps, {
                 [&]() -> absl::Status {
                   // A complete step is never written twice: start from none,
                   // the removal charged to the checkpoint's own time.
                   fs::remove_all(options.checkpoint_dir);
                   auto r = store.Checkpoint(request);
                   if (!r.ok()) return r.status();
                   part_bytes = r->part_bytes();
                   DropCache(dir);
                   return absl::OkStatus();
                 },
                 [&]() -> absl::Status {
                   JobStore fresh(backend.get(), options);
                   auto r = fresh.CreateJob(job);
                   if (!r.ok()) return r.status();
                   if (!r->restored()) return absl::InternalError("the bench's checkpoint was not restored");
                   DropCache(dir);
                   return absl::OkStatus();
                 },
                 [&]() -> absl::Status {
                   auto st = WriteDisk(disk_file, buffer, part_bytes);
                   DropCache(dir);
                   return st;
                 },
                 [&]() -> absl::Status {
                   auto st = ReadDisk(disk_file, buffer);
                   DropCache(dir);
                   return st;
                 },
             });
  if (!best.ok()) return best.status();
  fs::remove_all(dir, ec);
  const double bytes = static_cast<double>(part_bytes);
  return nlohmann::json{
      {"benchmark", "checkpoint"},
      {"elements", args.elements},
      {"part_bytes", part_bytes},
      {"reps", args.reps},
      {"write_seconds", (*best)[0]},
      {"read_seconds", (*best)[1]},
      {"write_bytes_per_second", bytes / (*best)[0]},
      {"read_bytes_per_second", bytes / (*best)[1]},
      {"disk_write_bytes_per_second", bytes / (*best)[2]},
      {"disk_read_bytes_per_second", bytes / (*best)[3]},
      {"write_fraction_of_disk", (*best)[2] / (*best)[0]},
      {"read_fraction_of_disk", (*best)[3] / (*best)[1]},
  };
}

}  // namespace shardopt::bench
