// UCX implementation of Transport: tag-matched messages between client-server endpoints.
//
// Every member listens on its own address; every member opens a client endpoint to every
// other member and sends through it; receives match on the worker by tag, whatever endpoint
// the message came through. Positional collectives (AllGather, AllToAllV) carry (kind, this
// transport's call count, source slot) in the tag: 44 bits of count, so tags repeat only after
// 2^44 collectives, long after any message of the earlier one has been matched. The step
// agreement (StepGather) runs the step_gather.h protocol over one stream a peer (kind kAgree,
// source slot), carrying the whole 64-bit step id in each message. Progress is driven by the
// calling thread (UCS_THREAD_MODE_SINGLE).
#include <ifaddrs.h>
#include <netdb.h>

#include <cstring>
#include <sstream>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

#include "runtime/status.h"
#include "runtime/transport/file_rendezvous.h"
#include "runtime/transport/step_gather.h"
#include "runtime/transport/transport.h"

// UCX codes become absl::Status here only (moe::ForeignError: code, message, expression, file:line).
#define UCX_RETURN_IF_ERROR(expr)                                                                                      \
  do {                                                                                                                 \
    const ucs_status_t moe_ucs_ = (expr);                                                                              \
    if (moe_ucs_ != UCS_OK) {                                                                                          \
      return ::moe::ForeignError(absl::StatusCode::kUnavailable, "UCX",                                                \
                                 absl::StrCat("ucs_status ", static_cast<int>(moe_ucs_)), ucs_status_string(moe_ucs_), \
                                 #expr, __FILE__, __LINE__);                                                           \
    }                                                                                                                  \
  } while (0)

namespace moe {
namespace {

constexpr uint64_t kHello = 1, kGather = 2, kAllToAll = 3, kAgree = 4;

uint64_t Tag(uint64_t kind, uint64_t seq, int src) {
  return (kind << 60) | ((seq & ((uint64_t{1} << 44) - 1)) << 16) | static_cast<uint64_t>(src & 0xffff);
}

absl::StatusOr<sockaddr_storage> Resolve(const std::string& address, socklen_t* len) {
  std::vector<std::string> parts = absl::StrSplit(address, ':');
  int port = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "': expected host:port"));
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(parts[0].c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "': cannot resolve host"));
  }
  sockaddr_storage out{};
  std::memcpy(&out, res->ai_addr, res->ai_addrlen);
  reinterpret_cast<sockaddr_in*>(&out)->sin_port = htons(static_cast<uint16_t>(port));
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return out;
}

}  // namespace

// Context, worker and listener: created first so the listening port can be published.
class UcxListenerHandle {
 public:
  ~UcxListenerHandle() {
    for (ucp_ep_h ep : accepted) CloseEp(ep, /*force=*/true);
    if (listener != nullptr) ucp_listener_destroy(listener);
    if (worker != nullptr) ucp_worker_destroy(worker);
    if (context != nullptr) ucp_cleanup(context);
  }
  // A graceful close flushes what this side sent (a member that finished its part must not
  // drop data its peers still receive); a forced close does not wait. Either is bounded.
  void CloseEp(ucp_ep_h ep, bool force) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* req = ucp_ep_close_nbx(ep, &p);
    if (UCS_PTR_IS_PTR(req)) {
      const absl::Time deadline = absl::Now() + absl::Seconds(2);
      while (ucp_request_check_status(req) == UCS_INPROGRESS && absl::Now() < deadline) ucp_worker_progress(worker);
      if (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_request_cancel(worker, req);
      ucp_request_free(req);
    }
  }
  static void IgnoreError(void*, ucp_ep_h, ucs_status_t) {}
  static void OnConnect(ucp_conn_request_h request, void* arg) {
    auto* self = static_cast<UcxListenerHandle*>(arg);
    ucp_ep_params_t params{};
    // Accepted endpoints only keep the peer's client endpoint connected; failures surface on
    // this member's own client endpoint to that peer.
    params.field_mask =
        UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.conn_request = request;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &UcxListenerHandle::IgnoreError;
    params.err_handler.arg = nullptr;
    ucp_ep_h ep;
    if (ucp_ep_create(self->worker, &params, &ep) == UCS_OK) self->accepted.push_back(ep);
  }

  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  std::vector<ucp_ep_h> accepted;  // kept open so peers' client endpoints stay connected
  std::string address;
};

