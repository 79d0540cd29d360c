// diloco_peers: the membership service of an elastic DiLoCo run (diloco/peers.h). Start it once,
// where every replica can reach it, then each replica with diloco.peers = "this host:PORT".
//
//   diloco_peers --port 29600 --replicas 3 [--timeout_s 60]
//
// It decides who takes part in each outer step and ends when the run does (exit 0), or when
// every replica is lost (exit 1).
#include <cstdio>
#include <string>

#include <cxxopts.hpp>

#include "diloco/peers.h"
#include "util/device.h"
#include "util/log.h"

int main(int argc, char** argv) {
  cxxopts::Options options("diloco_peers", "the membership service of an elastic DiLoCo run");
  options.add_options()("port", "the port to serve the replicas' store on", cxxopts::value<int64_t>())(
      "replicas", "replicas the run starts with", cxxopts::value<int64_t>()->default_value("1"))(
      "timeout_s", "seconds without a heartbeat after which a replica is lost (the replicas' runtime.timeout_s)",
      cxxopts::value<int64_t>()->default_value("60"))("h,help", "this help");
  try {
    const auto args = options.parse(argc, argv);
    if (args.count("help") || !args.count("port")) {
      std::printf("%s\n", options.help().c_str());
      return args.count("help") ? 0 : 2;
    }
    zb::PeersOptions peers;
    peers.port = args["port"].as<int64_t>();
    peers.replicas = args["replicas"].as<int64_t>();
    peers.timeout = std::chrono::seconds(args["timeout_s"].as<int64_t>());
    if (peers.replicas < 1 || peers.timeout.count() <= 0 || peers.port <= 0 || peers.port > 65535) {
      std::fprintf(stderr, "diloco_peers: --replicas and --timeout_s must be positive, --port in 1..65535\n");
      return 2;
    }
    zb::log::init(0, "info");
    return zb::end_process(zb::serve_peers(peers, [](const std::string& line) { zb::log::info("diloco_peers: " + line); }));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "diloco_peers: %s\n", e.what());
    return 1;
  }
}
