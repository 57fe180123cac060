// A test transport that is another one in all but its bootstrap: B, made from the inner transport's bootstrap, stands
// for a broken custom transport's (one that mixes up the ranks' blobs, or cuts one short), so that tests see what the
// library does with it.
#pragma once

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "flatep/transport.hpp"

namespace flatep::testing {

template <class B>
class BootstrapTransport final : public Transport {
  public:
    BootstrapTransport(std::shared_ptr<Transport> inner, const char* name)
        : inner_(std::move(inner)), bootstrap_(inner_->bootstrap()), name_(name) {}
    int rank() const override { return inner_->rank(); }
    int num_ranks() const override { return inner_->num_ranks(); }
    MemoryKind memory_kind() const override { return inner_->memory_kind(); }
    const char* name() const override { return name_; }
    SymmetricRegion allocate(size_t bytes) override { return inner_->allocate(bytes); }
    void release(SymmetricRegion& region) noexcept override { inner_->release(region); }
    Bootstrap& bootstrap() override { return bootstrap_; }
    int device() const override { return inner_->device(); }
    std::unique_ptr<DeviceBinding> bind_device() override { return inner_->bind_device(); }
    size_t granularity() const override { return inner_->granularity(); }
    LocalMemory allocate_local(size_t bytes) override { return inner_->allocate_local(bytes); }
    void release_local(LocalMemory& memory) noexcept override { inner_->release_local(memory); }
    MappedView map_view(size_t bytes, const std::vector<ViewPiece>& pieces) override {
        return inner_->map_view(bytes, pieces);
    }
    void unmap_view(MappedView& view) noexcept override { inner_->unmap_view(view); }
    const B& custom_bootstrap() const { return bootstrap_; }

  private:
    std::shared_ptr<Transport> inner_;  // before bootstrap_, which is made from it
    B bootstrap_;
    const char* name_;
};

}  // namespace flatep::testing
