#pragma once
// Runs a Python reference script (PyTorch's own implementation) and reads back the tensors it
// wrote: OUTDIR/manifest.json naming raw float32 files.
#include <ATen/ATen.h>

#include <cstdlib>
#include <unistd.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace zb::reference {

struct ReferenceData {
  nlohmann::json manifest;
  std::map<std::string, at::Tensor> tensors;
  const at::Tensor& operator[](const std::string& name) const {
    auto it = tensors.find(name);
    if (it == tensors.end()) throw std::runtime_error("reference tensor missing: " + name);
    return it->second;
  }
};

// `script` relative to tests/reference/; `args` appended after it, then the output directory.
inline ReferenceData run_reference(const std::string& script, const std::string& args) {
  // (No std::filesystem here: libtorch.so exports some std::filesystem symbols of its own that
  // interpose on libstdc++'s and crash, remove_all among them.)
  char tmpl[] = "/tmp/zb_ref_XXXXXX";
  if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  const std::string dir = tmpl;
  const std::string cmd = std::string(ZB_PYTHON) + " " + ZB_SOURCE_DIR + "/tests/reference/" +
                          script + " " + args + " " + dir;
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("reference script failed: " + cmd);
  ReferenceData data;
  std::ifstream(dir + "/manifest.json") >> data.manifest;
  for (const auto& [name, entry] : data.manifest.items()) {
    if (!entry.is_object()) continue;
    std::vector<int64_t> shape = entry["shape"];
    at::Tensor t = at::empty(shape, at::kFloat);
    std::ifstream in(dir + "/" + entry["file"].get<std::string>(), std::ios::binary);
    in.read(reinterpret_cast<char*>(t.data_ptr<float>()), t.numel() * sizeof(float));
    if (!in) throw std::runtime_error("short reference file for " + name);
    data.tensors[name] = t;
  }
  std::system(("rm -rf " + dir).c_str());
  return data;
}

}  // namespace zb::reference
