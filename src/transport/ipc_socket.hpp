// Unix-domain socket plumbing for the multi-process transport (design §7): abstract-namespace listeners, a
// full mesh of connected sockets checked with SO_PEERCRED, framed all-to-all exchanges that may carry one file
// descriptor per message (SCM_RIGHTS). Every blocking step takes a deadline; nothing here waits forever.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace flatep::transport::ipc {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

Deadline deadline_after(double seconds);

// Owning file descriptor (closes on destruction; close errors are logged, never thrown).
class Fd {
  public:
    Fd() = default;
    explicit Fd(int fd) : fd_(fd) {}
    Fd(const Fd&) = delete;
    Fd& operator=(const Fd&) = delete;
    Fd(Fd&& other) noexcept : fd_(other.release()) {}
    Fd& operator=(Fd&& other) noexcept;
    ~Fd() { reset(); }
    int get() const { return fd_; }
    bool valid() const { return fd_ >= 0; }
    int release() {
        const int fd = fd_;
        fd_ = -1;
        return fd;
    }
    void reset(int fd = -1) noexcept;

  private:
    int fd_ = -1;
};

void close_quietly(int fd) noexcept;

struct PeerCredentials {
    pid_t pid = 0;
    uid_t uid = 0;
    gid_t gid = 0;
};
// SO_PEERCRED of a connected Unix socket: the peer process as of connect() / listen().
PeerCredentials peer_credentials(int socket_fd);

// Binds and listens on the abstract-namespace name "\0<name>" (nonblocking, close-on-exec). Throws kRuntime when
// the name is taken (another job with the same name runs) or on any other failure.
Fd listen_abstract(const std::string& name, int backlog);

// Random bytes from the kernel (getrandom), as lowercase hex.
std::string random_hex(size_t num_bytes);

// How each rank is named in error messages: "rank 3 (pid 4242)".
using PeerNamer = std::function<std::string(int peer)>;

// One message of an exchange: a payload and optionally one descriptor (sent with SCM_RIGHTS; the sender keeps
// its copy, the receiver owns the one it gets).
struct Message {
    std::string payload;
    int fd = -1;
};

// All-to-all over a mesh: sends out[p] to every peer p != self and receives one message from every peer, driven by
// poll() so large messages cannot deadlock. `tag` identifies the collective (both sides must agree). Waits until
// every peer has delivered or left (closed its socket), or timeout_s passes; then, if a peer is missing, closes
// every received descriptor and throws kTimeout naming each missing peer (timed out or left), or kMismatch when a
// peer sent another collective's message. `what` names the collective in the message ("all_gather #3").
std::vector<Message> exchange(const std::vector<int>& sockets, int self, const std::vector<Message>& out, uint32_t tag,
                              double timeout_s, const std::string& what, const PeerNamer& name_peer);

// Rank credentials a mesh accepts: with `expected_pids` set, a peer claiming rank r must be process
// expected_pids[r]; otherwise any process of this uid whose SO_PEERCRED pid matches the pid in its hello.
struct MeshSpec {
    std::string name_prefix;  // sockets are "<name_prefix>-<rank>" in the abstract namespace
    std::string token;        // shared secret / job id carried in the hello (at most 64 bytes)
    int rank = 0;
    int size = 1;
    std::vector<pid_t> expected_pids;  // empty: any pid of this uid (checked against the hello)
    double timeout_s = 100.0;
    std::string what;  // "socket rendezvous 'job'" or "ipc transport": prefix of error and log messages
};

std::string mesh_socket_name(const MeshSpec& spec, int rank);

// Builds the full mesh: connects to every lower rank (retrying until it listens) and accepts every higher rank on
// `listener` (from listen_abstract(mesh_socket_name(spec, spec.rank))). Both sides exchange hellos and check the
// other's SO_PEERCRED uid and pid; a connection that fails a check is refused (closed), logged with
// FLATEP_LOG_WARN and counted in *num_refused. Returns sockets[peer] (nonblocking; -1 at spec.rank). Throws
// kTimeout naming the ranks that did not connect within spec.timeout_s.
std::vector<Fd> build_mesh(const MeshSpec& spec, int listener, int* num_refused);

}  // namespace flatep::transport::ipc