void UcxListenerDeleter::operator()(UcxListenerHandle* h) const { delete h; }

absl::StatusOr<std::string> InterfaceOf(const std::string& address) {
  const std::string host = address.substr(0, address.find(':'));
  socklen_t len = 0;
  auto resolved = Resolve(host + ":0", &len);
  if (!resolved.ok()) return resolved.status();
  const in_addr want = reinterpret_cast<const sockaddr_in*>(&*resolved)->sin_addr;
  if (want.s_addr == htonl(INADDR_ANY)) {
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "' is every interface: name the UCX device"));
  }
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return absl::UnavailableError("getifaddrs failed");
  std::string name;
  for (ifaddrs* a = list; a != nullptr && name.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if (reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr == want.s_addr) name = a->ifa_name;
  }
  freeifaddrs(list);
  if (name.empty())
    return absl::InvalidArgumentError(absl::StrCat("address '", address, "' is on no interface of this host"));
  return name;
}

absl::StatusOr<UcxListener> CreateUcxListener(const std::string& host_port, const std::string& net_devices) {
  UcxListener h(new UcxListenerHandle());
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  // UCX's TCP transport opens a listening socket on every device it may use: restrict the
  // devices to the one that holds this member's address (or the configured ones), so nothing
  // listens on another interface.
  std::string devices = net_devices;
  if (devices.empty()) {
    auto dev = InterfaceOf(host_port);
    if (!dev.ok()) return absl::Status(dev.status().code(), absl::StrCat("ucx net devices: ", dev.status().message()));
    devices = *dev;
  }
  ucp_config_t* config = nullptr;
  UCX_RETURN_IF_ERROR(ucp_config_read(nullptr, nullptr, &config));
  const ucs_status_t modified = ucp_config_modify(config, "NET_DEVICES", devices.c_str());
  if (modified != UCS_OK) {
    ucp_config_release(config);
    return absl::InvalidArgumentError(absl::StrCat("ucx net devices '", devices, "': ", ucs_status_string(modified)));
  }
  const ucs_status_t initialized = ucp_init(&params, config, &h->context);
  ucp_config_release(config);
  UCX_RETURN_IF_ERROR(initialized);
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  UCX_RETURN_IF_ERROR(ucp_worker_create(h->context, &wp, &h->worker));
  const std::string with_port = host_port.find(':') == std::string::npos ? host_port + ":0" : host_port;
  socklen_t len = 0;
  auto addr = Resolve(with_port, &len);
  if (!addr.ok()) return addr.status();
  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*addr);
  lp.sockaddr.addrlen = len;
  lp.conn_handler.cb = &UcxListenerHandle::OnConnect;
  lp.conn_handler.arg = h.get();
  UCX_RETURN_IF_ERROR(ucp_listener_create(h->worker, &lp, &h->listener));
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  UCX_RETURN_IF_ERROR(ucp_listener_query(h->listener, &attr));
  const int port = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
  h->address = absl::StrCat(std::vector<std::string>(absl::StrSplit(with_port, ':'))[0], ":", port);
  return h;
}

std::string UcxListenerAddress(const UcxListenerHandle& listener) { return listener.address; }

namespace {

struct Peer {
  ucp_ep_h ep = nullptr;
  ucs_status_t failure = UCS_OK;
};

class UcxTransport final : public Transport {
 public:
  UcxTransport(UcxListener base, UcxOptions options)
      : base_(std::move(base)),
        options_(std::move(options)),
        peers_(options_.addresses.size()),
        agree_recv_(options_.addresses.size()) {}
  ~UcxTransport() override {
    CancelAgreement();
    for (Peer& p : peers_) {
      if (p.ep != nullptr) base_->CloseEp(p.ep, /*force=*/p.failure != UCS_OK);
    }
  }
  const char* name() const override { return "ucx"; }
  int slot() const override { return options_.slot; }
  int size() const override { return static_cast<int>(peers_.size()); }
  bool failed() const override {
    for (int i = 0; i < size(); ++i) {
      if (i != slot() && peers_[i].failure != UCS_OK) return true;
    }
    return false;
  }

