// L1c: R processes sharing one GPU through the ipc transport on device memory (CUDA VMM regions exported as POSIX
// file descriptors, passed over the socket mesh, imported and mapped by every peer). With --gpu-per-rank (L2), rank
// r uses GPU r % device count, so every peer mapping of another rank's region is memory of another GPU. Plain main,
// no GoogleTest: prints what it checked, returns non-zero on failure, exits 0 with a message when there is no GPU.
//
//   ipc_gpu_main [--gpu-per-rank] [R ...]   (default: 2 4; FLATEP_TIMEOUT_S bounds every collective, default 60 s)
//
// Without MPS the processes' work on one GPU time-slices; this test never spins on the GPU (every cross-process
// wait is a host bootstrap barrier), so it only needs generous timeouts, not co-residency. Each cycle also maps a
// view of local memory, its own and the next rank's region (Transport::map_view) with no CUDA context current.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "device_test_util.hpp"
#include "flatep/error.hpp"
#include "flatep/ipc.hpp"
#include "transport/cuda/cu_driver.hpp"

namespace {

using flatep::Bootstrap;
using flatep::MemoryKind;
using flatep::SymmetricRegion;
using flatep::Transport;

constexpr int kNoGpu = 77;

// The driver is loaded at run time (transport/cuda/cu_driver.hpp), so this binary starts without one and skips.
const flatep::transport::CuDriver* drv = nullptr;
#define CU(expr) FLATEP_CU_DRIVER_CHECK(*drv, expr)

#define EXPECT_OR_FAIL(cond, ...)                                         \
    do {                                                                  \
        if (!(cond)) {                                                    \
            std::fprintf(stderr, "rank %d: FAILED %s: %s\n", rank, #cond, \
                         flatep::detail::concat(__VA_ARGS__).c_str());    \
            return 1;                                                     \
        }                                                                 \
    } while (0)

uint32_t pattern(int owner, size_t word_idx) {
    return uint32_t(owner + 1) * 0x9e3779b9u ^ uint32_t(word_idx * 2654435761u);
}

// Runs in a child: the GPU is only touched after fork. Checks device 0, or every device with gpu_per_rank.
int probe_gpu(bool gpu_per_rank) {
    std::string why;
    if (flatep::transport::cu_driver(&why) == nullptr) {
        std::printf("no CUDA driver: %s\n", why.c_str());
        return kNoGpu;
    }
    drv = flatep::transport::cu_driver();
    if (drv->cuInit(0) != CUDA_SUCCESS) return kNoGpu;
    int count = 0;
    if (drv->cuDeviceGetCount(&count) != CUDA_SUCCESS || count == 0) return kNoGpu;
    bool usable = true;
    for (int ordinal = 0; ordinal < (gpu_per_rank ? count : 1); ++ordinal) {
        CUdevice device = 0;
        int vmm = 0, posix_fd = 0;
        drv->cuDeviceGet(&device, ordinal);
        drv->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device);
        drv->cuDeviceGetAttribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device);
        char name[256] = {};
        drv->cuDeviceGetName(name, sizeof(name), device);
        std::printf("GPU %d of %d: %s (VMM %d, POSIX fd handles %d)\n", ordinal, count, name, vmm, posix_fd);
        usable = usable && vmm && posix_fd;
    }
    return usable ? 0 : kNoGpu;
}

