// The only translation unit that includes ProcessGroupGloo.hpp. The torch wheel does not ship
// gloo's headers (libtorch builds gloo statically and does not install it); Debian's libgloo-dev
// provides them. They are an older gloo than the one compiled into libtorch_cpu, so they serve as
// declarations only: we construct ProcessGroupGloo and its Options through libtorch's own
// out-of-line code, touch no gloo object ourselves, and hand back a plain c10d::Backend. The
// multi-rank tests exercise every collective the engine uses through this path.
// <cstdint> first: Debian 12's gloo headers use the fixed-width types without including it, which
// GCC 13's standard library no longer brings in through others (a GPU image may be newer than Debian 12).
#include <cstdint>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>

#include "dist/comm.h"

namespace zb {

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const World& world,
                                                    std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  // Loopback for single-machine jobs; GLOO_SOCKET_IFNAME picks an interface; else the address
  // this machine's hostname resolves to.
  const bool loopback = world.master_addr.rfind("127.", 0) == 0 || world.master_addr == "localhost";
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"))
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  else if (loopback)
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  else
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  opts->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, static_cast<int>(world.rank),
                                                     static_cast<int>(world.size), opts);
}

}  // namespace zb
