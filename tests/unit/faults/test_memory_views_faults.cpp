// MemoryViews (src/transport/memory_views.cpp) given handles that are not its own: release_local and unmap_view
// refuse a foreign id, a live id at another address and an address without id (one warning each), ignore an empty
// handle, and leave the live memory alone; the destructor frees what is still live.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "transport/host_memory.hpp"
#include "transport/ipc_memory.hpp"
#include "transport/memory_views.hpp"

namespace flatep {
namespace {

TEST(MemoryViewsFaults, ForeignHandlesAreRefusedAndLiveMemoryIsFreedAtTheEnd) {
    const size_t page = transport::host_memory::page_size();
    auto memory = transport::make_host_ipc_memory();
    auto views = std::make_unique<transport::MemoryViews>(*memory, 1);
    LocalMemory local = views->allocate_local(page);
    ViewPiece piece;
    piece.local_id = local.id;
    MappedView view = views->map_view(2 * page, {piece}, [](int, int) { return nullptr; });
    local.ptr[0] = 7;
    EXPECT_EQ(view.base[0], 7);  // the view maps the local memory

    LocalMemory foreign = local, moved = local, no_id = local, empty_local;
    foreign.id = local.id + 100;
    moved.ptr += 1;
    no_id.id = -1;
    MappedView foreign_view = view, moved_view = view, no_id_view = view, empty_view;
    foreign_view.id = view.id + 100;
    moved_view.base += page;
    no_id_view.id = -1;
    ::testing::internal::CaptureStderr();
    views->release_local(foreign);
    views->release_local(moved);
    views->release_local(no_id);
    views->release_local(empty_local);
    views->unmap_view(foreign_view);
    views->unmap_view(moved_view);
    views->unmap_view(no_id_view);
    views->unmap_view(empty_view);
    const std::string log = ::testing::internal::GetCapturedStderr();
    auto local_warning = [](int id) {
        return "[flatep warning] release_local: local memory id " + std::to_string(id) +
               " is not live local memory of this transport; ignored\n";
    };
    auto view_warning = [](int id) {
        return "[flatep warning] unmap_view: view id " + std::to_string(id) +
               " is not a live view of this transport; ignored\n";
    };
    EXPECT_EQ(log, local_warning(local.id + 100) + local_warning(local.id) + local_warning(-1) +
                       view_warning(view.id + 100) + view_warning(view.id) + view_warning(-1));
    EXPECT_EQ(views->num_live_locals(), 1);
    EXPECT_EQ(views->num_live_views(), 1);
    EXPECT_EQ(foreign.id, local.id + 100);  // a refused handle is left as it was
    EXPECT_EQ(view.base[0], 7);
    views.reset();  // frees the live view and local memory
}

}  // namespace
}  // namespace flatep
