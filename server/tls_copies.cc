#include "server/tls_copies.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace shardopt {
namespace {

absl::Status Errno(const char* what) { return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno))); }

// A new in-memory file holding `text`, or -1 with errno set.
int MemoryFile(const std::string& text) {
  const int fd = memfd_create("shardopt-tls", MFD_CLOEXEC);
  if (fd < 0) return -1;
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int saved = errno == 0 ? EIO : errno;
      close(fd);
      errno = saved;
      return -1;
    }
    done += static_cast<size_t>(n);
  }
  return fd;
}

// The three texts in TlsFiles' order.
const std::string* Texts(const TlsFiles& pem, int i) {
  const std::string* texts[] = {&pem.client_ca, &pem.cert, &pem.key};
  return texts[i];
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsCopies>> TlsCopies::Create(const TlsFiles& pem) {
  std::unique_ptr<TlsCopies> copies(new TlsCopies);
  std::string* paths[] = {&copies->paths_.client_ca, &copies->paths_.cert, &copies->paths_.key};
  for (int i = 0; i < 3; ++i) {
    if (Texts(pem, i)->empty()) continue;
    copies->fds_[i] = MemoryFile(*Texts(pem, i));
    if (copies->fds_[i] < 0) return Errno("memfd_create for a TLS file");
    *paths[i] = absl::StrCat("/proc/self/fd/", copies->fds_[i]);
  }
  return copies;
}

TlsCopies::~TlsCopies() {
  for (int fd : fds_) {
    if (fd >= 0) close(fd);
  }
}

absl::Status TlsCopies::Replace(const TlsFiles& pem) {
  // Every new copy made before any is swapped in: a failure leaves all
  // three as they were, never a new certificate with the old key.
  int fresh[3] = {-1, -1, -1};
  const auto close_fresh = [&] {
    for (int fd : fresh) {
      if (fd >= 0) close(fd);
    }
  };
  for (int i = 0; i < 3; ++i) {
    if (fds_[i] < 0) continue;  // no --tls_client_ca
    fresh[i] = MemoryFile(*Texts(pem, i));
    if (fresh[i] < 0) {
      const absl::Status failed = Errno("memfd_create for a TLS file");
      close_fresh();
      return failed;
    }
  }
  for (int i = 0; i < 3; ++i) {
    // dup3 swaps the file behind the number at once: a reader opening
    // /proc/self/fd/N gets the whole old file or the whole new one. (It
    // does not fail for a valid, open pair of descriptors.)
    if (fresh[i] >= 0 && dup3(fresh[i], fds_[i], O_CLOEXEC) < 0) {
      const absl::Status failed = Errno("dup3 of a TLS file");
      close_fresh();
      return failed;
    }
  }
  close_fresh();
  return absl::OkStatus();
}

}  // namespace shardopt
