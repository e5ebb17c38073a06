// The TLS files gRPC reads for new connections, as private copies in memory
// that only ever hold files the server has checked.
//
// gRPC 1.51's file watcher takes whatever it reads: an empty certificate or
// key file aborts the process (an assertion inside gRPC), as a Secret
// rewritten in place by `cp`, which truncates first, can show it for a
// moment; and a key that is not the certificate's fails every new handshake
// until the files are fixed. Pointed at these copies instead, gRPC reads
// only what `ReadTlsFiles` accepted, and a bad new version leaves the last
// good one in use.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "server/watched_files.h"

namespace shardopt {

class TlsCopies {
 public:
  // Copies of `pem` (text `ReadTlsFiles` returned); an empty client CA
  // stays absent. INTERNAL if the kernel will not make them.
  static absl::StatusOr<std::unique_ptr<TlsCopies>> Create(const TlsFiles& pem);
  ~TlsCopies();
  TlsCopies(const TlsCopies&) = delete;
  TlsCopies& operator=(const TlsCopies&) = delete;

  // Where gRPC reads them: /proc/self/fd/N, one name for every version.
  const TlsFiles& paths() const { return paths_; }

  // Puts checked text behind the same names, each copy replaced whole at
  // once, so a reader sees the old file or the new one, never a mix of the
  // two nor an empty one. (The copies are replaced one after another: gRPC
  // reading between the certificate's replacement and the key's, a few
  // microseconds once per renewal, would fail handshakes until its next
  // reading, as any pair of files on disk would.)
  absl::Status Replace(const TlsFiles& pem);

 private:
  TlsCopies() = default;

  // One for each of TlsFiles' members, in its order; -1 for an absent CA.
  int fds_[3] = {-1, -1, -1};
  TlsFiles paths_;
};

}  // namespace shardopt
