// TLS and mutual TLS over real server processes, with certificates made by
// the openssl command for each run: who can reach a TLS server, who a
// mutual-TLS one, the refusal of plaintext on a non-loopback address, and
// IPv6 loopback.
#include <algorithm>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <chrono>
#include <thread>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shardopt/client.h"
#include "tests/testing/client_helpers.h"
#include "tests/testing/reference.h"
#include "tests/testing/server_process.h"

namespace shardopt {
namespace {

using testing::ReadText;
using testing::ServerProcess;

// A CA, a server certificate for 127.0.0.1 and a client certificate it
// signed, and a second, unrelated CA with a client certificate of its own.
class Certificates {
 public:
  Certificates() {
    char tmpl[] = "/tmp/shardopt-tls-XXXXXX";
    dir_ = mkdtemp(tmpl);
    // The wildcards as README's "Deploying on Kubernetes" says of them:
    // one covers the pods' names with their namespace, the other none.
    std::ofstream(dir_ + "/server.ext") << "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:*.shardopt.default,"
                                           "DNS:*.shardopt\n";
    std::ofstream(dir_ + "/client.ext") << "extendedKeyUsage=clientAuth\n";
    const std::string key = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    ok_ = Run(absl::StrCat("openssl req -x509 ", key, " -keyout ca.key -out ca.pem -days 2 -subj /CN=shardopt-test-ca")) &&
          Run(absl::StrCat("openssl req -x509 ", key, " -keyout rogue.key -out rogue.pem -days 2 -subj /CN=rogue-ca")) &&
          Sign("server", "ca") && Sign("client", "ca") && Sign("stranger", "rogue");
  }
  ~Certificates() { std::filesystem::remove_all(dir_); }

