#pragma once
// The reference's Muon cases, stepped through by our one-process Muon (tests/test_muon.cpp and
// tests/test_muon_ranks.cpp check them against different references).
#include <ATen/ATen.h>

#include <string>

#include "optim/muon.h"
#include "reference_data.h"

namespace zb {

// Our Muon, one process, through each of the reference's cases (both update scales; square, wide
// and tall matrices; lr 0.02, weight decay 0.1, momentum 0.95, Nesterov), step by step on its
// gradients: check(case, step, hyperparameters, lr x scale, parameters before, parameters, muon)
// after each step.
template <class Check>
void run_muon_cases(const reference::ReferenceData& ref, Check check) {
  const int steps = ref.manifest["steps"];
  for (const std::string scale : {"original", "match_rms_adamw"}) {
    for (const std::string shape : {"square", "wide", "tall"}) {
      const std::string c = scale + "/" + shape;
      MuonHyper h;
      h.lr = 0.02;
      h.weight_decay = 0.1;
      h.momentum = 0.95;
      h.update_scale = scale;
      Muon muon(h);
      at::Tensor p = ref[c + "/param0"].clone().requires_grad_(true);
      muon.add_param("w", p);
      const double lr_scale = h.lr * muon_update_scale(scale, p.size(0), p.size(1));
      for (int s = 1; s <= steps; ++s) {
        const at::Tensor before = p.detach().clone();
        p.mutable_grad() = ref[c + "/grad" + std::to_string(s)].clone();
        muon.step(1.0);
        check(c, std::to_string(s), h, lr_scale, before, p, muon);
      }
    }
  }
}

}  // namespace zb
