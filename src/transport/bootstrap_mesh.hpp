// Bootstrap over a full mesh of connected Unix sockets (one per peer): all_gather sends the blob to every peer and
// receives every peer's blob (ipc::exchange), so each rank names exactly the peers that did not arrive. Built by
// the fork launcher (socketpairs) and the socket rendezvous (abstract sockets).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "flatep/transport.hpp"
#include "transport/ipc_socket.hpp"

namespace flatep::transport {

class MeshBootstrap final : public Bootstrap {
  public:
    // sockets[peer]: a connected socket to every peer (invalid at `rank`). Exchanges pids (a first all_gather) so
    // that errors and the ipc transport can name and check processes.
    MeshBootstrap(int rank, int size, std::vector<ipc::Fd> sockets, double timeout_s, std::string what);

    int rank() const override { return rank_; }
    int size() const override { return size_; }
    std::vector<std::string> all_gather(const std::string& blob) override;

    double timeout_s() const { return timeout_s_; }
    void set_timeout_s(double seconds) { timeout_s_ = seconds; }
    pid_t pid_of(int rank) const { return pids_[rank]; }
    std::string name_peer(int rank) const;

  private:
    int rank_;
    int size_;
    std::vector<ipc::Fd> sockets_;
    std::vector<int> raw_sockets_;
    std::vector<pid_t> pids_;
    double timeout_s_;
    std::string what_;
    uint32_t num_calls_ = 0;
};

}  // namespace flatep::transport
