#pragma once
// FP8 applied to a Llama from outside it, as a converter: the model multiplies its projections
// through whatever Projections it is given (model/llama.h), and apply_float8 gives it FP8's for
// those [float8] takes (float8.h).
#include <memory>
#include <string>
#include <vector>

#include "float8/float8.h"
#include "model/llama.h"

namespace zb {

class Float8Projections : public Projections {
 public:
  // `names[layer]`: block `layer`'s projections ("wq", .., "w3") in FP8.
  Float8Projections(Float8Linears float8, std::vector<std::vector<std::string>> names)
      : float8_(std::move(float8)), names_(std::move(names)) {}
  bool takes(int64_t layer, const std::string& name) const override;
  // float8_linears under the recipe: x cast once for all the weights.
  std::vector<at::Tensor> linears(int64_t layer, const at::Tensor& x,
                                  const std::vector<at::Tensor>& weights) const override;

 private:
  Float8Linears float8_;
  std::vector<std::vector<std::string>> names_;
};

// Puts `model`'s block projections in FP8 where `float8` takes them, with `tokens` in a
// micro-batch's GEMMs (this rank's slice of each under tensor parallelism; shared key/value heads
// read kv_heads of them); nothing where it is not enabled. Returns the names of those left in the
// compute dtype because of their shape, "layers.0.attention.wq [out x in]" (for the start-up log).
std::vector<std::string> apply_float8(Llama& model, const Float8Linears& float8, int64_t tokens);

}  // namespace zb
