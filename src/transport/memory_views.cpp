#include "transport/memory_views.hpp"

#include <algorithm>
#include <cstdint>

#include "common/check.hpp"
#include "common/log.hpp"

namespace flatep::transport {

MemoryViews::~MemoryViews() {
    for (auto& [id, view] : views_) memory_.free_range(view.base, view.bytes, view.mapped);
    for (auto& [id, local] : locals_) memory_.destroy(local);
}

int MemoryViews::num_live_locals() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int>(locals_.size());
}

int MemoryViews::num_live_views() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int>(views_.size());
}

LocalMemory MemoryViews::allocate_local(size_t bytes) {
    const size_t granularity = memory_.granularity();
    FLATEP_CHECK(bytes > 0 && bytes <= SIZE_MAX - granularity, "allocate_local: bytes must be in [1, ",
                 SIZE_MAX - granularity, "], got ", bytes);
    const size_t mapped_bytes = (bytes + granularity - 1) / granularity * granularity;
    IpcMapping mapping = memory_.create(mapped_bytes, /*exported=*/false);
    std::lock_guard<std::mutex> lock(mutex_);
    const int id = next_local_id_++;
    locals_.emplace(id, mapping);
    return LocalMemory{mapping.ptr, mapping.mapped_bytes, id};
}

void MemoryViews::release_local(LocalMemory& memory) noexcept {
    if (memory.id < 0 && memory.ptr == nullptr) return;  // never allocated, or already released
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = locals_.find(memory.id);
    if (it == locals_.end() || it->second.ptr != memory.ptr) {
        FLATEP_LOG_WARN("release_local: local memory id ", memory.id, " is not live local memory of this transport; ",
                        "ignored");
        return;
    }
    memory_.destroy(it->second);
    locals_.erase(it);
    memory = LocalMemory{};
}

MappedView MemoryViews::map_view(size_t bytes, const std::vector<ViewPiece>& pieces, const FindRegion& find_region) {
    const size_t granularity = memory_.granularity();
    FLATEP_CHECK(bytes > 0 && bytes % granularity == 0,
                 "map_view: bytes must be a positive multiple of the granularity (", granularity, "), got ", bytes);
    FLATEP_CHECK(!pieces.empty(), "map_view: pieces is empty; a view maps at least one piece");
    struct Placed {
        size_t index;
        size_t offset;
        const IpcMapping* memory;
    };
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Placed> placed;
    for (size_t i = 0; i < pieces.size(); ++i) {
        const ViewPiece& piece = pieces[i];
        FLATEP_CHECK((piece.region_id >= 0) != (piece.local_id >= 0), "map_view: piece ", i,
                     " must name exactly one of region_id and local_id, got region_id ", piece.region_id,
                     " and local_id ", piece.local_id);
        const IpcMapping* memory = nullptr;
        if (piece.region_id >= 0) {
            FLATEP_CHECK(piece.rank >= 0 && piece.rank < num_ranks_, "map_view: piece ", i, ": rank must be in [0, ",
                         num_ranks_, "), got ", piece.rank);
            memory = find_region(piece.region_id, piece.rank);
            FLATEP_CHECK(memory != nullptr, "map_view: piece ", i, ": region_id ", piece.region_id,
                         " is not a live region of this transport");
        } else {
            const auto it = locals_.find(piece.local_id);
            FLATEP_CHECK(it != locals_.end(), "map_view: piece ", i, ": local_id ", piece.local_id,
                         " is not live local memory of this transport");
            memory = &it->second;
        }
        FLATEP_CHECK(piece.offset % granularity == 0, "map_view: piece ", i,
                     ": offset must be a multiple of the granularity (", granularity, "), got ", piece.offset);
        FLATEP_CHECK(piece.offset < bytes && memory->mapped_bytes <= bytes - piece.offset, "map_view: piece ", i, " (",
                     memory->mapped_bytes, " bytes at offset ", piece.offset, ") ends past the view's ", bytes,
                     " bytes");
        placed.push_back({i, piece.offset, memory});
    }
    std::stable_sort(placed.begin(), placed.end(),
                     [](const Placed& a, const Placed& b) { return a.offset < b.offset; });
    for (size_t k = 1; k < placed.size(); ++k) {
        const Placed& before = placed[k - 1];
        const Placed& after = placed[k];
        FLATEP_CHECK(after.offset >= before.offset + before.memory->mapped_bytes, "map_view: piece ", after.index, " (",
                     after.memory->mapped_bytes, " bytes at offset ", after.offset, ") overlaps piece ", before.index,
                     " (", before.memory->mapped_bytes, " bytes at offset ", before.offset, ")");
    }

    View view;
    view.bytes = bytes;
    view.base = memory_.reserve(bytes);
    try {
        for (const Placed& p : placed) {
            memory_.map_at(view.base + p.offset, *p.memory);
            view.mapped.emplace_back(p.offset, p.memory->mapped_bytes);
        }
    } catch (...) {
        memory_.free_range(view.base, view.bytes, view.mapped);
        throw;
    }
    const int id = next_view_id_++;
    views_.emplace(id, view);
    return MappedView{view.base, view.bytes, id};
}

void MemoryViews::unmap_view(MappedView& view) noexcept {
    if (view.id < 0 && view.base == nullptr) return;  // never mapped, or already unmapped
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = views_.find(view.id);
    if (it == views_.end() || it->second.base != view.base) {
        FLATEP_LOG_WARN("unmap_view: view id ", view.id, " is not a live view of this transport; ignored");
        return;
    }
    memory_.free_range(it->second.base, it->second.bytes, it->second.mapped);
    views_.erase(it);
    view = MappedView{};
}

}  // namespace flatep::transport
