// The engine API's Unix-domain socket: moe-rankd accepts each connection itself, checks the
// connecting process's kernel credentials (SO_PEERCRED) against a uid allow-list, and only then
// hands the connection to gRPC (grpc::AddInsecureChannelFromFd). A refused connection is closed
// before gRPC reads a byte from it.
//
// The socket file is created afresh (an existing socket owned by this user is replaced; any other
// file is refused), mode 0600 when only this user is allowed, 0666 when others are (the
// credential check is the gate then).
//
// Thread-safety: PeerUid() may be called from any thread; Start() once.
#ifndef MOE_RPC_UNIX_SOCKET_H_
#define MOE_RPC_UNIX_SOCKET_H_

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace moe {

// A listening Unix socket at `path`, created afresh: a socket of this user left there is replaced,
// any other file is refused (FAILED_PRECONDITION); the file gets mode 0600 when `only_owner`,
// 0666 otherwise, with no window in between. `what` names the socket in errors (a flag).
absl::StatusOr<int> ListenUnixSocket(const std::string& path, bool only_owner, const std::string& what);

class UnixSocketListener {
 public:
  // Binds and listens on `path`. `allowed_uids` empty: only this process's effective uid.
  static absl::StatusOr<std::unique_ptr<UnixSocketListener>> Create(const std::string& path,
                                                                    std::vector<uid_t> allowed_uids);
  ~UnixSocketListener();  // stops accepting and removes the socket file

  // Accepts connections into `server` (built with no ports of its own, or any) until destroyed.
  void Start(grpc::Server* server);
  // The uid of the process behind a gRPC peer string of a connection this listener admitted
  // ("fd:N"); nullopt for any other peer.
  std::optional<uid_t> PeerUid(const std::string& peer);
  const std::string& path() const { return path_; }
  int64_t refused() const { return refused_.load(); }

 private:
  UnixSocketListener(std::string path, int fd, std::vector<uid_t> allowed);
  void AcceptLoop(grpc::Server* server);

  const std::string path_;
  const int listen_fd_;
  const std::vector<uid_t> allowed_;
  int wake_[2] = {-1, -1};  // a pipe that ends the accept loop
  std::thread thread_;
  std::atomic<int64_t> refused_{0};
  absl::Mutex mu_;
  std::map<int, uid_t> admitted_ ABSL_GUARDED_BY(mu_);  // fd -> uid of the connections handed to gRPC
};

}  // namespace moe

#endif  // MOE_RPC_UNIX_SOCKET_H_
