#include "util/cuda_plugin.h"

#include <ATen/detail/CUDAHooksInterface.h>

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "util/fs.h"
#include "util/log.h"

namespace zb {

namespace {

// Where the plugin is: beside the program, in an installed tree's lib/, or in the build tree's
// src/ (the programs in apps/ and tests/ beside it).
std::vector<std::string> plugin_paths() {
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return {};
  const std::string bin = parent_directory(std::string(exe, static_cast<size_t>(n)));
  return {bin + "/libzb_cuda.so", parent_directory(bin) + "/lib/libzb_cuda.so",
          parent_directory(bin) + "/src/libzb_cuda.so"};
}

struct Loaded {
  void* plugin = nullptr;
  std::string path;
  std::string error;  // said at the first use, not before main
};

Loaded load_plugin() {
  Loaded loaded;
#ifdef ZB_WITH_CUDA
  const char* mode = std::getenv("ZB_CUDA_PLUGIN");
  const std::string asked = mode ? mode : "";
  if (asked == "off") return loaded;
  // Without the driver no GPU can run: the CPU programs never load CUDA.
  if (asked != "on" && !::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) return loaded;
  std::string tried;
  for (const std::string& path : plugin_paths()) {
    if (!path_exists(path)) continue;
    // Global: LibTorch's CUDA libraries find others by name later (cuBLASLt, NVRTC).
    loaded.plugin = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!loaded.plugin) {
      tried += "\n  " + path + ": " + ::dlerror();
      continue;
    }
    loaded.path = path;
    // The stub ATen keeps when asked about CUDA before its CUDA library was loaded throws here.
    try {
      (void)at::detail::getCUDAHooks().versionCUDART();
    } catch (const std::exception&) {
      loaded.error = "ATen was asked about CUDA before the GPU plugin " + path + " loaded, so it runs without CUDA (is "
                     "KINETO_USE_DAEMON set? LibTorch's profiler asks at its start then); unset it, or set "
                     "ZB_CUDA_PLUGIN=off to train on the CPU";
    }
    return loaded;
  }
  loaded.error = "this machine has the NVIDIA driver, but the GPU side of the programs (libzb_cuda.so) does not load:" +
                 (tried.empty() ? std::string(" not beside the program, in ../lib or in ../src") : tried) +
                 "\n(ZB_CUDA_PLUGIN=off runs on the CPU without it)";
#endif
  return loaded;
}

// Before main: ahead of anything that could ask ATen about CUDA (seeding a generator does).
const Loaded loaded = load_plugin();

}  // namespace

void* cuda_plugin_symbol(const char* name) {
  static const bool said = [] {
    if (!loaded.error.empty()) throw std::runtime_error(loaded.error);
    if (loaded.plugin) log::info("GPU side of the programs loaded: " + loaded.path);
    return true;
  }();
  (void)said;
  if (!loaded.plugin) return nullptr;
  void* entry = ::dlsym(loaded.plugin, name);
  if (!entry) throw std::runtime_error(std::string("the GPU plugin has no ") + name + ": rebuild it with the programs");
  return entry;
}

void cuda_plugin_mismatch(const char* name) {
  throw std::runtime_error("the GPU plugin " + loaded.path + " was built from other sources than this program (its " +
                           name + " table differs): rebuild the two together");
}

}  // namespace zb
