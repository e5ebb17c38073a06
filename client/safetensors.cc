#include "shardopt/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string_view>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "base/whole_file.h"
#include "nlohmann/json.hpp"

namespace shardopt {

namespace {

uint64_t ElementBytes(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

// What ReadSafetensors (and torch) take back: a name given once, not the
// header's reserved key, a known dtype, and data that is its shape exactly.
absl::Status CheckWritable(const std::vector<SafetensorsTensor>& tensors) {
  std::set<std::string> names;
  for (const SafetensorsTensor& t : tensors) {
    // The reserved key: a tensor of that name would overwrite the metadata,
    // or be read back as it, and torch could not load the file.
    if (t.name == "__metadata__") {
      return absl::InvalidArgumentError("a tensor named __metadata__ cannot be written to safetensors");
    }
    // A JSON object keeps one entry of a name: the file would hold the data
    // of both and describe one.
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' is given twice"));
    }
    if (ElementBytes(t.dtype) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name, "' has dtype '", t.dtype, "', which safetensors does not know"));
    }
    // Elements first, as the reader counts them: a shape past 2^64 elements
    // is refused even if a later dimension is 0.
    uint64_t elements = 1, bytes = 0;
    bool overflow = false;
    for (uint64_t d : t.shape) overflow |= __builtin_mul_overflow(elements, d, &elements);
    overflow |= __builtin_mul_overflow(elements, ElementBytes(t.dtype), &bytes);
    if (overflow || bytes != t.data.size()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': ", t.data.size(),
                                                     " bytes are not its shape of ", t.dtype));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  if (absl::Status st = CheckWritable(tensors); !st.ok()) return st;
  nlohmann::ordered_json header = nlohmann::ordered_json::object();  // `{}` with nothing in it, not `null`
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // the format pads the header with spaces to 8 bytes
  // A regular file (or none yet) is written beside and renamed over, after
  // an fsync: a failure (a full disk) leaves the file that was there, not
  // half of a new one. A symlink's existing target is replaced so, the link
  // kept. Anything else (a FIFO, /dev/stdout, a dangling link, which has no
  // old file to keep) is written in place, through any link.
  std::error_code ec;
  std::string target = path;
  const bool link = std::filesystem::is_symlink(std::filesystem::symlink_status(path, ec));
  const auto kind = std::filesystem::status(path, ec).type();  // through the links
  if (link && kind == std::filesystem::file_type::regular) {
    target = std::filesystem::canonical(path, ec).string();
    if (ec) return ErrnoStatus(ec.value(), absl::StrCat("cannot write ", path));
  }
  const bool replace = kind == std::filesystem::file_type::regular || (!link && kind == std::filesystem::file_type::not_found);
  const uint64_t n = json.size();
  char length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>(n >> (8 * i));
  std::vector<std::string_view> pieces = {{length, 8}, json};
  for (const SafetensorsTensor& t : tensors) pieces.push_back(t.data);
  if (replace) return WriteFileWhole(target, pieces);
  const int fd = open(target.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  int error = fd < 0 ? errno : WriteAll(fd, pieces);
  if (fd >= 0 && close(fd) != 0 && error == 0) error = errno;
  if (error != 0) return ErrnoStatus(error, absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SafetensorsTensor>> ReadSafetensors(const std::string& path,
                                                               std::map<std::string, std::string>* metadata) {
  // The whole file is read: a directory reads as empty, and a device
  // (/dev/zero) or a pipe has no end to read to, and would take all memory
  // or wait for good. (A path that cannot be looked at fails to open below.)
  std::error_code ec;
  if (const auto kind = std::filesystem::status(path, ec).type(); !ec && kind != std::filesystem::file_type::regular) {
    return absl::InvalidArgumentError(absl::StrCat(path, kind == std::filesystem::file_type::directory
                                                             ? " is a directory, not a safetensors file"
                                                             : " is not a regular file, as a safetensors file is"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto bad = [&](const std::string& why) { return absl::InvalidArgumentError(absl::StrCat(path, ": ", why)); };
  if (bytes.size() < 8) return bad("shorter than its 8-byte header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  if (n > bytes.size() - 8) return bad(absl::StrCat("header of ", n, " bytes does not fit in the file"));
  // JSON keeps the last of two equal keys; a header naming a tensor twice
  // is refused, naming it, as Python's reader does (its data would else be
  // told as a gap).
  std::set<std::string> top_keys;
  std::string repeated;
  const nlohmann::json::parser_callback_t note_keys = [&](int depth, nlohmann::json::parse_event_t event,
                                                          nlohmann::json& parsed) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && !top_keys.insert(parsed.get<std::string>()).second &&
        repeated.empty()) {
      repeated = parsed.get<std::string>();
    }
    return true;
  };
  // JSON holds no raw NUL; nlohmann's parser would take one as the end of
  // its input, and so accept a header padded with NULs that Python's refuses.
  if (std::memchr(bytes.data() + 8, '\0', n) != nullptr) {
    return bad("the header holds a NUL byte (JSON has none; the format pads with spaces)");
  }
  const nlohmann::json header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(n),
                                                      note_keys, /*allow_exceptions=*/false);
  if (!header.is_object()) return bad("header is not a JSON object");
  if (!repeated.empty()) return bad(absl::StrCat("the header names '", repeated, "' twice"));
  std::map<std::string, std::string> found;  // __metadata__, given to the caller once the file is read whole
  if (header.contains("__metadata__")) {
    const nlohmann::json& entries = header["__metadata__"];
    if (!entries.is_object()) return bad("__metadata__ must map text to text");
    for (const auto& [key, value] : entries.items()) {
      if (!value.is_string()) return bad("__metadata__ must map text to text");
      found[key] = value.get<std::string>();
    }
  }
  const uint64_t base = 8 + n;
  std::vector<SafetensorsTensor> out;
  // Each tensor's data and name, to check that they tile the file.
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    SafetensorsTensor t;
    t.name = name;
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() || !entry.contains("shape") ||
        !entry["shape"].is_array() || !entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2) {
      return bad(absl::StrCat("entry '", name, "' lacks dtype, shape or data_offsets"));
    }
    t.dtype = entry["dtype"].get<std::string>();
    uint64_t elements = 1;
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_unsigned()) return bad(absl::StrCat("entry '", name, "' has a bad shape"));
      t.shape.push_back(d.get<uint64_t>());
      if (__builtin_mul_overflow(elements, t.shape.back(), &elements)) {
        return bad(absl::StrCat("entry '", name, "' has a shape past 2^64 elements"));
      }
    }
    const auto& offsets = entry["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
      return bad(absl::StrCat("entry '", name, "' has bad data_offsets"));
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end) {
      return bad(absl::StrCat("entry '", name, "' has data_offsets [", begin, ", ", end, "), which end before they begin"));
    }
    if (end > bytes.size() - base) {
      return bad(absl::StrCat("entry '", name, "' has data_offsets [", begin, ", ", end, "), past the ",
                              bytes.size() - base, " bytes of data the file holds"));
    }
    if (ElementBytes(t.dtype) == 0) {
      return bad(absl::StrCat("entry '", name, "' has dtype '", t.dtype, "', which this reader does not know"));
    }
    uint64_t data_bytes = 0;
    if (__builtin_mul_overflow(elements, ElementBytes(t.dtype), &data_bytes) || end - begin != data_bytes) {
      return bad(absl::StrCat("entry '", name, "': ", end - begin, " bytes do not hold its shape of ", t.dtype));
    }
    t.data = bytes.substr(base + begin, end - begin);
    ranges.emplace_back(begin, end, name);
    out.push_back(std::move(t));
  }
  // The format's data is the tensors' bytes back to back: no overlap, no
  // gap, nothing after.
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (const auto& [begin, end, name] : ranges) {
    if (begin != at) {
      return bad(absl::StrCat("the data of tensor '", name, "' begins at byte ", begin, ", ",
                              begin < at ? "inside the tensor before it" : "after a gap", " (the format's data is "
                              "the tensors' bytes back to back)"));
    }
    at = end;
  }
  if (at != bytes.size() - base) return bad(absl::StrCat(bytes.size() - base - at, " bytes after the last tensor's data"));
  if (metadata != nullptr) *metadata = std::move(found);
  return out;
}

}  // namespace shardopt
