#include "runtime/backend.hpp"

namespace flatep::runtime {

std::unique_ptr<BufferBackend> make_buffer_backend(const BufferSite& site) {
    return site.transport->memory_kind() == MemoryKind::kDevice ? make_device_buffer_backend(site)
                                                                : make_host_buffer_backend(site);
}

std::unique_ptr<PoolsBackend> make_pools_backend(std::shared_ptr<Transport> transport, CollectiveGuard* guard) {
    return transport->memory_kind() == MemoryKind::kDevice ? make_device_pools_backend(std::move(transport))
                                                           : make_host_pools_backend(guard);
}

}  // namespace flatep::runtime