  absl::Status Connect() {
    const absl::Time deadline = absl::Now() + options_.connect_timeout;
    // Every member sends a hello to every other member until all hellos have arrived; a
    // client endpoint that fails (peer not listening yet) is recreated and retried.
    for (int i = 0; i < size(); ++i) {
      if (i == slot()) continue;
      absl::Status s = OpenEp(i);
      if (!s.ok()) return s;
    }
    std::vector<bool> sent(size(), false), heard(size(), false);
    sent[slot()] = heard[slot()] = true;
    std::vector<void*> recvs(size(), nullptr), sends(size(), nullptr);
    uint8_t sink[1], hello = 1;
    for (int i = 0; i < size(); ++i) {
      if (i != slot()) recvs[i] = PostRecv(Tag(kHello, 0, i), sink, 1);
    }
    while (true) {
      ucp_worker_progress(base_->worker);
      bool done = true;
      for (int i = 0; i < size(); ++i) {
        if (i == slot()) continue;
        if (!heard[i] && Completed(&recvs[i])) heard[i] = true;
        if (!sent[i]) {
          if (sends[i] == nullptr) sends[i] = PostSend(i, Tag(kHello, 0, slot()), &hello, 1);
          if (UCS_PTR_IS_ERR(sends[i]) || peers_[i].failure != UCS_OK) {
            // The peer is not listening yet: reopen and resend after a short pause.
            if (UCS_PTR_IS_PTR(sends[i])) {
              ucp_request_cancel(base_->worker, sends[i]);
              ucp_request_free(sends[i]);
            }
            sends[i] = nullptr;
            base_->CloseEp(peers_[i].ep, /*force=*/true);
            peers_[i] = Peer{};
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            absl::Status s = OpenEp(i);
            if (!s.ok()) return s;
          } else if (Completed(&sends[i])) {
            sent[i] = true;
          }
        }
        done = done && sent[i] && heard[i];
      }
      if (done) return absl::OkStatus();
      if (absl::Now() > deadline) {
        for (int i = 0; i < size(); ++i) {
          if (!heard[i] || !sent[i]) {
            CancelAll(&recvs);
            CancelAll(&sends);
            return absl::DeadlineExceededError(absl::StrCat("ucx: peer slot ", i, " (", options_.addresses[i],
                                                            ") not reachable within ",
                                                            absl::FormatDuration(options_.connect_timeout)));
          }
        }
      }
    }
  }

  absl::Status AllGather(uint64_t seq, const void* in, int64_t bytes, void* out, absl::Duration timeout) override {
    std::vector<int64_t> splits(size(), bytes);
    std::string packed;
    packed.reserve(bytes * size());
    for (int i = 0; i < size(); ++i) packed.append(static_cast<const char*>(in), bytes);
    return Exchange(kGather, seq, packed.data(), splits, out, splits, timeout);
  }

  absl::Status AllToAllV(uint64_t seq, const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t> recv_bytes, absl::Duration timeout) override {
    if (static_cast<int>(send_bytes.size()) != size() || static_cast<int>(recv_bytes.size()) != size()) {
      return absl::InvalidArgumentError("split vectors must have one entry per peer slot");
    }
    return Exchange(kAllToAll, seq, send, send_bytes, recv, recv_bytes, timeout);
  }

  absl::Status StepGather(uint64_t step, const void* in, int64_t bytes, void* out, absl::Duration timeout) override {
    if (bytes < 0 || bytes > kMaxStepGatherRecordBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("ucx: step record of ", bytes, " bytes (at most ", kMaxStepGatherRecordBytes, ")"));
    }
    if (absl::Status s = CheckPeersUp(); !s.ok()) return s;
    AgreeChannel channel(this);
    return RunStepGather(channel, backlog_, slot(), size(), step, in, bytes, out, timeout);
  }
  void AbandonStep(uint64_t step) override {
    AgreeChannel channel(this);
    AbandonStepGather(channel, slot(), size(), step);  // a failed peer is reported by the next call
  }

