#include "server/watched_files.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rpc/tls_files.h"
#include "server/log.h"
#include "server/tls_copies.h"

namespace shardopt {
namespace {

// A PEM file's text; "" for no file. FAILED_PRECONDITION naming the flag if
// it cannot be read or is empty.
absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  if (path.empty()) return "";
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  if (!in || text.str().empty()) {
    return absl::FailedPreconditionError(absl::StrCat("--", flag, "=", path, " cannot be read, or is empty"));
  }
  return text.str();
}

}  // namespace

std::string FileIdentity(const std::string& path) {
  struct stat st;
  if (path.empty() || stat(path.c_str(), &st) != 0) return "";
  return absl::StrCat(st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
}

absl::StatusOr<TlsFiles> ReadTlsFiles(const TlsFiles& paths) {
  TlsFiles pem;
  for (auto [flag, path, text] : {std::tuple{"tls_client_ca", &paths.client_ca, &pem.client_ca},
                                  std::tuple{"tls_cert", &paths.cert, &pem.cert},
                                  std::tuple{"tls_key", &paths.key, &pem.key}}) {
    absl::StatusOr<std::string> read = ReadPem(flag, *path);
    if (!read.ok()) return read.status();
    *text = *std::move(read);
  }
  if (absl::Status usable = CheckTlsFiles(pem.client_ca, pem.cert, pem.key, {"--tls_client_ca", "--tls_cert", "--tls_key"});
      !usable.ok()) {
    return usable;
  }
  return pem;
}

TlsFilesWatch::TlsFilesWatch(TlsFiles paths, unsigned reload_seconds, TlsCopies* copies)
    : paths_(std::move(paths)), reload_seconds_(reload_seconds), copies_(copies) {
  if (reload_seconds_ > 0 && !paths_.cert.empty()) seen_ = Identity();
}

std::string TlsFilesWatch::Identity() const {
  // Never empty, so that an inert watch stays told apart.
  return absl::StrCat(FileIdentity(paths_.client_ca), ";", FileIdentity(paths_.cert), ";", FileIdentity(paths_.key));
}

void TlsFilesWatch::Poll() {
  if (seen_.empty()) return;
  std::string now = Identity();
  if (now == seen_) return;
  seen_ = std::move(now);
  absl::StatusOr<TlsFiles> read = ReadTlsFiles(paths_);
  absl::Status taken = !read.ok() ? read.status() : CheckCertificateDates(read->cert, "--tls_cert");
  if (taken.ok()) taken = copies_->Replace(*read);
  if (taken.ok()) {
    log::Info("tls_reload", {{"result", absl::StrCat("new connections get them within ", reload_seconds_, " s")}});
  } else {
    log::Error("tls_reload", {{"result", "not usable; new connections still get the last usable files"},
                              {"error", std::string(taken.message())}});
  }
}

}  // namespace shardopt
