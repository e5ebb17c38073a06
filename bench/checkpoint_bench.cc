// `shardopt-bench checkpoint`: a one-server job's checkpoint written and
// restored through JobStore, next to the disk's own sequential write and read
// bandwidth measured in the same run on the same directory, each both through
// the page cache and with O_DIRECT, in 8 MiB calls from a huge-page buffer
// (checkpoint::AllocateAligned; with 4 KiB pages, pinning them cost the
// disk's O_DIRECT figures a third to a half here); the fractions are
// against the faster.
// Every write is fsynced, and every read starts with the file's pages
// dropped from the page cache (posix_fadvise DONTNEED after the fsync), so
// the reads are the disk's and not memory's. A third read, with O_DIRECT into
// freshly mapped memory, shows what a restore's new state adds to the disk.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/benches.h"
#include "bench/common.h"
#include "kernels/cpu/cpu_backend.h"
#include "checkpoint/direct_io.h"
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

// The disk's own sequential write, fsynced: through the page cache, or with
// O_DIRECT from an aligned buffer (`buffer` is one).
absl::Status WriteDisk(const std::string& path, const char* buffer, size_t buffer_bytes, uint64_t bytes, bool direct) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | (direct ? O_DIRECT : 0), 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot create ", path));
  for (uint64_t done = 0; done < bytes;) {
    const uint64_t want = std::min<uint64_t>(buffer_bytes, bytes - done);
    // O_DIRECT writes whole blocks: the last one a block longer at most.
    const ssize_t n = write(fd, buffer, direct ? (want + 4095) / 4096 * 4096 : want);
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

// The disk's own sequential read of a file whose pages were dropped: with
// the kernel's readahead, or with O_DIRECT into an aligned buffer.
absl::Status ReadDisk(const std::string& path, char* buffer, size_t buffer_bytes, bool direct) {
  const int fd = open(path.c_str(), O_RDONLY | (direct ? O_DIRECT : 0));
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot open ", path));
  while (read(fd, buffer, buffer_bytes) > 0) {
  }
  close(fd);
  return absl::OkStatus();
}

// The disk's own sequential read with O_DIRECT into fresh memory, mapped
// as the CPU backend maps a job's state (huge pages where granted) and
// unmapped after, as a restore gets and a timed restore frees its job's:
// what any restore into a new job costs on this machine. A mapping of its
// own, not checkpoint::AllocateAligned: malloc may hand back memory it
// already faulted in.
absl::Status ReadDiskIntoFreshMemory(const std::string& path, uint64_t bytes) {
  const size_t mapped = (bytes + checkpoint::kDirectChunkBytes - 1) / checkpoint::kDirectChunkBytes *
                        checkpoint::kDirectChunkBytes;
  void* memory = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) return absl::ResourceExhaustedError(absl::StrCat("cannot map ", mapped, " bytes"));
  madvise(memory, mapped, MADV_HUGEPAGE);
  const int fd = open(path.c_str(), O_RDONLY | O_DIRECT);
  absl::Status status = fd < 0 ? absl::InternalError(absl::StrCat("cannot open ", path)) : absl::OkStatus();
  for (size_t at = 0; status.ok() && at < mapped; at += checkpoint::kDirectChunkBytes) {
    const ssize_t n = pread(fd, static_cast<char*>(memory) + at, checkpoint::kDirectChunkBytes, static_cast<off_t>(at));
    if (n < 0) status = absl::InternalError(absl::StrCat("cannot read ", path));
    if (n < static_cast<ssize_t>(checkpoint::kDirectChunkBytes)) break;  // the end of the file
  }
  if (fd >= 0) close(fd);
  munmap(memory, mapped);
  return status;
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
  const size_t buffer_bytes = checkpoint::kDirectChunkBytes;
  checkpoint::AlignedBytes buffer = checkpoint::AllocateAligned(buffer_bytes);
  std::memset(buffer.get(), 'x', buffer_bytes);
  const std::string disk_file = dir + "/sequential";
  // The disk's own sequential write and read of the part's size, through
  // the page cache or with O_DIRECT, each leaving the cache cold.
  auto write_disk = [&](bool direct) {
    return [&, direct]() -> absl::Status {
      auto st = WriteDisk(disk_file, buffer.get(), buffer_bytes, part_bytes, direct);
      DropCache(dir);
      return st;
    };
  };
  auto read_disk = [&](bool direct) {
    return [&, direct]() -> absl::Status {
      auto st = ReadDisk(disk_file, buffer.get(), buffer_bytes, direct);
      DropCache(dir);
      return st;
    };
  };
  // Untimed, after each file's last use: every timed write makes a new
  // file, as a checkpoint of a new step does, rather than first freeing the
  // blocks of the last one (18-32 ms for 96 MiB on an ext4 mounted with
  // `discard`), and the sync leaves no deferred work to the next run.
  auto remove = [](const std::string& path) {
    return [path]() -> absl::Status {
      std::error_code ec;
      fs::remove_all(path, ec);
      sync();
      return ec ? absl::InternalError(absl::StrCat("cannot remove ", path, ": ", ec.message())) : absl::OkStatus();
    };
  };
  auto best = BestOfInterleaved(
      args.reps, {
                 [&]() -> absl::Status {
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
                 remove(options.checkpoint_dir),
                 write_disk(false),
                 read_disk(false),
                 remove(disk_file),
                 write_disk(true),
                 read_disk(true),
                 [&]() -> absl::Status {
                   auto st = ReadDiskIntoFreshMemory(disk_file, part_bytes);
                   DropCache(dir);
                   return st;
                 },
                 remove(disk_file),
             });
  if (!best.ok()) return best.status();
  fs::remove_all(dir, ec);
  const double bytes = static_cast<double>(part_bytes);
  // Each fraction is against the faster of the disk's two ways.
  const double write_buffered = (*best)[3], read_buffered = (*best)[4];
  const double write_direct = (*best)[6], read_direct = (*best)[7];
  const double disk_write = std::min(write_buffered, write_direct), disk_read = std::min(read_buffered, read_direct);
  const double read_fresh = (*best)[8];
  return nlohmann::json{
      {"benchmark", "checkpoint"},
      {"elements", args.elements},
      {"part_bytes", part_bytes},
      {"reps", args.reps},
      {"write_seconds", (*best)[0]},
      {"read_seconds", (*best)[1]},
      {"write_bytes_per_second", bytes / (*best)[0]},
      {"read_bytes_per_second", bytes / (*best)[1]},
      {"disk_write_bytes_per_second", bytes / disk_write},
      {"disk_read_bytes_per_second", bytes / disk_read},
      {"disk_write_buffered_bytes_per_second", bytes / write_buffered},
      {"disk_read_buffered_bytes_per_second", bytes / read_buffered},
      {"disk_write_direct_bytes_per_second", bytes / write_direct},
      {"disk_read_direct_bytes_per_second", bytes / read_direct},
      {"write_fraction_of_disk", disk_write / (*best)[0]},
      {"read_fraction_of_disk", disk_read / (*best)[1]},
      // Not the target's figure, which is the disk's: what reading into
      // memory that must first be faulted in adds, as a restore's does.
      {"disk_read_into_fresh_memory_bytes_per_second", bytes / read_fresh},
      {"read_fraction_of_disk_into_fresh_memory", read_fresh / (*best)[1]},
  };
}

}  // namespace shardopt::bench