// Views (Transport::map_view) on device memory: [local memory | this rank's region | a gap | the next rank's
// region], made and unmade with no CUDA context current on this thread (the transport binds its own and leaves none
// current after). Words [0, R) of the regions are left alone: peers' remote writes may already be landing there.
int check_views(int rank, int num_ranks, int cycle, Transport& transport, const SymmetricRegion& region,
                CUcontext context, const std::shared_ptr<Bootstrap>& boot) {
    const int next = (rank + 1) % num_ranks, prev = (rank + num_ranks - 1) % num_ranks;
    const size_t g = transport.granularity(), num_words = region.bytes / 4;
    CU(cuCtxSetCurrent(nullptr));
    flatep::LocalMemory local = transport.allocate_local(g + 1);
    flatep::ViewPiece own_local, own_region, next_region;
    own_local.local_id = local.id;
    own_region.region_id = next_region.region_id = region.id;
    own_region.rank = rank;
    own_region.offset = local.bytes;
    next_region.rank = next;
    next_region.offset = local.bytes + region.mapped_bytes + g;
    flatep::MappedView view =
        transport.map_view(next_region.offset + region.mapped_bytes, {next_region, own_local, own_region});
    CUcontext current = nullptr;
    CU(cuCtxGetCurrent(&current));
    EXPECT_OR_FAIL(current == nullptr, "the transport left a CUDA context current");
    CU(cuCtxSetCurrent(context));
    EXPECT_OR_FAIL(local.bytes == 2 * g && view.bytes == 3 * g + 2 * region.mapped_bytes, "sizes: local ", local.bytes,
                   ", view ", view.bytes);
    const CUdeviceptr base = CUdeviceptr(view.base);
    std::vector<uint32_t> words(local.bytes / 4, 1);
    CU(cuMemcpyDtoH(words.data(), base, local.bytes));
    for (size_t i = 0; i < words.size(); ++i) EXPECT_OR_FAIL(words[i] == 0, "local memory word ", i, " not zero");
    for (size_t i = 0; i < words.size(); ++i) words[i] = pattern(100 + rank, i);
    CU(cuMemcpyHtoD(CUdeviceptr(local.ptr), words.data(), local.bytes));
    std::vector<uint32_t> seen(words.size(), 0);
    CU(cuMemcpyDtoH(seen.data(), base, local.bytes));
    EXPECT_OR_FAIL(seen == words, "the view's first piece is not the local memory");
    std::vector<uint32_t> host(num_words, 0);
    for (const auto& [owner, at] : {std::pair{rank, own_region.offset}, std::pair{next, next_region.offset}}) {
        CU(cuMemcpyDtoH(host.data(), base + at, num_words * 4));
        for (size_t i = num_ranks; i < num_words; ++i)
            EXPECT_OR_FAIL(host[i] == pattern(owner, i + cycle), "view of rank ", owner, "'s region: word ", i);
    }
    // Every rank has read its views before any rank writes through one (the write lands in a word read above).
    boot->all_gather("views read");
    // A write through the view lands in the next rank's region.
    CU(cuMemsetD32(base + next_region.offset + 4 * (num_words - 1), 0xbeef0000u + rank, 1));
    CU(cuCtxSynchronize());
    boot->all_gather("written through views");
    CU(cuMemcpyDtoH(host.data(), CUdeviceptr(region.local) + 4 * (num_words - 1), 4));
    EXPECT_OR_FAIL(host[0] == 0xbeef0000u + prev, "last word ", host[0], ", not rank ", prev,
                   "'s write through its view");
    // The view keeps the local memory after its release.
    CU(cuCtxSetCurrent(nullptr));
    transport.release_local(local);
    CU(cuCtxSetCurrent(context));
    CU(cuMemcpyDtoH(seen.data(), base, seen.size() * 4));
    EXPECT_OR_FAIL(seen == words, "local memory lost after release_local while a view maps it");
    CU(cuCtxSetCurrent(nullptr));
    transport.unmap_view(view);
    CU(cuCtxSetCurrent(context));
    EXPECT_OR_FAIL(view.base == nullptr && local.ptr == nullptr, "unmap_view / release_local did not clear");
    return 0;
}