  bool ok() const { return ok_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string pem(const std::string& name) const { return ReadText(path(name)); }

 private:
  bool Run(const std::string& command) {
    return std::system(absl::StrCat("cd ", dir_, " && ", command, " >/dev/null 2>&1").c_str()) == 0;
  }
  bool Sign(const std::string& who, const std::string& ca) {
    const std::string ext = who == "server" ? "server.ext" : "client.ext";
    return Run(absl::StrCat("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ", who,
                            ".key -out ", who, ".csr -subj /CN=", who)) &&
           Run(absl::StrCat("openssl x509 -req -in ", who, ".csr -CA ", ca, ".pem -CAkey ", ca, ".key -CAcreateserial",
                            " -days 2 -extfile ", ext, " -out ", who, ".pem"));
  }

  std::string dir_;
  bool ok_ = false;
};

// A server of the certificates' server.pem, asking every client for a
// certificate their CA signed (mutual TLS).
std::unique_ptr<ServerProcess> StartMutualTls(const Certificates& certs) {
  return ServerProcess::Start({"--tls_cert=" + certs.path("server.pem"), "--tls_key=" + certs.path("server.key"),
                               "--tls_client_ca=" + certs.path("ca.pem")});
}

// Connects with `options`' TLS settings and runs one whole step.
absl::Status StepOnce(const std::string& address, ClientOptions options, const std::string& job_name) {
  options.servers = {address};
  options.max_attempts = 1;
  options.rpc_timeout_ms = 10000;
  auto client = Client::Connect(options);
  if (!client.ok()) return client.status();
  const JobOptions job = testing::OneTensorJob(job_name, 1000);
  if (auto st = (*client)->CreateOrAttach(job); !st.ok()) return st.status();
  std::mt19937_64 rng(3);
  auto init = testing::RandomFloats(rng, 1000, -1, 1);
  if (auto st = (*client)->InitFp32("w", init.data()); !st.ok()) return st;
  auto g = testing::RandomBf16(rng, 1000, 1.0f);
  std::vector<uint16_t> p(1000);
  StepOptions so;
  so.lr = 1e-3;
  return (*client)->Step({{"w", g.data()}}, so, {{"w", p.data()}}).status();
}

TEST(TlsTest, ATlsServerServesTlsClientsOfItsCaAndRefusesPlaintextAndOtherCas) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  auto server = ServerProcess::Start({"--tls_cert=" + certs.path("server.pem"), "--tls_key=" + certs.path("server.key")});
  ASSERT_NE(server, nullptr);
  ClientOptions tls;
  tls.tls_root_certs = certs.pem("ca.pem");
  EXPECT_TRUE(StepOnce(server->address(), tls, "a").ok());
  const absl::Status plaintext = StepOnce(server->address(), {}, "b");
  EXPECT_EQ(plaintext.code(), absl::StatusCode::kUnavailable) << plaintext;
  ClientOptions other_ca;
  other_ca.tls_root_certs = certs.pem("rogue.pem");
  const absl::Status refused = StepOnce(server->address(), other_ca, "c");
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
}

TEST(TlsTest, AMutualTlsServerServesOnlyClientsWithACertificateItsCaSigned) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  auto server = StartMutualTls(certs);
  ASSERT_NE(server, nullptr);
  ClientOptions trusted;
  trusted.tls_root_certs = certs.pem("ca.pem");
  trusted.tls_cert_chain = certs.pem("client.pem");
  trusted.tls_private_key = certs.pem("client.key");
  EXPECT_TRUE(StepOnce(server->address(), trusted, "a").ok());
  ClientOptions anonymous;
  anonymous.tls_root_certs = certs.pem("ca.pem");
  EXPECT_EQ(StepOnce(server->address(), anonymous, "b").code(), absl::StatusCode::kUnavailable);
  ClientOptions stranger = anonymous;
  stranger.tls_cert_chain = certs.pem("stranger.pem");
  stranger.tls_private_key = certs.pem("stranger.key");
  EXPECT_EQ(StepOnce(server->address(), stranger, "c").code(), absl::StatusCode::kUnavailable);
}

// A handshake that fails (TLS against a plaintext server) is one line, the
// CLI's error: gRPC's own log line of it ("E... ssl_transport_security.cc
// ... Handshake failed ... wrong version number") said it again before it.
TEST(TlsTest, TheCliSaysAFailedHandshakeOnceInItsOwnLine) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  auto plain = ServerProcess::Start({});
  ASSERT_NE(plain, nullptr);
  const std::string out = certs.path("cli.out");
  const int status = std::system(absl::StrCat(SHARDOPT_CLI_BINARY, " --server=", plain->address(),
                                              " --timeout_s=5 --tls_ca=", certs.path("ca.pem"), " describe nojob >",
                                              out, " 2>&1").c_str());
  const std::string said = ReadText(out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << ": " << said;
  EXPECT_THAT(said, ::testing::StartsWith("shardopt: UNAVAILABLE: ")) << said;
  EXPECT_EQ(std::count(said.begin(), said.end(), '\n'), 1) << said;
}

// The admin CLI reaches a TLS server by another name than its certificate's
// (an IP, or localhost through kubectl port-forward to a pod whose
// certificate names shardopt-0.shardopt) with --tls_server_name, the name
// to verify; a wrong one is refused, so the flag is what decides.
TEST(TlsTest, TheCliVerifiesTheNameGivenByTlsServerName) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  auto server = StartMutualTls(certs);
  ASSERT_NE(server, nullptr);
  const auto cli = [&](const std::string& name) {
    const std::string out = certs.path("cli.out");
    const int status = std::system(absl::StrCat(
        SHARDOPT_CLI_BINARY, " --server=", server->address(), " --timeout_s=5 --tls_ca=", certs.path("ca.pem"),
        " --tls_cert=", certs.path("client.pem"), " --tls_key=", certs.path("client.key"),
        name.empty() ? "" : " --tls_server_name=" + name, " describe nojob >", out, " 2>&1").c_str());
    return std::pair{WIFEXITED(status) ? WEXITSTATUS(status) : -1, ReadText(out)};
  };
  // The certificate names localhost and 127.0.0.1: asked as localhost, the
  // server answers (no such job), and as another name the handshake fails.
  // Its *.shardopt.default covers shardopt-0.shardopt.default, but its
  // *.shardopt does not cover shardopt-0.shardopt: gRPC matches a wildcard
  // only where two labels or more follow it (an outside probe, after the
  // README offered a wildcard for the short names).
  auto [named, said] = cli("localhost");
  EXPECT_EQ(named, 1) << said;
  EXPECT_THAT(said, ::testing::HasSubstr("NOT_FOUND")) << said;
  auto [wildcard, matched] = cli("shardopt-0.shardopt.default");
  EXPECT_EQ(wildcard, 1) << matched;
  EXPECT_THAT(matched, ::testing::HasSubstr("NOT_FOUND")) << matched;
  auto [wrong, refused] = cli("shardopt-0.shardopt");
  EXPECT_EQ(wrong, 1) << refused;
  EXPECT_THAT(refused, ::testing::HasSubstr("UNAVAILABLE")) << refused;
  // gRPC says only that it failed to connect: the CLI names the TLS handshake.
  EXPECT_THAT(refused, ::testing::HasSubstr("refused the TLS handshake")) << refused;
  // Without TLS the flag would do nothing: a usage error.
  const int plain = std::system(absl::StrCat(SHARDOPT_CLI_BINARY, " --server=", server->address(),
                                             " --tls_server_name=localhost describe nojob >/dev/null 2>&1").c_str());
  EXPECT_TRUE(WIFEXITED(plain) && WEXITSTATUS(plain) == 2) << plain;
}

