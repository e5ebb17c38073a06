#include "tools/spawn.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

namespace shardopt {
namespace {

int OpenOrMinusOne(const std::string& path, int flags) {
  return path.empty() ? -1 : open(path.c_str(), flags | O_CLOEXEC, 0644);
}

// The child's own pid in decimal, written with write(2) alone.
bool WritePid(int fd) {
  char digits[24];
  char* first = digits + sizeof digits;
  pid_t pid = getpid();
  do {
    *--first = static_cast<char>('0' + pid % 10);
    pid /= 10;
  } while (pid > 0);
  const ssize_t n = digits + sizeof digits - first;
  return write(fd, first, n) == n;
}

}  // namespace

pid_t Spawn(std::vector<std::string> argv, const SpawnOptions& options) {
  std::vector<char*> args;
  for (std::string& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  const int err = OpenOrMinusOne(options.stderr_path, O_WRONLY | O_CREAT | O_TRUNC);
  const int procs = OpenOrMinusOne(options.cgroup_procs, O_WRONLY);
  const bool open_failed = (!options.stderr_path.empty() && err < 0) || (!options.cgroup_procs.empty() && procs < 0);
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // a caller killed mid-run must not leave its children behind
    if (open_failed) _exit(126);
    if (procs >= 0 && !WritePid(procs)) _exit(126);
    if (err >= 0 && dup2(err, STDERR_FILENO) < 0) _exit(126);
    execv(args[0], args.data());
    _exit(127);
  }
  if (err >= 0) close(err);
  if (procs >= 0) close(procs);
  return pid;
}

}  // namespace shardopt
