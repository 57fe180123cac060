// `local` host transport: R ranks as threads of one process (design §7), the CPU backend's world.
//
//   LocalHostWorld world(4);                        // shared rendezvous of 4 ranks
//   std::shared_ptr<Transport> t = world.transport(rank);   // one per rank thread
//
// allocate() is collective across the R threads: each rank creates a memfd for its own region and every rank maps
// every peer's memfd itself (peers[p] is this rank's own mapping of p's memory), so a rank's release() only
// unmaps its own mappings and closes its own fd: it is safe at any time, needs no peer and never throws.
// all_gather() is a rendezvous under a mutex that fails after the transport's timeout naming the first peer
// that did not arrive.
#pragma once

#include <memory>
#include <vector>

#include "flatep/transport.hpp"

namespace flatep::transport {

class LocalHostWorld {
  public:
    // timeout_s: initial timeout of every rank's transport (Transport::set_timeout_s changes one rank's);
    // <= 0 takes FLATEP_TIMEOUT_S (default 100 s).
    explicit LocalHostWorld(int num_ranks, double timeout_s = 0.0);
    ~LocalHostWorld();
    LocalHostWorld(const LocalHostWorld&) = delete;
    LocalHostWorld& operator=(const LocalHostWorld&) = delete;

    int num_ranks() const;
    // The transport of `rank` (created on first call, the same object afterwards). Transports keep the shared
    // rendezvous alive, so they may outlive the world object.
    std::shared_ptr<Transport> transport(int rank);
    // The world's all-gather alone, as one Bootstrap per rank (for a transport built over it, e.g. the ipc transport
    // of virtual ranks): each wait bounded by the world's timeout. The bootstraps keep the rendezvous alive.
    std::vector<std::shared_ptr<Bootstrap>> bootstraps();

    struct State;

  private:
    std::shared_ptr<State> state_;
};

}  // namespace flatep::transport
