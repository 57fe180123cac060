#include "transport/cuda/cu_driver.hpp"

#include <dlfcn.h>

#include <mutex>

#include "common/check.hpp"

namespace flatep::transport {

namespace {

#define FLATEP_CU_STRINGIFY_EXPANDED(x) FLATEP_CU_STRINGIFY(x)
#define FLATEP_CU_STRINGIFY(x) #x

struct LoadedDriver {
    CuDriver driver;
    bool ok = false;
    std::string why;
};

LoadedDriver load() {
    LoadedDriver loaded;
    void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
        const char* error = ::dlerror();
        loaded.why = detail::concat("cannot load libcuda.so.1 (", error != nullptr ? error : "unknown error", ")");
        return loaded;
    }
    // The library stays loaded for the life of the process.
#define FLATEP_CU_DRIVER_LOAD(name)                                                                                 \
    loaded.driver.name = reinterpret_cast<decltype(&::name)>(::dlsym(library, FLATEP_CU_STRINGIFY_EXPANDED(name))); \
    if (loaded.driver.name == nullptr) {                                                                            \
        loaded.why = "libcuda.so.1 has no " FLATEP_CU_STRINGIFY_EXPANDED(name) " (driver too old?)";                \
        return loaded;                                                                                              \
    }
    FLATEP_CU_DRIVER_FUNCTIONS(FLATEP_CU_DRIVER_LOAD)
#undef FLATEP_CU_DRIVER_LOAD
    loaded.ok = true;
    return loaded;
}

}  // namespace

const CuDriver* cu_driver(std::string* why) {
    static const LoadedDriver loaded = load();
    if (!loaded.ok && why != nullptr) *why = loaded.why;
    return loaded.ok ? &loaded.driver : nullptr;
}

std::string cu_error_text(const CuDriver& driver, CUresult result, const char* what) {
    const char* name = nullptr;
    if (driver.cuGetErrorName(result, &name) != CUDA_SUCCESS) name = nullptr;
    return detail::concat(what, " failed: ", name != nullptr ? name : "unknown CUresult ",
                          name ? "" : std::to_string(int(result)));
}

}  // namespace flatep::transport
