#include "rpc/unix_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <grpcpp/server_posix.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace moe {

absl::StatusOr<int> ListenUnixSocket(const std::string& path, bool only_owner, const std::string& what) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", path, "': a path of 1 to ", sizeof(addr.sun_path) - 1, " characters"));
  }
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    // A socket of ours left by an earlier run is replaced; anything else is not ours to remove.
    if (!S_ISSOCK(st.st_mode) || st.st_uid != geteuid()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " ", path, ": exists and is not a socket owned by this user"));
    }
    unlink(path.c_str());
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat(what, ": socket(): ", std::strerror(errno)));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  // Created with the final mode (no window where others may connect).
  const mode_t old_mask = umask(only_owner ? 0177 : 0111);
  const int bound = bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  umask(old_mask);
  if (bound != 0 || listen(fd, 128) != 0) {
    close(fd);
    return absl::UnavailableError(
        absl::StrCat(what, " ", path, ": cannot listen: ", std::strerror(bound != 0 ? bind_errno : errno)));
  }
  return fd;
}

absl::StatusOr<std::unique_ptr<UnixSocketListener>> UnixSocketListener::Create(const std::string& path,
                                                                               std::vector<uid_t> allowed) {
  if (allowed.empty()) allowed.push_back(geteuid());
  const bool only_me = std::all_of(allowed.begin(), allowed.end(), [](uid_t u) { return u == geteuid(); });
  absl::StatusOr<int> fd = ListenUnixSocket(path, only_me, "--engine_socket");
  if (!fd.ok()) return fd.status();
  return std::unique_ptr<UnixSocketListener>(new UnixSocketListener(path, *fd, std::move(allowed)));
}

UnixSocketListener::UnixSocketListener(std::string path, int fd, std::vector<uid_t> allowed)
    : path_(std::move(path)), listen_fd_(fd), allowed_(std::move(allowed)) {
  if (pipe2(wake_, O_CLOEXEC) != 0) wake_[0] = wake_[1] = -1;
}

UnixSocketListener::~UnixSocketListener() {
  if (wake_[1] >= 0) {
    const char c = 0;
    (void)!write(wake_[1], &c, 1);
  }
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
  unlink(path_.c_str());
  for (int f : wake_) {
    if (f >= 0) close(f);
  }
}

void UnixSocketListener::Start(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixSocketListener::AcceptLoop(grpc::Server* server) {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (poll(fds, wake_[0] >= 0 ? 2 : 1, -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("engine socket: poll: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) continue;
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
        std::find(allowed_.begin(), allowed_.end(), cred.uid) == allowed_.end()) {
      ++refused_;
      spdlog::warn("engine socket: refused a connection from uid {} (pid {}): not in --engine_uids", cred.uid,
                   cred.pid);
      close(conn);
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      admitted_[conn] = cred.uid;  // a reused descriptor number overwrites the closed one's entry
    }
    grpc::AddInsecureChannelFromFd(server, conn);
  }
}

std::optional<uid_t> UnixSocketListener::PeerUid(const std::string& peer) {
  // gRPC names a connection added from a descriptor "fd:<n>".
  int fd = -1;
  if (peer.rfind("fd:", 0) != 0 || !absl::SimpleAtoi(peer.substr(3), &fd)) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = admitted_.find(fd);
  if (it == admitted_.end()) return std::nullopt;
  return it->second;
}

}  // namespace moe