// Any peer can fail a handshake per connection, and gRPC logs each: at most
// 5 such lines a second from each line of gRPC's source, the rest counted
// (suppressed=N), as refusals are. 300 plaintext connections to a TLS port
// logged 300 lines.
TEST(TlsTest, FailedHandshakesAreLoggedAtMostFiveASecondEach) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  auto server = ServerProcess::StartLogged({"--tls_cert=" + certs.path("server.pem"),
                                            "--tls_key=" + certs.path("server.key")});
  ASSERT_NE(server, nullptr);
  const auto started = std::chrono::steady_clock::now();
  for (int i = 0; i < 300; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
      const char request[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
      ASSERT_GT(write(fd, request, sizeof request - 1), 0);
      char buffer[64];
      (void)read(fd, buffer, sizeof buffer);  // until the server closes it
    }
    close(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const std::string log = server->log();
  std::map<std::string, int> lines;  // by source
  for (size_t at = log.find(" grpc "); at != std::string::npos; at = log.find(" grpc ", at + 1)) {
    const size_t source = log.find("source=", at);
    lines[log.substr(source, log.find(' ', source) - source)]++;
  }
  ASSERT_FALSE(lines.empty()) << log;
  for (const auto& [source, n] : lines) EXPECT_LE(n, 5 * (static_cast<int>(seconds) + 2)) << source;
  server->Stop(SIGTERM);  // the run's end counts what was held back
  EXPECT_THAT(server->log(), ::testing::HasSubstr("suppressed="));
}

// A renewed certificate (a rotated Kubernetes Secret: new files behind the
// same paths) is taken by new connections without a restart, within
// --tls_reload_seconds; the server logs each change it sees, checked as at
// start. Before, only a restart took it, which tears the current step of a
// job on several servers.
TEST(TlsTest, RenewedCertificatesAreTakenWithoutARestart) {
  Certificates old_set;
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // so that new_set's certificates expire later
  Certificates new_set;
  ASSERT_TRUE(old_set.ok() && new_set.ok()) << "openssl could not make the test certificates";
  char tmpl[] = "/tmp/shardopt-tls-live-XXXXXX";
  const std::string live = mkdtemp(tmpl);
  // Each file replaced whole, as a Secret's update is.
  const auto install = [&](const Certificates& from, const std::string& name, const std::string& as) {
    std::filesystem::copy_file(from.path(name), live + "/" + as + ".tmp",
                               std::filesystem::copy_options::overwrite_existing);
    std::filesystem::rename(live + "/" + as + ".tmp", live + "/" + as);
  };
  const auto install_set = [&](const Certificates& from) {
    install(from, "ca.pem", "ca.pem");
    install(from, "server.key", "server.key");
    install(from, "server.pem", "server.pem");
  };
  install_set(old_set);
  const int metrics_port = testing::FreeLoopbackPort();
  auto server = ServerProcess::StartLogged({"--tls_cert=" + live + "/server.pem", "--tls_key=" + live + "/server.key",
                                            "--tls_client_ca=" + live + "/ca.pem", "--tls_reload_seconds=1",
                                            "--metrics_port=" + std::to_string(metrics_port)});
  ASSERT_NE(server, nullptr);
  const auto client_of = [](const Certificates& set) {
    ClientOptions options;
    options.tls_root_certs = set.pem("ca.pem");
    options.tls_cert_chain = set.pem("client.pem");
    options.tls_private_key = set.pem("client.key");
    return options;
  };
  ASSERT_TRUE(StepOnce(server->address(), client_of(old_set), "a").ok());
  EXPECT_EQ(StepOnce(server->address(), client_of(new_set), "b").code(), absl::StatusCode::kUnavailable);

  // Whether a client of `set` steps job `name` within 15 s, as gRPC's next
  // reading of the files lets it.
  const auto served_soon = [&](const Certificates& set, const std::string& name) {
    for (const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(15);
         std::chrono::steady_clock::now() < give_up; std::this_thread::sleep_for(std::chrono::milliseconds(200))) {
      if (StepOnce(server->address(), client_of(set), name).ok()) return true;
    }
    return false;
  };
  const std::string expiry = "shardopt_tls_certificate_expiry_timestamp_seconds ";
  const auto exported_expiry = [&] {
    const std::string metrics = testing::GetMetrics(metrics_port);
    const size_t at = metrics.find("\n" + expiry);
    return at == std::string::npos ? std::string() : metrics.substr(at + 1 + expiry.size(), metrics.find('\n', at + 1) - at - 1 - expiry.size());
  };
  const std::string old_expiry = exported_expiry();
  EXPECT_FALSE(old_expiry.empty()) << testing::GetMetrics(metrics_port);
  install_set(new_set);
  EXPECT_TRUE(served_soon(new_set, "c")) << "the renewed certificates were not taken in 15 s";
  EXPECT_NE(exported_expiry(), old_expiry) << "the metric still shows the old certificate's expiry";
  EXPECT_EQ(StepOnce(server->address(), client_of(old_set), "d").code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(server->log(), ::testing::HasSubstr("tls_reload"));

  // A key that is not the certificate's: the server says so in its log and
  // keeps handing gRPC the last usable files, so new connections are still
  // served. gRPC reading the files itself took the mismatched pair, and
  // every new handshake failed until they were fixed.
  const auto logged_soon = [&](const std::string& what) {
    for (const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
         std::chrono::steady_clock::now() < give_up; std::this_thread::sleep_for(std::chrono::milliseconds(200))) {
      if (server->log().find(what) != std::string::npos) return true;
    }
    return false;
  };
  install(old_set, "server.key", "server.key");
  EXPECT_TRUE(logged_soon("does not match --tls_cert")) << server->log();
  std::this_thread::sleep_for(std::chrono::seconds(3));  // gRPC's watcher has read its files again by now
  EXPECT_TRUE(StepOnce(server->address(), client_of(new_set), "e").ok());

  // An empty certificate, as `cp` over the file shows for a moment:
  // gRPC 1.51 reading it aborted the process.
  std::ofstream(live + "/server.pem", std::ios::trunc).close();
  EXPECT_TRUE(logged_soon("cannot be read, or is empty")) << server->log();
  std::this_thread::sleep_for(std::chrono::seconds(3));
  EXPECT_EQ(waitpid(server->pid(), nullptr, WNOHANG), 0) << "the server died: " << server->log();
  EXPECT_TRUE(StepOnce(server->address(), client_of(new_set), "f").ok());

  // Usable files again, and they are taken.
  install_set(old_set);
  EXPECT_TRUE(served_soon(old_set, "g")) << "the usable files were not taken in 15 s";
  std::filesystem::remove_all(live);
}

// Files a client cannot use are INVALID_ARGUMENT at Connect, before any
// server is asked (none listens here), not UNAVAILABLE at every call.
TEST(TlsTest, TlsFilesTheClientCannotUseAreRefusedAtConnect) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  ASSERT_EQ(std::system(absl::StrCat("openssl pkey -in ", certs.path("client.key"), " -aes256 -passout pass:secret -out ",
                                     certs.path("encrypted.key"), " 2>/dev/null")
                            .c_str()),
            0);
  struct Case {
    std::string ca, cert, key, says;
  } cases[] = {
      {"ca.pem", "client.pem", "stranger.key", "the client key does not match the client certificate"},
      {"ca.pem", "client.key", "client.key", "the client certificate is not a certificate OpenSSL can read"},
      {"ca.pem", "client.pem", "client.pem", "the client key is not a private key OpenSSL can read"},
      {"ca.pem", "client.pem", "encrypted.key", "or it is encrypted"},
      {"ca.key", "", "", "the CA file holds no certificate OpenSSL can read"},
  };
  for (const Case& c : cases) {
    ClientOptions options;
    options.servers = {"127.0.0.1:1"};
    options.tls_root_certs = certs.pem(c.ca);
    if (!c.cert.empty()) options.tls_cert_chain = certs.pem(c.cert);
    if (!c.key.empty()) options.tls_private_key = certs.pem(c.key);
    const auto client = Client::Connect(options);
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << c.says << ": " << client.status();
    EXPECT_THAT(std::string(client.status().message()), ::testing::HasSubstr(c.says));
  }
  ClientOptions usable;
  usable.servers = {"127.0.0.1:1"};
  usable.tls_root_certs = certs.pem("ca.pem");
  usable.tls_cert_chain = certs.pem("client.pem");
  usable.tls_private_key = certs.pem("client.key");
  EXPECT_TRUE(Client::Connect(usable).ok());
}

// The server's own TLS files are read with OpenSSL at the start: one it
// cannot use stops it (exit 1), logged as start_failed and exit naming the
// flag, where a missing file was a bare line on stderr and a key of another
// certificate was "cannot listen on" the port.
TEST(TlsTest, TlsFilesTheServerCannotUseStopItsStartNamingTheFlag) {
  Certificates certs;
  ASSERT_TRUE(certs.ok()) << "openssl could not make the test certificates";
  struct Case {
    std::string cert, key, ca, says;
  } cases[] = {
      {"server.pem", "stranger.key", "", "--tls_key does not match --tls_cert"},
      {"server.key", "server.key", "", "--tls_cert is not a certificate OpenSSL can read"},
      {"server.pem", "server.key", "ca.key", "--tls_client_ca holds no certificate OpenSSL can read"},
      {"missing.pem", "server.key", "", "--tls_cert=" + certs.path("missing.pem") + " cannot be read"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {"--log_format=json", "--tls_cert=" + certs.path(c.cert),
                                     "--tls_key=" + certs.path(c.key)};
    if (!c.ca.empty()) args.push_back("--tls_client_ca=" + certs.path(c.ca));
    std::string log;
    EXPECT_EQ(testing::ServerExitCode(args, &log), 1) << c.says;
    EXPECT_THAT(log, ::testing::HasSubstr("\"event\":\"start_failed\"")) << log;
    EXPECT_THAT(log, ::testing::HasSubstr("\"event\":\"exit\"")) << log;
    EXPECT_THAT(log, ::testing::HasSubstr(c.says)) << log;
  }
}

TEST(TlsTest, PlaintextOnANonLoopbackAddressIsRefusedUnlessInsecureIsGiven) {
  const pid_t refused = testing::SpawnProcess({SHARDOPT_SERVER_BINARY, "--host=0.0.0.0", "--port=0", "--device=cpu"});
  const auto status = testing::WaitProcess(refused, std::chrono::seconds(20));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 2) << "wait status " << *status;
  // A name that starts like a loopback address is not one.
  const pid_t named = testing::SpawnProcess({SHARDOPT_SERVER_BINARY, "--host=127.example.com", "--port=0",
                                             "--device=cpu"});
  const auto named_status = testing::WaitProcess(named, std::chrono::seconds(20));
  ASSERT_TRUE(named_status.has_value());
  EXPECT_TRUE(WIFEXITED(*named_status) && WEXITSTATUS(*named_status) == 2) << "wait status " << *named_status;
  // ServerProcess listens on 127.0.0.1; the later --host wins.
  auto server = ServerProcess::Start({"--host=0.0.0.0", "--insecure"});
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(StepOnce(server->address(), {}, "a").ok());
}

// ::1 is loopback in either spelling: plaintext needs no --insecure, and the
// server and its metrics listen there (gRPC needs the brackets, getaddrinfo
// none). :: (every address) is not loopback.
TEST(TlsTest, AnIpv6LoopbackHostServesPlaintextAndMetricsThere) {
  for (const std::string host : {"::1", "[::1]"}) {
    SCOPED_TRACE(host);
    const int metrics = testing::FreeLoopbackPort();
    auto server = ServerProcess::Start({"--host=" + host, absl::StrCat("--metrics_port=", metrics)});
    ASSERT_NE(server, nullptr);
    EXPECT_TRUE(StepOnce(absl::StrCat("[::1]:", server->port()), {}, "v6").ok());
    EXPECT_THAT(testing::GetMetrics(metrics, /*ipv6=*/true), ::testing::HasSubstr("\nshardopt_jobs 1\n"));
  }
  const pid_t every = testing::SpawnProcess({SHARDOPT_SERVER_BINARY, "--host=::", "--port=0", "--device=cpu"});
  const auto status = testing::WaitProcess(every, std::chrono::seconds(20));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 2) << "wait status " << *status;
}

}  // namespace
}  // namespace shardopt
