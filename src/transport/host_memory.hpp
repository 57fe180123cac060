// Shared host memory backed by memfd (anonymous files): create, map, map again at a fixed address inside a
// reserved virtual range, unmap, close. Transport-agnostic: the local transport maps every rank's memfd in one
// process, the ipc transport passes the same fds to other processes (SCM_RIGHTS), and both map memfds back to back
// in one reserved range for views (Transport::map_view, e.g. ExpertPools' contiguous compute views).
//
// Granularity is the page size: sizes and offsets passed to map* must be page multiples (round_up_pages).
// Every function that can fail throws flatep::Error(kRuntime) naming the call and errno; unmap / close never
// throw (they log).
#pragma once

#include <cstddef>

namespace flatep::transport::host_memory {

size_t page_size();
size_t round_up_pages(size_t bytes);

// memfd_create(name) + ftruncate(bytes): a zero-filled shared file of `bytes` (a page multiple, > 0). Returns the fd.
int create(size_t bytes, const char* name);

// mmap(MAP_SHARED, read/write) of [offset, offset + bytes) of fd at an address the kernel picks.
void* map(int fd, size_t bytes, size_t offset = 0);

// Reserves `bytes` of address space (PROT_NONE, no memory behind it); fill it with map_fixed, free it with unmap.
void* reserve(size_t bytes);

// Maps [offset, offset + bytes) of fd at exactly `address` (MAP_FIXED | MAP_SHARED), which must lie inside a range
// returned by reserve() (MAP_FIXED silently replaces whatever was mapped there).
void map_fixed(void* address, int fd, size_t bytes, size_t offset = 0);

// munmap; logs on failure, never throws. Null / zero-size calls are no-ops.
void unmap(void* address, size_t bytes) noexcept;

// close(fd); logs on failure, never throws. Negative fds are ignored.
void close_fd(int fd) noexcept;

// A new descriptor (close-on-exec) of the same file as fd: keeps the file mappable after its owner closes fd.
int dup_fd(int fd);

}  // namespace flatep::transport::host_memory
