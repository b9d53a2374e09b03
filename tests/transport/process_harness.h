// Runs one test scenario per member in forked processes and collects their exit codes.
// Members must not inherit an initialized CUDA context or UCX state: call before using either.
#ifndef MOE_TESTS_TRANSPORT_PROCESS_HARNESS_H_
#define MOE_TESTS_TRANSPORT_PROCESS_HARNESS_H_

#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <sys/wait.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "runtime/transport/transport.h"

namespace moe::testing {

inline std::string FreshDir(const char* prefix) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/" + prefix + "-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  return std::string(mkdtemp(buf.data()));
}

// Runs `fn` in a forked child and returns its exit code (0-255; -1 if it died): for questions
// that must not initialize state in this process before it forks members (e.g. counting GPUs,
// which would create a CUDA context the children cannot use).
inline int ExitCodeOfChild(const std::function<int()>& fn) {
  const pid_t pid = fork();
  if (pid == 0) _exit(fn());
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// One member's UCX transport on the loopback interface, its address published to and the
// group's read from the rendezvous directory `dir` (call in the member's own process).
inline absl::StatusOr<std::unique_ptr<Transport>> UcxMemberTransport(const std::string& dir, int slot, int size) {
  auto listener = CreateUcxListener("127.0.0.1");
  if (!listener.ok()) return listener.status();
  auto addresses = RendezvousAddresses(dir, slot, size, UcxListenerAddress(**listener), absl::Seconds(30));
  if (!addresses.ok()) return addresses.status();
  UcxOptions options;
  options.slot = slot;
  options.addresses = *addresses;
  options.connect_timeout = absl::Seconds(30);
  return CreateUcxTransportWithListener(*std::move(listener), options);
}

// `member(slot, dir)` runs in the child and returns its exit code. Returns every member's exit
// code (-signal for a member killed by a signal).
inline std::vector<int> ForkMembers(int size, const char* prefix,
                                    const std::function<int(int, const std::string&)>& member) {
  const std::string dir = FreshDir(prefix);
  std::vector<pid_t> pids;
  for (int i = 0; i < size; ++i) {
    const pid_t pid = fork();
    if (pid == 0) _exit(member(i, dir));
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status));
  }
  return codes;
}

}  // namespace moe::testing

#endif  // MOE_TESTS_TRANSPORT_PROCESS_HARNESS_H_
