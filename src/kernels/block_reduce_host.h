#pragma once
// The kernels' block reductions as a GPU runs them, for their host emulations (the *_on_host
// functions of kernels/*_kernel.cu): each warp's 32 lanes combined by xor-shuffles (lane i with lane
// i ^ 16, then ^ 8, ... ^ 1), then lane 0 of every warp likewise, as warp 0 does from shared
// memory. Lanes past the block's threads, and warps past its last, hold `none`. The same pairs in
// the same order, so the host sees the rounding and the special values (NaN, infinities) a GPU
// would.
#include <algorithm>
#include <cstddef>
#include <vector>

namespace zb {

template <class T, class Combine>
T combine_as_shuffles(std::vector<T> lanes, const T& none, Combine combine) {
  auto butterfly = [&](std::vector<T>& v, size_t first) {
    for (int offset = 16; offset > 0; offset /= 2) {
      std::vector<T> next(32, none);
      for (int i = 0; i < 32; ++i) next[i] = combine(v[first + i], v[first + (i ^ offset)]);
      std::copy(next.begin(), next.end(), v.begin() + static_cast<std::ptrdiff_t>(first));
    }
  };
  lanes.resize((lanes.size() + 31) / 32 * 32, none);
  std::vector<T> warps;
  for (size_t w = 0; w < lanes.size(); w += 32) {
    butterfly(lanes, w);
    warps.push_back(lanes[w]);
  }
  warps.resize(32, none);
  butterfly(warps, 0);
  return warps[0];
}

}  // namespace zb
