// The `ipc` transport (design §7): one process per rank. Construction (collective over the bootstrap): every rank
// announces its pid and uid and a random nonce; rank 0's nonce names the job's sockets ("@flatep-<nonce>-<rank>",
// abstract namespace); every rank listens, a bootstrap barrier, then the ranks build a full socket mesh in which
// every connection is checked with SO_PEERCRED against the announced pid and uid (ipc::build_mesh).
// allocate(): each rank creates its region (IpcMemory), sends its descriptor to every peer over the mesh
// (SCM_RIGHTS) and maps every peer's, keeping what maps a peer's region again (host: a dup of its fd; device: the
// imported handle) until release(). release() is local (unmap, close) and may run at any time: a peer's memory
// stays valid while a mapping of it exists (views included). Local memory and views: MemoryViews over the same
// IpcMemory.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "flatep/transport.hpp"
#include "transport/ipc_memory.hpp"
#include "transport/ipc_socket.hpp"
#include "transport/memory_views.hpp"

namespace flatep::transport {

struct IpcOptions {
    double timeout_s = 0;       // <= 0: FLATEP_TIMEOUT_S
    bool same_process = false;  // ranks may share one pid (threads of one process: virtual ranks)
    // Test hook: called with this rank's socket name once it listens, before the ranks connect.
    std::function<void(const std::string& socket_name)> on_listening;
};

class IpcTransport final : public Transport {
  public:
    IpcTransport(std::shared_ptr<Bootstrap> bootstrap, std::unique_ptr<IpcMemory> memory, const IpcOptions& options);
    ~IpcTransport() override;
    IpcTransport(const IpcTransport&) = delete;
    IpcTransport& operator=(const IpcTransport&) = delete;

    int rank() const override { return rank_; }
    int num_ranks() const override { return num_ranks_; }
    MemoryKind memory_kind() const override { return memory_->kind(); }
    const char* name() const override { return "ipc"; }
    SymmetricRegion allocate(size_t bytes) override;
    void release(SymmetricRegion& region) noexcept override;
    Bootstrap& bootstrap() override { return *bootstrap_; }
    int device() const override { return memory_->device(); }
    std::unique_ptr<DeviceBinding> bind_device() override { return memory_->bind_device(); }
    size_t granularity() const override { return memory_->granularity(); }
    LocalMemory allocate_local(size_t bytes) override { return views_->allocate_local(bytes); }
    void release_local(LocalMemory& memory) noexcept override { views_->release_local(memory); }
    MappedView map_view(size_t bytes, const std::vector<ViewPiece>& pieces) override;
    void unmap_view(MappedView& view) noexcept override { views_->unmap_view(view); }

    // Connections refused while the mesh was built (foreign processes).
    int num_refused() const { return num_refused_; }
    pid_t pid_of(int rank) const { return pids_[rank]; }
    int num_live_regions() const { return static_cast<int>(allocations_.size()); }
    int num_live_locals() const { return views_->num_live_locals(); }
    int num_live_views() const { return views_->num_live_views(); }

  private:
    struct Allocation {
        IpcMapping local;
        std::vector<IpcMapping> peers;  // empty at rank_ and where not mapped
        size_t mapped_bytes = 0;
    };
    void free_allocation(Allocation& allocation) noexcept;
    std::string name_peer(int rank) const;

    std::shared_ptr<Bootstrap> bootstrap_;
    std::unique_ptr<IpcMemory> memory_;
    std::unique_ptr<MemoryViews> views_;  // over memory_ (destroyed first)
    int rank_ = 0;
    int num_ranks_ = 1;
    std::vector<pid_t> pids_;
    std::vector<ipc::Fd> sockets_;
    std::vector<int> raw_sockets_;
    std::map<int, Allocation> allocations_;
    int num_allocations_ = 0;
    int num_refused_ = 0;
};

}  // namespace flatep::transport
