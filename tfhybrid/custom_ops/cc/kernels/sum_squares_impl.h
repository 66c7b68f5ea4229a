// Row-wise AdaGrad's sum of a gradient row's squares, the one definition of its order.
//
// No include guard on purpose: isa_kernels_impl.h includes it inside each dispatch
// level's namespace (so each level vectorizes it for its own vectors) and
// chunked_kernels.cc in the library's namespace, so that FIITED's pools and the dense
// kernels add the same squares in the same order: a pool whose rows hold every entry
// updates bit for bit like a dense table.

// Sum of g[0, D)^2 in 16 fixed lanes (g[d] into lane d % 16 while a whole group of 16
// remains, the rest into lane 0), the lanes then added in a fixed tree (j += j + w for
// w = 8, 4, 2, 1): the same float result at every vector width (and it vectorizes).
inline float SumSquares(const float* __restrict g, int64_t D) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {0};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += g[d + j] * g[d + j];
  }
  for (; d < D; ++d) lanes[0] += g[d] * g[d];
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  }
  return lanes[0];
}