 private:
  // The agreement streams: one receive posted per peer at a time (tag kAgree, the peer's slot),
  // kept posted between steps; sends are small eager messages, freed as they complete.
  class AgreeChannel final : public StepGatherChannel {
   public:
    explicit AgreeChannel(UcxTransport* t) : t_(t) {}
    absl::Status Send(int peer, const StepGatherHeader& header, const void* payload, int64_t bytes) override {
      if (t_->peers_[peer].ep == nullptr || t_->peers_[peer].failure != UCS_OK) {
        return absl::UnavailableError(absl::StrCat("ucx: peer slot ", peer, " failed"));
      }
      auto msg = std::make_unique<std::string>(sizeof(header) + bytes, '\0');
      std::memcpy(msg->data(), &header, sizeof(header));
      if (bytes > 0) std::memcpy(msg->data() + sizeof(header), payload, bytes);
      void* req = t_->PostSend(peer, Tag(kAgree, 0, t_->slot()), msg->data(), msg->size());
      if (UCS_PTR_IS_ERR(req)) {
        return absl::UnavailableError(
            absl::StrCat("ucx: send to peer slot ", peer, ": ", ucs_status_string(UCS_PTR_STATUS(req))));
      }
      if (req != nullptr) t_->agree_sends_.push_back({req, std::move(msg)});
      t_->ReapAgreeSends();
      return absl::OkStatus();
    }
    absl::StatusOr<bool> Poll(int peer, StepGatherHeader* header, void* payload, int64_t capacity,
                              int64_t* bytes) override {
      if (t_->peers_[peer].failure != UCS_OK) {
        return absl::UnavailableError(absl::StrCat("ucx: peer slot ", peer, " (", t_->options_.addresses[peer],
                                                   ") failed: ", ucs_status_string(t_->peers_[peer].failure)));
      }
      auto& r = t_->agree_recv_[peer];
      if (r.buf.empty()) r.buf.resize(sizeof(StepGatherHeader) + kMaxStepGatherRecordBytes);
      ucp_tag_recv_info_t info{};
      ucs_status_t st = UCS_OK;
      if (r.req == nullptr) {
        ucp_request_param_t p{};
        p.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;  // always a request, tested below
        void* req =
            ucp_tag_recv_nbx(t_->base_->worker, r.buf.data(), r.buf.size(), Tag(kAgree, 0, peer), ~uint64_t{0}, &p);
        if (UCS_PTR_IS_ERR(req)) {
          return absl::UnavailableError(absl::StrCat("ucx: agreement receive from peer slot ", peer, ": ",
                                                     ucs_status_string(UCS_PTR_STATUS(req))));
        }
        r.req = req;
      }
      st = ucp_tag_recv_request_test(r.req, &info);
      if (st == UCS_INPROGRESS) return false;
      ucp_request_free(r.req);
      r.req = nullptr;
      if (st != UCS_OK) {
        return absl::UnavailableError(
            absl::StrCat("ucx: agreement receive from peer slot ", peer, ": ", ucs_status_string(st)));
      }
      if (info.length < sizeof(StepGatherHeader)) {
        return absl::DataLossError(
            absl::StrCat("ucx: agreement message of ", info.length, " bytes from peer slot ", peer));
      }
      std::memcpy(header, r.buf.data(), sizeof(StepGatherHeader));
      *bytes = static_cast<int64_t>(info.length - sizeof(StepGatherHeader));
      if (*bytes > capacity) *bytes = capacity;
      if (*bytes > 0) std::memcpy(payload, r.buf.data() + sizeof(StepGatherHeader), *bytes);
      return true;
    }
    void Idle() override {
      if (ucp_worker_progress(t_->base_->worker) == 0) std::this_thread::yield();
    }
    bool Interrupted() const override { return t_->interrupted(); }

   private:
    UcxTransport* t_;
  };
  struct AgreeRecv {
    void* req = nullptr;
    std::string buf;
  };
  struct AgreeSend {
    void* req;
    std::unique_ptr<std::string> msg;
  };
  void ReapAgreeSends() {
    for (size_t i = 0; i < agree_sends_.size();) {
      if (ucp_request_check_status(agree_sends_[i].req) != UCS_INPROGRESS) {
        ucp_request_free(agree_sends_[i].req);
        agree_sends_[i] = std::move(agree_sends_.back());
        agree_sends_.pop_back();
      } else {
        ++i;
      }
    }
  }
  void CancelAgreement() {
    for (AgreeRecv& r : agree_recv_) {
      if (r.req != nullptr) {
        ucp_request_cancel(base_->worker, r.req);
        ucp_request_free(r.req);
        r.req = nullptr;
      }
    }
    for (AgreeSend& s : agree_sends_) {
      ucp_request_cancel(base_->worker, s.req);
      ucp_request_free(s.req);
    }
    agree_sends_.clear();
  }

