// Transport::allocate_local / release_local / map_view / unmap_view written once over an IpcMemory, for every
// transport: the transport owns one MemoryViews and tells it where a region piece's memory is (find_region).
// Checks every argument before mapping anything and names the bad piece; frees what is still live at destruction.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "flatep/transport.hpp"
#include "transport/ipc_memory.hpp"

namespace flatep::transport {

class MemoryViews {
  public:
    // (region_id, rank) -> that rank's region as mapped here (its fd / handle and mapped_bytes), or nullptr when
    // region_id is no live region of the transport. rank is already checked against num_ranks.
    using FindRegion = std::function<const IpcMapping*(int region_id, int rank)>;

    // memory must outlive this object; num_ranks bounds ViewPiece::rank.
    MemoryViews(IpcMemory& memory, int num_ranks) : memory_(memory), num_ranks_(num_ranks) {}
    ~MemoryViews();  // unmaps the views and frees the local memory still live; never throws
    MemoryViews(const MemoryViews&) = delete;
    MemoryViews& operator=(const MemoryViews&) = delete;

    LocalMemory allocate_local(size_t bytes);
    void release_local(LocalMemory& memory) noexcept;
    MappedView map_view(size_t bytes, const std::vector<ViewPiece>& pieces, const FindRegion& find_region);
    void unmap_view(MappedView& view) noexcept;

    int num_live_locals() const;
    int num_live_views() const;

  private:
    struct View {
        uint8_t* base = nullptr;
        size_t bytes = 0;
        std::vector<std::pair<size_t, size_t>> mapped;  // (offset, bytes) of each piece
    };

    IpcMemory& memory_;
    const int num_ranks_;
    mutable std::mutex mutex_;  // layers may be dropped on any thread (Python's garbage collector)
    std::map<int, IpcMapping> locals_;
    std::map<int, View> views_;
    int next_local_id_ = 0;
    int next_view_id_ = 0;
};

}  // namespace flatep::transport
