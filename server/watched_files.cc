#include "server/watched_files.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "rpc/tls_files.h"
#include "server/log.h"
#include "server/metrics.h"
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

void ExportCertificateExpiry(const std::string& cert_pem) {
  if (absl::StatusOr<int64_t> expires = CertificateNotAfter(cert_pem); expires.ok()) {
    metrics::Registry::Default().SetGauge("shardopt_tls_certificate_expiry_timestamp_seconds", {},
                                          static_cast<double>(*expires));
  }
}

std::string TlsFilesIdentity(const TlsFiles& paths) {
  return absl::StrCat(FileIdentity(paths.client_ca), ";", FileIdentity(paths.cert), ";", FileIdentity(paths.key));
}

TlsFilesWatch::TlsFilesWatch(TlsFiles paths, unsigned reload_seconds, TlsCopies* copies, std::string seen)
    : paths_(std::move(paths)), reload_seconds_(reload_seconds), copies_(copies) {
  if (reload_seconds_ > 0 && !paths_.cert.empty()) seen_ = std::move(seen);
}

void TlsFilesWatch::Poll() {
  if (seen_.empty()) return;
  std::string now = TlsFilesIdentity(paths_);
  if (now == seen_ && !(unusable_ && absl::Now() >= check_again_)) return;
  seen_ = std::move(now);
  absl::StatusOr<TlsFiles> read = ReadTlsFiles(paths_);
  absl::Status taken = !read.ok() ? read.status() : CheckCertificateDates(read->cert, "--tls_cert");
  if (taken.ok()) taken = copies_->Replace(*read);
  unusable_ = !taken.ok();
  if (taken.ok()) {
    ExportCertificateExpiry(read->cert);
    log::Info("tls_reload", {{"result", absl::StrCat("new connections get them within ", reload_seconds_, " s")}});
  } else {
    check_again_ = absl::Now() + absl::Seconds(reload_seconds_);
    log::Error("tls_reload", {{"result", absl::StrCat("not usable; new connections still get the last usable files; "
                                                      "checked again in ", reload_seconds_, " s")},
                              {"error", std::string(taken.message())}});
  }
}

}  // namespace shardopt