  static void OnError(void* arg, ucp_ep_h, ucs_status_t status) { static_cast<Peer*>(arg)->failure = status; }

  absl::Status OpenEp(int i) {
    socklen_t len = 0;
    auto addr = Resolve(options_.addresses[i], &len);
    if (!addr.ok()) return addr.status();
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&*addr);
    params.sockaddr.addrlen = len;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &UcxTransport::OnError;
    params.err_handler.arg = &peers_[i];
    UCX_RETURN_IF_ERROR(ucp_ep_create(base_->worker, &params, &peers_[i].ep));
    return absl::OkStatus();
  }

  void* PostSend(int i, uint64_t tag, const void* buf, size_t len) {
    ucp_request_param_t p{};
    return ucp_tag_send_nbx(peers_[i].ep, buf, len, tag, &p);
  }
  // Always a request (never completed at the call): a receive whose message had already arrived
  // would otherwise return UCS_OK with no request to read the message's length from, and a
  // shorter message than the split would pass as whole (ReceiveCompleted; seen in CI as
  // AShortMessageIsDataLossNamingThePeer answering OK when slot 0's 8 bytes came first).
  void* PostRecv(uint64_t tag, void* buf, size_t len) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    return ucp_tag_recv_nbx(base_->worker, buf, len, tag, ~uint64_t{0}, &p);
  }
  // True when the request finished (successfully or not); frees it.
  static bool Completed(void** req, ucs_status_t* status = nullptr) {
    if (*req == nullptr) {
      if (status != nullptr) *status = UCS_OK;
      return true;
    }
    if (UCS_PTR_IS_ERR(*req)) {
      if (status != nullptr) *status = UCS_PTR_STATUS(*req);
      return true;
    }
    const ucs_status_t s = ucp_request_check_status(*req);
    if (s == UCS_INPROGRESS) return false;
    if (status != nullptr) *status = s;
    ucp_request_free(*req);
    *req = nullptr;
    return true;
  }
  // Ends every request still posted (reqs[i] is the one with peer slot i), in bounded time. A
  // receive cancels at once; a send the library cannot cancel (a rendezvous whose peer never
  // fetches it: dead, or not taking part in the step) is ended by force-closing that peer's
  // endpoint, which marks the peer failed: later steps with it answer UNAVAILABLE at once, as
  // with a peer UCX itself saw fail, instead of waiting on the library's keepalive.
  void CancelAll(std::vector<void*>* reqs) {
    for (size_t i = 0; i < reqs->size(); ++i) {
      void*& r = (*reqs)[i];
      if (r != nullptr && UCS_PTR_IS_PTR(r)) {
        ucp_request_cancel(base_->worker, r);
        const absl::Time give_up = absl::Now() + absl::Milliseconds(100);
        while (ucp_request_check_status(r) == UCS_INPROGRESS && absl::Now() < give_up) {
          ucp_worker_progress(base_->worker);
        }
        if (ucp_request_check_status(r) == UCS_INPROGRESS && peers_[i].ep != nullptr) {
          if (peers_[i].failure == UCS_OK) peers_[i].failure = UCS_ERR_TIMED_OUT;
          base_->CloseEp(peers_[i].ep, /*force=*/true);  // completes its requests with an error
          peers_[i].ep = nullptr;
        }
        ucp_request_free(r);  // (the library keeps any it could not end; no callback is set)
      }
      r = nullptr;
    }
  }

  // UNAVAILABLE naming the first peer (other than this member) that UCX saw fail, else OK.
  absl::Status CheckPeersUp() const {
    for (int i = 0; i < size(); ++i) {
      if (i != slot() && peers_[i].failure != UCS_OK) {
        return absl::UnavailableError(absl::StrCat("ucx: peer slot ", i, " (", options_.addresses[i],
                                                   ") failed: ", ucs_status_string(peers_[i].failure)));
      }
    }
    return absl::OkStatus();
  }

  // The requests of one positional collective: entry i is the one with peer slot i.
  struct Pending {
    std::vector<void*> recvs, sends;
    std::vector<bool> recv_done, send_done;
    std::vector<size_t> recv_bytes;  // what each receive must carry
    bool Done(int i) const { return recv_done[i] && send_done[i]; }
  };

  // Posts every receive, then every send, of collective `position`; copies this member's own
  // segment locally.
  Pending PostExchange(uint64_t kind, uint64_t position, const void* send, const std::vector<int64_t>& send_off,
                       absl::Span<const int64_t> send_bytes, void* recv, const std::vector<int64_t>& recv_off,
                       absl::Span<const int64_t> recv_bytes) {
    const int n = size(), me = slot();
    Pending p{std::vector<void*>(n, nullptr), std::vector<void*>(n, nullptr), std::vector<bool>(n, false),
              std::vector<bool>(n, false), std::vector<size_t>(n, 0)};
    for (int i = 0; i < n; ++i) {
      if (i == me) continue;
      p.recv_bytes[i] = static_cast<size_t>(recv_bytes[i]);
      p.recvs[i] = PostRecv(Tag(kind, position, i), static_cast<char*>(recv) + recv_off[i], recv_bytes[i]);
    }
    for (int i = 0; i < n; ++i) {
      if (i == me) continue;
      p.sends[i] = PostSend(i, Tag(kind, position, me), static_cast<const char*>(send) + send_off[i], send_bytes[i]);
    }
    std::memcpy(static_cast<char*>(recv) + recv_off[me], static_cast<const char*>(send) + send_off[me], send_bytes[me]);
    p.recv_done[me] = p.send_done[me] = true;
    return p;
  }

  // True when the receive finished (successfully or not); frees it. *length: the bytes the
  // message carried (UCX fails a longer message than the buffer, but completes a shorter one).
  static bool ReceiveCompleted(void** req, ucs_status_t* status, size_t* length) {
    if (*req == nullptr || UCS_PTR_IS_ERR(*req)) return Completed(req, status);
    ucp_tag_recv_info_t info{};
    const ucs_status_t s = ucp_tag_recv_request_test(*req, &info);
    if (s == UCS_INPROGRESS) return false;
    *status = s;
    *length = info.length;
    ucp_request_free(*req);
    *req = nullptr;
    return true;
  }

  // Tests peer i's receive and send; on a failed request or a failed peer, ends every request
  // of the collective and returns UNAVAILABLE; a receive shorter than its split is DATA_LOSS.
  absl::Status AdvancePeer(int i, Pending& p) {
    ucs_status_t st = UCS_OK;
    size_t length = p.recv_bytes[i];
    if (!p.recv_done[i] && ReceiveCompleted(&p.recvs[i], &st, &length)) {
      p.recv_done[i] = true;
      if (st != UCS_OK) {
        CancelAll(&p.recvs);
        CancelAll(&p.sends);
        return absl::UnavailableError(
            absl::StrCat("ucx: receive from peer slot ", i, " failed: ", ucs_status_string(st)));
      }
      if (length != p.recv_bytes[i]) {
        CancelAll(&p.recvs);
        CancelAll(&p.sends);
        return absl::DataLossError(
            absl::StrCat("ucx: peer slot ", i, " sent ", length, " bytes where ", p.recv_bytes[i], " were agreed"));
      }
    }
    if (!p.send_done[i] && Completed(&p.sends[i], &st)) {
      p.send_done[i] = true;
      if (st != UCS_OK) {
        CancelAll(&p.recvs);
        CancelAll(&p.sends);
        return absl::UnavailableError(absl::StrCat("ucx: send to peer slot ", i, " (", options_.addresses[i],
                                                   ") failed: ", ucs_status_string(st)));
      }
    }
    if (i != slot() && peers_[i].failure != UCS_OK && !p.Done(i)) {
      CancelAll(&p.recvs);
      CancelAll(&p.sends);
      return absl::UnavailableError(absl::StrCat("ucx: peer slot ", i, " (", options_.addresses[i],
                                                 ") failed: ", ucs_status_string(peers_[i].failure)));
    }
    return absl::OkStatus();
  }

  // The collective ran past its deadline: ends its requests and fails the peers it did not
  // complete with.
  absl::Status AbandonExchange(Pending& p, uint64_t seq, absl::Duration timeout) {
    const int n = size(), me = slot();
    int missing = -1;
    for (int i = 0; i < n && missing < 0; ++i) {
      if (!p.Done(i)) missing = i;
    }
    CancelAll(&p.recvs);
    CancelAll(&p.sends);
    // Positions now differ between this member and the peers it did not complete with: a
    // later call would pair with the wrong one of theirs. Fail them (as NCCL aborts its
    // communicator); later calls with them answer UNAVAILABLE at once.
    for (int i = 0; i < n; ++i) {
      if (i == me || p.Done(i) || peers_[i].ep == nullptr) continue;
      if (peers_[i].failure == UCS_OK) peers_[i].failure = UCS_ERR_TIMED_OUT;
      base_->CloseEp(peers_[i].ep, /*force=*/true);
      peers_[i].ep = nullptr;
    }
    return absl::DeadlineExceededError(absl::StrCat("ucx: peer slot ", missing, " did not answer within ",
                                                    absl::FormatDuration(timeout), " (seq ", seq, ")"));
  }

  absl::Status Exchange(uint64_t kind, uint64_t seq, const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                        absl::Span<const int64_t> recv_bytes, absl::Duration timeout) {
    const int n = size();
    // Matched by position: this member's n-th collective pairs with every peer's n-th.
    const uint64_t position = ++collectives_;
    std::vector<int64_t> send_off(n + 1, 0), recv_off(n + 1, 0);
    for (int i = 0; i < n; ++i) {
      send_off[i + 1] = send_off[i] + send_bytes[i];
      recv_off[i + 1] = recv_off[i] + recv_bytes[i];
    }
    if (interrupted()) return InterruptedError(seq);
    if (absl::Status s = CheckPeersUp(); !s.ok()) return s;
    Pending p = PostExchange(kind, position, send, send_off, send_bytes, recv, recv_off, recv_bytes);
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      // Yield when nothing progressed: several ranks may share few cores (local clusters).
      if (ucp_worker_progress(base_->worker) == 0) std::this_thread::yield();
      bool all = true;
      for (int i = 0; i < n; ++i) {
        if (absl::Status s = AdvancePeer(i, p); !s.ok()) return s;
        all = all && p.Done(i);
      }
      if (all) return absl::OkStatus();
      if (interrupted()) {
        AbandonExchange(p, seq, timeout).IgnoreError();
        return InterruptedError(seq);
      }
      if (absl::Now() > deadline) return AbandonExchange(p, seq, timeout);
    }
  }

  UcxListener base_;
  UcxOptions options_;
  std::vector<Peer> peers_;
  uint64_t collectives_ = 0;   // positional calls made (their tags' sequence)
  StepGatherBacklog backlog_;  // agreement messages read ahead
  std::vector<AgreeRecv> agree_recv_;
  std::vector<AgreeSend> agree_sends_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransportWithListener(UcxListener listener,
                                                                          const UcxOptions& options) {
  if (options.addresses.empty()) return absl::InvalidArgumentError("ucx.addresses: empty");
  if (options.slot < 0 || options.slot >= static_cast<int>(options.addresses.size())) {
    return absl::InvalidArgumentError(absl::StrCat("ucx.slot: ", options.slot, " outside the group"));
  }
  auto t = std::make_unique<UcxTransport>(std::move(listener), options);
  absl::Status s = t->Connect();
  if (!s.ok()) return s;
  return std::unique_ptr<Transport>(std::move(t));
}

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxOptions& options) {
  if (options.slot < 0 || options.slot >= static_cast<int>(options.addresses.size())) {
    return absl::InvalidArgumentError(absl::StrCat("ucx.slot: ", options.slot, " outside the group"));
  }
  auto listener = CreateUcxListener(options.addresses[options.slot], options.net_devices);
  if (!listener.ok()) return listener.status();
  return CreateUcxTransportWithListener(*std::move(listener), options);
}

absl::StatusOr<std::vector<std::string>> RendezvousAddresses(const std::string& dir, int slot, int size,
                                                             const std::string& address, absl::Duration timeout) {
  if (absl::Status s = PublishFile(dir, absl::StrCat(slot, ".addr"), address); !s.ok()) return s;
  std::vector<std::string> names;
  for (int i = 0; i < size; ++i) names.push_back(absl::StrCat(i, ".addr"));
  return AwaitFiles(dir, names, timeout);
}

}  // namespace moe