int run_rank(int rank, std::shared_ptr<Bootstrap> boot, double timeout_s, bool gpu_per_rank) {
    const int num_ranks = boot->size();
    drv = flatep::transport::cu_driver();
    FLATEP_CHECK_RUNTIME(drv != nullptr, "no CUDA driver");
    CU(cuInit(0));
    int num_devices = 0;
    CU(cuDeviceGetCount(&num_devices));
    const int ordinal = gpu_per_rank ? rank % num_devices : 0;
    CUdevice device = 0;
    CUcontext context = nullptr;
    CU(cuDeviceGet(&device, ordinal));
    CU(cuDevicePrimaryCtxRetain(&context, device));
    CU(cuCtxSetCurrent(context));

    size_t free_before = 0, total = 0;
    const size_t kBytes = (size_t(3) << 20) + 4100;  // not a granularity multiple
    const size_t num_words = kBytes / 4;
    {
        std::unique_ptr<Transport> warmup = flatep::make_ipc_transport(boot, MemoryKind::kDevice, timeout_s);
        boot->all_gather("warm");
        CU(cuMemGetInfo(&free_before, &total));
        boot->all_gather("measured");
    }
    for (int cycle = 0; cycle < 3; ++cycle) {
        std::unique_ptr<Transport> transport = flatep::make_ipc_transport(boot, MemoryKind::kDevice, timeout_s);
        EXPECT_OR_FAIL(transport->memory_kind() == MemoryKind::kDevice, "kind");
        SymmetricRegion region = transport->allocate(kBytes);
        EXPECT_OR_FAIL(region.local_handle != 0 && region.local == region.peers[rank], "local handle/pointer");
        // Fresh regions are zero (the transport zeroes before exporting).
        std::vector<uint32_t> host(num_words, 1);
        CU(cuMemcpyDtoH(host.data(), CUdeviceptr(region.local), num_words * 4));
        for (size_t i = 0; i < num_words; ++i) EXPECT_OR_FAIL(host[i] == 0, "word ", i, " not zero");
        // Each rank fills its own region; then every rank reads every peer's through its mapping.
        for (size_t i = 0; i < num_words; ++i) host[i] = pattern(rank, i + cycle);
        CU(cuMemcpyHtoD(CUdeviceptr(region.local), host.data(), num_words * 4));
        CU(cuCtxSynchronize());
        boot->all_gather("filled");
        for (int p = 0; p < num_ranks; ++p) {
            CU(cuMemcpyDtoH(host.data(), CUdeviceptr(region.peers[p]), num_words * 4));
            for (size_t i = 0; i < num_words; ++i)
                EXPECT_OR_FAIL(host[i] == pattern(p, i + cycle), "cycle ", cycle, ": rank ", p, "'s word ", i, " = ",
                               host[i]);
        }
        boot->all_gather("read");
        if (check_views(rank, num_ranks, cycle, *transport, region, context, boot) != 0) return 1;
        // Remote writes: rank r sets word r of every peer's region (device memset through the peer mapping).
        for (int p = 0; p < num_ranks; ++p)
            CU(cuMemsetD32(CUdeviceptr(region.peers[p]) + 4 * rank, 0xf00d0000u + rank, 1));
        CU(cuCtxSynchronize());
        boot->all_gather("written");
        CU(cuMemcpyDtoH(host.data(), CUdeviceptr(region.local), num_ranks * 4));
        for (int p = 0; p < num_ranks; ++p)
            EXPECT_OR_FAIL(host[p] == 0xf00d0000u + p, "cycle ", cycle, ": word ", p, " written by rank ", p, " is ",
                           host[p]);
        boot->all_gather("checked");
        transport->release(region);
        boot->all_gather("released");
    }
    size_t free_after = 0;
    CU(cuMemGetInfo(&free_after, &total));
    // Every rank's 3 cycles allocated R regions of >= 3 MiB each; a leak of any of them shows here.
    const long long lost = (long long)free_before - (long long)free_after;
    EXPECT_OR_FAIL(lost < (long long)(2u << 20), "device memory leaked: ", lost, " bytes after 3 cycles");
    CU(cuDevicePrimaryCtxRelease(device));
    if (rank == 0)
        std::printf("  R=%d: every rank saw every peer's writes (3 cycles); free memory change %lld bytes\n", num_ranks,
                    -lost);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    flatep::gpu_test::IpcTestArgs args;
    if (!flatep::gpu_test::parse_ipc_test_args(argc, argv, {2, 4}, args)) return 2;
    const std::vector<int>& rank_counts = args.rank_counts;
    const bool gpu_per_rank = args.gpu_per_rank;
    const char* env_timeout = std::getenv("FLATEP_TIMEOUT_S");
    const double timeout_s = env_timeout != nullptr ? std::atof(env_timeout) : 60.0;

    // Probe in a child: a process that initialised CUDA cannot fork children that use it.
    const std::vector<int> probe = flatep::run_forked(
        1, [&](int, std::shared_ptr<Bootstrap>) { return probe_gpu(gpu_per_rank); }, {timeout_s, 120.0});
    std::fflush(stdout);
    if (probe[0] == kNoGpu) {
        std::printf("SKIP ipc_gpu_main: no GPU with VMM POSIX-fd handles\n");
        return 0;
    }
    if (probe[0] != 0) {
        std::printf("FAIL ipc_gpu_main: GPU probe exited with %d\n", probe[0]);
        return 1;
    }
    int failures = 0;
    for (const int num_ranks : rank_counts) {
        const auto start = std::chrono::steady_clock::now();
        const std::vector<int> codes = flatep::run_forked(
            num_ranks,
            [&](int rank, std::shared_ptr<Bootstrap> boot) { return run_rank(rank, boot, timeout_s, gpu_per_rank); },
            {timeout_s, 4 * timeout_s + 60});
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        bool ok = true;
        for (int r = 0; r < num_ranks; ++r) ok = ok && codes[r] == 0;
        std::string text;
        for (int r = 0; r < num_ranks; ++r) text += (r ? "," : "") + std::to_string(codes[r]);
        std::printf("%s ipc device regions R=%d%s (%.2f s; exit codes %s)\n", ok ? "PASS" : "FAIL", num_ranks,
                    gpu_per_rank ? " one GPU per rank" : "", seconds, text.c_str());
        if (!ok) {
            ++failures;
            std::printf("  repro: ipc_gpu_main%s %d\n", gpu_per_rank ? " --gpu-per-rank" : "", num_ranks);
        }
    }
    std::printf("%s\n", failures == 0 ? "ipc_gpu_main: all passed" : "ipc_gpu_main: FAILED");
    return failures == 0 ? 0 : 1;
}
