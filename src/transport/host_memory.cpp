#include "transport/host_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

#include "common/check.hpp"
#include "common/log.hpp"
#include "common/math.hpp"

namespace flatep::transport::host_memory {

size_t page_size() {
    static const size_t size = size_t(sysconf(_SC_PAGESIZE));
    return size;
}

size_t round_up_pages(size_t bytes) { return round_up(bytes, page_size()); }

namespace {
void check_granularity(size_t bytes, size_t offset, const char* what) {
    FLATEP_CHECK(bytes > 0 && bytes % page_size() == 0, what, ": bytes must be a positive multiple of the page size (",
                 page_size(), "), got ", bytes);
    FLATEP_CHECK(offset % page_size() == 0, what, ": offset must be a multiple of the page size (", page_size(),
                 "), got ", offset);
}
}  // namespace

int create(size_t bytes, const char* name) {
    check_granularity(bytes, 0, "host_memory::create");
    const int fd = memfd_create(name, MFD_CLOEXEC);
    FLATEP_SYS_CHECK(fd >= 0, detail::concat("memfd_create(", name, ")"));
    if (ftruncate(fd, off_t(bytes)) != 0) {
        const std::string text = detail::errno_text();
        close(fd);
        FLATEP_THROW(ErrorCategory::kRuntime, "ftruncate(memfd ", name, ", ", bytes, " bytes) failed: ", text);
    }
    return fd;
}

void* map(int fd, size_t bytes, size_t offset) {
    check_granularity(bytes, offset, "host_memory::map");
    void* address = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, off_t(offset));
    FLATEP_SYS_CHECK(address != MAP_FAILED, detail::concat("mmap(fd ", fd, ", ", bytes, " bytes)"));
    return address;
}

void* reserve(size_t bytes) {
    check_granularity(bytes, 0, "host_memory::reserve");
    void* address = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    FLATEP_SYS_CHECK(address != MAP_FAILED, detail::concat("mmap(PROT_NONE reserve of ", bytes, " bytes)"));
    return address;
}

void map_fixed(void* address, int fd, size_t bytes, size_t offset) {
    check_granularity(bytes, offset, "host_memory::map_fixed");
    FLATEP_CHECK(reinterpret_cast<uintptr_t>(address) % page_size() == 0,
                 "host_memory::map_fixed: address must be page aligned, got ", address);
    void* got = mmap(address, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, off_t(offset));
    FLATEP_SYS_CHECK(got != MAP_FAILED,
                     detail::concat("mmap(MAP_FIXED at ", address, ", fd ", fd, ", ", bytes, " bytes)"));
    FLATEP_CHECK_RUNTIME(got == address, "mmap(MAP_FIXED) returned ", got, " instead of ", address);
}

void unmap(void* address, size_t bytes) noexcept {
    if (address == nullptr || bytes == 0) return;
    if (munmap(address, bytes) != 0) {
        FLATEP_LOG_WARN("munmap(", address, ", ", bytes, " bytes) failed: ", detail::errno_text());
    }
}

void close_fd(int fd) noexcept {
    if (fd < 0) return;
    if (close(fd) != 0) FLATEP_LOG_WARN("close(fd ", fd, ") failed: ", detail::errno_text());
}

int dup_fd(int fd) {
    const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    FLATEP_SYS_CHECK(copy >= 0, detail::concat("fcntl(F_DUPFD_CLOEXEC of fd ", fd, ")"));
    return copy;
}

}  // namespace flatep::transport::host_memory
